"""The compiled kernels' speed: observe / quantize / dequantize against a copy and the
pure-PyTorch reference, and a converted Swin-like window-attention block against the plain one.

Needs only torch and ``mmseg_mesa`` (not mmengine or mmseg). ``tools/benchmark_kernels.py`` is
the command line over it; ``markdown`` is its report.
"""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa
from mmseg_mesa.layers import MatMul
from mmseg_mesa.quantizer import (
    Packed,
    QuantSpec,
    ema_update,
    group_min_max,
    scale_from_span,
)
from mmseg_mesa.reference import dequantize_reference, quantize_reference

# name, shape, group_dim, group_size: Swin-T at 224x224, batch 64, stage 1.
KERNEL_CASES = [
    ('hidden (64*3136, 96), groups of 32', (64, 3136, 96), 2, 32),
    ('attention (64*64, 3, 49, 49), per head', (4096, 3, 49, 49), 1, 1),
]
# The same on CPU at sizes a CPU step sees: Linear / LayerNorm inputs grouped over their last
# dim (channels last, one group per channel) and a conv input grouped over channels.
CPU_KERNEL_CASES = [
    ('tokens (8, 1024, 128), per channel', (8, 1024, 128), 2, 1),
    ('feature map (8, 128, 64, 64), per channel', (8, 128, 64, 64), 1, 1),
]
# name, windows, dim, heads: stage 1 and stage 3 of Swin-T, batch 32, 7x7 windows.
BLOCK_CASES = [
    ('Swin-T stage 1 block', 32 * 64, 96, 3),
    ('Swin-T stage 3 block', 32 * 4, 384, 12),
]


def time_ms(fn: Callable[[], object], device: str = 'cuda', iters: int = 10,
            repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls, in ms."""
    fn()
    if device != 'cuda':
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - start) * 1e3 / iters)
        return statistics.median(samples)
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def bench_activation(kernels, name: str, shape: tuple[int, ...], dim: int, group_size: int,
                     dtype: torch.dtype, device: str = 'cuda') -> list[dict]:
    x = torch.randn(shape, device=device).to(dtype)
    groups = -(-shape[dim] // group_size)
    lower = torch.zeros(groups, device=device)
    span = torch.zeros(groups, device=device)
    seen = torch.zeros(groups, dtype=torch.bool, device=device)
    kernels.observe(x, lower, span, seen, dim, group_size, 0.9)
    scale = scale_from_span(span, 8)
    codes = kernels.quantize(x, lower, scale, 8, dim, group_size, False)
    packed = Packed(codes, lower, scale, x.shape, dtype, 8, dim, group_size)
    nearest = QuantSpec(8, dim, group_size, stochastic=False)
    stochastic = QuantSpec(8, dim, group_size, stochastic=True)
    state = (lower.clone(), span.clone(), seen.clone())  # observe updates it in place
    copy_dst = torch.empty_like(x)
    copy_gbs = 2 * x.nbytes / time_ms(lambda: copy_dst.copy_(x), device) / 1e6
    n, item = x.numel(), x.element_size()

    def reference_observe():
        ema_update(*state, *group_min_max(x, dim, group_size), 0.9)

    ops = {  # op -> (kernel call, reference call, bytes read + written)
        'observe': (lambda: kernels.observe(x, *state, dim, group_size, 0.9),
                    reference_observe, n * item),
        'quantize (nearest)': (
            lambda: kernels.quantize(x, lower, scale, 8, dim, group_size, False),
            lambda: quantize_reference(x, lower, scale, nearest, dim), n * (item + 1)),
        'quantize (stochastic)': (
            lambda: kernels.quantize(x, lower, scale, 8, dim, group_size, True),
            lambda: quantize_reference(x, lower, scale, stochastic, dim), n * (item + 1)),
        'dequantize': (
            lambda: kernels.dequantize(codes, lower, scale, dim, group_size, dtype),
            lambda: dequantize_reference(codes, packed), n * (1 + item)),
    }
    rows = []
    for op, (kernel_fn, reference_fn, nbytes) in ops.items():
        kernel_ms = time_ms(kernel_fn, device)
        reference_ms = time_ms(reference_fn, device, iters=3, repeats=3)
        gbs = nbytes / kernel_ms / 1e6
        rows.append(dict(case=name, dtype=str(dtype).replace('torch.', ''), op=op, ms=kernel_ms,
                         ns_per_element=kernel_ms * 1e6 / n, gb_per_s=gbs,
                         copy_gb_per_s=copy_gbs, of_copy=gbs / copy_gbs,
                         speedup_vs_torch=reference_ms / kernel_ms))
    return rows


def bench_kernels(kernels, device: str = 'cuda') -> list[dict]:
    cases = KERNEL_CASES if device == 'cuda' else CPU_KERNEL_CASES
    return [row for name, shape, dim, group_size in cases
            for dtype in (torch.float32, torch.bfloat16)
            for row in bench_activation(kernels, name, shape, dim, group_size, dtype, device)]


class WindowBlock(nn.Module):
    """A Swin block on pre-partitioned windows ``(windows, tokens, dim)``; its two attention
    matmuls are ``mmseg_mesa.layers.MatMul`` modules, which conversion turns into ``MesaMatMul``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.qk = MatMul()
        self.softmax = nn.Softmax(dim=-1)
        self.av = MatMul()
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        windows, tokens, dim = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(windows, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = self.softmax(self.qk(q * self.scale, k.transpose(-2, -1)))
        out = self.av(attn, v).transpose(1, 2).reshape(windows, tokens, dim)
        x = x + self.proj(out)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def training_step(block: nn.Module, x: torch.Tensor, grad: torch.Tensor,
                  bf16: bool) -> Callable[[], None]:
    def step() -> None:
        block.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast('cuda', torch.bfloat16, enabled=bf16):
            out = block(x)
        out.backward(grad.to(out.dtype))

    return step


def bench_blocks() -> list[dict]:
    rows = []
    for name, windows, dim, heads in BLOCK_CASES:
        plain = WindowBlock(dim, heads).cuda().train()
        variants = {'plain': plain}
        for backend in ('cuda', 'torch'):
            variants[f'mesa ({backend})'] = copy.deepcopy(plain)
            convert_to_mesa(variants[f'mesa ({backend})'], config=MesaConfig(backend=backend))
        x = torch.randn(windows, 49, dim, device='cuda', requires_grad=True)
        grad = torch.randn(windows, 49, dim, device='cuda')
        for precision in ('fp32', 'bf16 autocast'):
            baseline_ms = None
            for variant, block in variants.items():
                step = training_step(block, x, grad, bf16=precision != 'fp32')
                step()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak_mib = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                ms = time_ms(step, iters=5, repeats=5)
                baseline_ms = baseline_ms or ms
                rows.append(dict(case=name, precision=precision, variant=variant, ms=ms,
                                 ratio_to_plain=ms / baseline_ms, peak_mib=peak_mib))
    return rows


def markdown(rows: list[dict], columns: dict[str, str]) -> str:
    lines = ['| ' + ' | '.join(columns.values()) + ' |',
             '|' + '|'.join('---' for _ in columns) + '|']
    for row in rows:
        cells = [f'{row[key]:.3g}' if isinstance(row[key], float) else str(row[key])
                 for key in columns]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)
