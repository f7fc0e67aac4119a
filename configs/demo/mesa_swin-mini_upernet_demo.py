# The demo baseline (swin-mini_upernet_demo.py) trained with Mesa: 8-bit saved activations.
_base_ = ['./_base_/swin-mini_upernet_demo_common.py', '../_base_/mesa.py']
# Both the Mesa hook (from _base_/mesa.py) and the demo dataset class must be registered.
custom_imports = dict(imports=['mmseg_mesa.integrations', 'mmseg_mesa.demo'],
                      allow_failed_imports=False)
