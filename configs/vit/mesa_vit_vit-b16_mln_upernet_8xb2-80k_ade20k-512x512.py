# vit_vit-b16_mln_upernet_8xb2-80k_ade20k-512x512 (mmseg's config) trained with Mesa.
_base_ = ['mmseg::vit/vit_vit-b16_mln_upernet_8xb2-80k_ade20k-512x512.py', '../_base_/mesa.py']
