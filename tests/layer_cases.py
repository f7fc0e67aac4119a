"""Each Mesa layer next to the torch layer it replaces, with inputs of awkward shapes."""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from conftest import cosine, drawn
from torch import nn

from mmseg_mesa import MesaConfig
from mmseg_mesa.layers import (
    MesaBatchNorm,
    MesaConv2d,
    MesaDropout,
    MesaGELU,
    MesaLayerNorm,
    MesaLinear,
    MesaMatMul,
    MesaReLU,
    MesaSoftmax,
)
from mmseg_mesa.memory import count_saved_tensors


class TorchMatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


@dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]
    shapes: list[tuple[int, ...]]
    mesa: Callable[[nn.Module, MesaConfig], nn.Module]
    exact_grad: bool = False  # ReLU / Dropout masks are lossless
    memory_shapes: list[tuple[int, ...]] | None = None  # big enough that group stats are small
    input_scale: float = 1.0

    def inputs(self, dtype=torch.float32, big=False):
        shapes = (self.memory_shapes or [(16 * s[0],) + s[1:] for s in self.shapes]) if big \
            else self.shapes
        return [(torch.randn(s) * self.input_scale).to(dtype).requires_grad_() for s in shapes]


def _swap(cls):
    return lambda module, cfg: cls.convert(module, cfg)


CASES = [
    Case('linear', lambda: nn.Linear(37, 45), [(3, 7, 37)], _swap(MesaLinear)),
    Case('linear_nobias', lambda: nn.Linear(64, 16, bias=False), [(5, 64)], _swap(MesaLinear),
         memory_shapes=[(8, 49, 64)]),
    Case('conv2d', lambda: nn.Conv2d(5, 7, 3, stride=2, padding=1), [(2, 5, 9, 11)],
         _swap(MesaConv2d)),
    Case('conv2d_grouped_dilated', lambda: nn.Conv2d(6, 4, 3, padding=2, dilation=2, groups=2),
         [(2, 6, 8, 7)], _swap(MesaConv2d)),
    Case('conv2d_reflect', lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode='reflect'),
         [(2, 3, 6, 5)], _swap(MesaConv2d)),
    Case('gelu', lambda: nn.GELU(), [(3, 7, 37)], _swap(MesaGELU)),
    Case('gelu_tanh', lambda: nn.GELU(approximate='tanh'), [(3, 7, 37)], _swap(MesaGELU)),
    Case('softmax', lambda: nn.Softmax(dim=-1), [(2, 3, 7, 9)], _swap(MesaSoftmax)),
    Case('layernorm', lambda: nn.LayerNorm(37), [(3, 7, 37)], _swap(MesaLayerNorm)),
    Case('layernorm_2d', lambda: nn.LayerNorm((5, 6)), [(3, 4, 5, 6)], _swap(MesaLayerNorm)),
    # LayerNorm keeps 4 bytes of 1/std per token: realistic widths (>= 64) for the bytes test
    Case('layernorm_noaffine', lambda: nn.LayerNorm(64, elementwise_affine=False),
         [(4, 64)], _swap(MesaLayerNorm), memory_shapes=[(8, 49, 64)]),
    Case('batchnorm2d', lambda: nn.BatchNorm2d(5), [(4, 5, 6, 7)], _swap(MesaBatchNorm)),
    # PPM's pooled branch: two values per channel, spread far below eps (variance << 1e-5).
    Case('batchnorm2d_two_values', lambda: nn.BatchNorm2d(8), [(2, 8, 1, 1)],
         _swap(MesaBatchNorm), input_scale=1e-3, memory_shapes=[(64, 8, 4, 4)]),
    Case('relu', lambda: nn.ReLU(), [(3, 7, 37)], _swap(MesaReLU), exact_grad=True),
    Case('dropout', lambda: nn.Dropout(0.3), [(3, 7, 37)], _swap(MesaDropout), exact_grad=True),
    Case('matmul', lambda: TorchMatMul(), [(2, 3, 7, 5), (2, 3, 5, 6)],
         lambda _m, cfg: MesaMatMul(mesa_config=cfg),
         memory_shapes=[(4, 3, 49, 32), (4, 3, 32, 49)]),
    Case('matmul_broadcast', lambda: TorchMatMul(), [(2, 3, 7, 5), (3, 5, 6)],
         lambda _m, cfg: MesaMatMul(mesa_config=cfg), memory_shapes=[(4, 3, 49, 32), (3, 32, 49)]),
]


# What every per-layer test file (test_layers.py, test_cnn_layers.py) does with a Case.

def pair(case: Case, dtype=torch.float32, config=None):
    ref = case.make().to(dtype)
    return ref, case.mesa(copy.deepcopy(ref), config or MesaConfig())


def run(module, xs, seed=0):
    torch.manual_seed(seed)
    return module(*xs)


def upstream_grad(y):
    """Random upstream gradient from its own generator (never equal to the inputs' draws)."""
    gen = torch.Generator().manual_seed(1234)
    return drawn(torch.randn, y.shape, generator=gen).to(y.dtype)


def backward_both(*outputs):
    """Backpropagate one upstream gradient (``upstream_grad`` of the first) through every
    output, so torch's module and ours are compared on the same gradient."""
    grad = upstream_grad(outputs[0])
    for y in outputs:
        y.backward(grad.to(y.dtype))


def clones(xs):
    return [x.detach().clone().requires_grad_() for x in xs]


def grad_pairs(ref, ours, xs, xs2):
    return ([(a.grad, b.grad) for a, b in zip(xs, xs2)]
            + [(p.grad, q.grad) for p, q in zip(ref.parameters(), ours.parameters())])


def saved_bytes(module, xs):
    """Bytes saved for backward by one forward, and its output."""
    with count_saved_tensors(module) as report:
        out = module(*xs)
    return report.total_bytes, out


def check_forward_is_bit_identical(case: Case, dtype: torch.dtype, train: bool) -> None:
    """The converted layer's output is torch's, bit for bit, in training and in eval mode."""
    ref, ours = pair(case, dtype)
    ref.train(train)
    ours.train(train)
    xs = case.inputs(dtype)
    assert torch.equal(run(ref, xs), run(ours, clones(xs)))


def check_disabled_and_eval(case: Case) -> None:
    """Disabled: the torch path, saving exactly what torch saves. Eval: bit-identical outputs
    and running estimates untouched."""
    ref, ours = pair(case, config=MesaConfig(enabled=False))
    xs = case.inputs()
    assert saved_bytes(ours, clones(xs))[0] == saved_bytes(ref, xs)[0]
    ref, ours = pair(case)
    ours.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(run(ref, xs), run(ours, xs))
    for buffer_name, buffer in ours.named_buffers():
        if buffer_name.endswith(('lower', 'span', 'seen')):
            assert buffer.numel() == 0, 'eval mode must not touch running estimates'


def check_autocast(case: Case) -> None:
    """bf16 autocast: bit-identical outputs, gradients of torch's dtypes and direction."""
    ref, ours = pair(case)
    xs = case.inputs()
    xs2 = clones(xs)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y, y2 = run(ref, xs), run(ours, xs2)
    assert y.dtype == y2.dtype and torch.equal(y, y2)
    backward_both(y, y2)
    for expected, got in grad_pairs(ref, ours, xs, xs2):
        assert got.dtype == expected.dtype
        assert cosine(expected, got) >= 0.99
