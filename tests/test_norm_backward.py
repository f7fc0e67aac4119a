"""The normalization backwards, held to torch's own norms' gradients on exact statistics."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mmseg_mesa.layers.norm_backward as norm_backward
from mmseg_mesa.layers.norm import MesaLayerNormFunction
from mmseg_mesa.layers.norm_backward import NormSets, normalization_backward
from mmseg_mesa.quantizer import ActivationQuantizer, QuantSpec

EPS = 1e-5


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).norm() <= 1e-5 * b.norm())


def exact(norm, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
          grad: torch.Tensor) -> list[torch.Tensor | None]:
    """torch's gradients of ``norm(x, weight, bias)`` (None for a missing parameter)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (x, weight, bias)]
    norm(*leaves).backward(grad)
    return [None if t is None else t.grad for t in leaves]


def group_norm_case(affine: bool):
    x = torch.randn(2, 8, 5, 3) * torch.logspace(-2, 1, 8).view(1, 8, 1, 1)
    g = x.reshape(2, 4, -1)
    var, mean = torch.var_mean(g, -1, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + EPS)
    w, b = (torch.rand(8) + 0.5, torch.randn(8)) if affine else (None, None)
    return (x, ((g - mean) * rstd).view(x.shape), rstd, w, b, NormSets.channel_groups(4),
            lambda x, w, b: F.group_norm(x, 4, w, b, EPS))


def batch_norm_case(affine: bool):
    x = torch.randn(4, 6, 5, 5) * torch.logspace(-2, 1, 6).view(1, 6, 1, 1) + 2.0
    var, mean = torch.var_mean(x, (0, 2, 3), correction=0, keepdim=True)
    rstd = torch.rsqrt(var + EPS)
    w, b = (torch.rand(6) + 0.5, torch.randn(6)) if affine else (None, None)
    return (x, (x - mean) * rstd, rstd, w, b, NormSets.channels(),
            lambda x, w, b: F.batch_norm(x, None, None, w, b, True, 0.0, EPS))


@pytest.mark.parametrize('affine', [True, False])
@pytest.mark.parametrize('case', [group_norm_case, batch_norm_case])
@pytest.mark.parametrize('fused_bytes', [1 << 40, 0])
def test_every_norm_gets_torchs_gradients_from_its_normalized_input(monkeypatch, case, affine,
                                                                    fused_bytes):
    """Each norm's sets, with the exact normalized input and 1/std, give torch's gradients;
    BatchNorm's in-place formula (``fused_bytes`` 0) as well as torch's fused kernel."""
    monkeypatch.setattr(norm_backward, 'FUSED_BACKWARD_BYTES', fused_bytes)
    torch.manual_seed(0)
    x, x_norm, rstd, w, b, sets, norm = case(affine)
    grad = torch.randn(x.shape)
    want = exact(norm, x, w, b, grad)
    got = normalization_backward(grad, x_norm.clone(), rstd, w, b, sets, (True, True, True))
    assert len(got) == 3
    for g, e in zip(got, want):
        assert (g is None) == (e is None)
        if e is not None:
            assert g.shape == e.shape and close(g, e)


def test_needs_leave_the_unwanted_gradients_out():
    torch.manual_seed(0)
    for case in (group_norm_case, batch_norm_case):
        x, x_norm, rstd, w, b, sets, _ = case(True)
        got = normalization_backward(torch.randn(x.shape), x_norm, rstd, w, b, sets,
                                     (False, True, False))
        assert got[0] is None and got[1] is not None and got[2] is None


def test_set_sums_replace_the_local_ones_in_the_input_gradient_only():
    """SyncBatchNorm hands the sums of every rank: the input gradient follows them, the weight
    and bias gradients stay local. Sums of a batch twice as large (the same batch on a second
    rank) give the gradient of that batch's half."""
    torch.manual_seed(0)
    x, _, _, w, b, sets, norm = batch_norm_case(True)
    both = torch.cat([x, x.flip(0)])
    grad = torch.randn(both.shape)
    want = exact(norm, both, w, b, grad)
    var, mean = torch.var_mean(both, (0, 2, 3), correction=0, keepdim=True)
    rstd = torch.rsqrt(var + EPS)
    x_norm = (both - mean) * rstd
    dims = (0, 2, 3)
    sums = (grad.sum(dims, keepdim=True), (grad * x_norm).sum(dims, keepdim=True),
            both.numel() / both.shape[1])
    half = slice(0, x.shape[0])
    got = normalization_backward(grad[half], x_norm[half].clone(), rstd, w, b, sets,
                                 (True, True, True), set_sums=sums)
    assert close(got[0], want[0][half])
    assert close(got[1], (grad[half] * x_norm[half]).sum(dims))
    assert close(got[2], grad[half].sum(dims))


@pytest.mark.parametrize('affine', [True, False])
def test_layer_norm_gets_torchs_gradients_from_its_decoded_centered_input(affine):
    """LayerNorm's backward is torch's kernel on ``x_norm / rstd`` decoded in one call
    (``unpack_divided``): from 16-bit codes it gives torch's gradients, tokens of spreads over
    three decades and a constant one included."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16) * torch.logspace(-2, 1, 5).view(1, 5, 1) + 0.5
    x[0, 0] = 2.0  # a constant token: its x_norm is 0 exactly
    w, b = (torch.rand(16) + 0.5, torch.randn(16)) if affine else (None, None)
    grad = torch.randn(x.shape)
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    quantizer = ActivationQuantizer(QuantSpec(bits=16, group_dim=-1))
    MesaLayerNormFunction.apply(leaves[0], (16,), leaves[1], leaves[2], EPS,
                                quantizer).backward(grad)
    want = exact(lambda x, w, b: F.layer_norm(x, (16,), w, b, EPS), x, w, b, grad)
    for got, e in zip(leaves, want):
        assert (got is None) == (e is None)
        if e is not None:
            assert bool((got.grad - e).norm() <= 1e-4 * e.norm()), (got.grad - e).norm() / e.norm()
