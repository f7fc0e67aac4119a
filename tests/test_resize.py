"""The heads' ``Resize``: its adjoint is torch's own backward of the resizing, bit for bit."""
import pytest
import torch
from mmseg.models.utils import resize

from mmseg_mesa.integrations.resize import Resize
from mmseg_mesa.layers.level_fusion import upsample_backward


@pytest.mark.parametrize('size', [(16, 20), (7, 5), (9, 11)])
@pytest.mark.parametrize('align_corners', [False, True, None])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float64])
def test_bilinear_adjoint_is_autograds(size, align_corners, dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 10, dtype=dtype, requires_grad=True)
    up = Resize(size, 'bilinear', align_corners)
    y = up(x)
    assert torch.equal(y, resize(x, size=size, mode='bilinear', align_corners=align_corners))
    grad = torch.randn(2, 6, *size, dtype=dtype)[:, 1:4]  # a channel slice, as a concatenation's
    y.backward(grad)
    got = upsample_backward(up, grad, x.shape, dtype)
    assert got.dtype == dtype and torch.equal(got, x.grad)


def test_other_modes_take_the_probe():
    """Nearest resizing names no adjoint: the probe's autograd gives torch's gradient."""
    x = torch.randn(1, 2, 4, 5, requires_grad=True)
    up = Resize((8, 10), 'nearest')
    y = up(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    assert up.adjoint(grad, x.shape) is None
    assert torch.equal(upsample_backward(up, grad, x.shape, x.dtype), x.grad)
