"""mmseg_mesa.constants: constant tensors kept once per value, dtype and device."""
import torch

from mmseg_mesa.constants import filled
from mmseg_mesa.state import CONSTANTS


def test_filled_views_one_buffer_per_value_grown_to_the_largest_size():
    like = torch.zeros(3)
    small = filled(1.0, (2, 3), like)
    assert small.shape == (2, 3) and small.is_contiguous() and bool((small == 1).all())
    assert filled(1.0, (6,), like).data_ptr() == small.data_ptr()  # the same buffer, no fill
    large = filled(1.0, (4, 5), like)
    assert bool((large == 1).all()) and CONSTANTS[1.0, torch.float32, like.device].numel() >= 20
    assert filled(1.0, (2, 3), like).data_ptr() == large.data_ptr()
    assert bool((small == 1).all())  # views of a replaced buffer stay valid
    zero = filled(0.0, (), like, torch.float64)
    assert zero.dtype == torch.float64 and zero.dim() == 0 and float(zero) == 0.0


def test_filled_under_inference_mode_is_made_afresh_and_not_kept():
    like = torch.zeros(3)
    kept = filled(2.0, (3,), like)
    with torch.inference_mode():
        fresh = filled(2.0, (3,), like)
    assert fresh.data_ptr() != kept.data_ptr() and bool((fresh == 2).all())
    assert filled(2.0, (3,), like).data_ptr() == kept.data_ptr()
