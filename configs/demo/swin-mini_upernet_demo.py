# Tiny Swin-UPerNet on the generated demo dataset, trained on CPU: the baseline of `tools/demo.py`.
#   python tools/train.py configs/demo/swin-mini_upernet_demo.py \
#       --cfg-options train_dataloader.dataset.data_root=DIR val_dataloader.dataset.data_root=DIR
# (write the data first with `mmseg_mesa.demo.write_demo_dataset(DIR)`; `tools/demo.py` does all.)
_base_ = ['./_base_/swin-mini_upernet_demo_common.py']
custom_imports = dict(imports=['mmseg_mesa.demo'], allow_failed_imports=False)
