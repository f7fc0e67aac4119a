# Swin-Small UPerNet on ADE20K (mmseg's config) trained with Mesa.
_base_ = [
    'mmseg::swin/swin-small-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/mesa.py',
]
