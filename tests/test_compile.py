"""Mesa under torch.compile: every Mesa module is one op of the graph (``mmseg_mesa.opaque``),
whose body is the module's eager Mesa forward and whose backward is that forward's graph."""
from __future__ import annotations

import copy
import gc
import os.path as osp

import pytest
import torch
from torch import nn

from mmseg_mesa import MesaConfig, convert_to_mesa, opaque
from mmseg_mesa.bench.compiled import break_sites, compiled_graphs, step_gradients
from mmseg_mesa.bench.fidelity import relative_error
from mmseg_mesa.bench.models import build_model, load_config, loss_of, make_batch
from mmseg_mesa.rounding import reset_rounding_generators

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py')


class Block(nn.Module):
    """A convolution, BatchNorm and an in-place ReLU whose input is read again after it wrote
    it; tokens through attention, LayerNorm, an MLP with GELU and residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        z = self.relu(y)
        t = (y + z).flatten(2).transpose(1, 2)  # y holds the ReLU's output, as in eager
        t = t + self.attn(t, t, t, need_weights=False)[0]  # a keyword, a tuple with None out
        return t + self.fc2(self.act(self.fc1(self.norm(t))))


def converted_block() -> nn.Module:
    torch.manual_seed(0)
    model = Block()
    convert_to_mesa(model, config=MesaConfig())
    return model.train()


def step(forward, model: nn.Module, x: torch.Tensor, fresh_stream: bool = True
         ) -> tuple[torch.Tensor, dict]:
    if fresh_stream:
        reset_rounding_generators()
    torch.manual_seed(1)
    out = forward(x)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize('backend', ['aot_eager', 'inductor'])
def test_compiled_step_is_the_eager_mesa_step(backend):
    """fullgraph: no graph break anywhere. Through aot_eager the code between the modules runs
    the eager ops, so the codes come out the same from the same rounding stream and the
    gradients are the eager step's up to the order of float sums; inductor's code rounds
    differently, which moves stochastic rounding's choices: its gradients are within the
    spread of two eager rounding draws."""
    torch._dynamo.reset()
    eager_model = converted_block()
    compiled_model = copy.deepcopy(eager_model)  # registered by its copy (__setstate__)
    x = torch.randn(2, 3, 8, 8)
    out, grads = step(eager_model, eager_model, x)
    compiled = torch.compile(compiled_model, backend=backend, fullgraph=True)
    for _ in range(2):  # the running estimates move the same way in both
        spare = copy.deepcopy(eager_model)  # the same state, for another rounding draw
        got_out, got = step(compiled, compiled_model, x)
        out, grads = step(eager_model, eager_model, x)
        assert torch.allclose(got_out, out, rtol=1e-5, atol=1e-6)
        if backend == 'aot_eager':
            assert relative_error(got, grads) < 1e-5
        else:
            spread = relative_error(step(spare, spare, x, fresh_stream=False)[1], grads)
            assert 0 < spread and relative_error(got, grads) < 2 * spread
    assert not opaque._GRAPHS  # every kept graph freed by its backward


def test_in_place_module_writes_its_input_as_in_eager():
    """The in-place ReLU's input, read again after it (``y + z``), holds its output in the
    compiled forward too (without the copy back it would hold ``y + relu(y)``)."""
    torch._dynamo.reset()
    model = converted_block()
    x = torch.randn(2, 3, 8, 8)
    eager = model(x)
    out = torch.compile(model, backend='aot_eager')(x)
    assert torch.allclose(out, eager, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        y = model.bn(model.conv(x))
    assert not torch.allclose(y + y.relu(), 2 * y.relu())


def test_graph_of_a_forward_without_backward_is_freed():
    torch._dynamo.reset()
    model = converted_block()
    compiled = torch.compile(model, backend='aot_eager')
    out = compiled(torch.randn(2, 3, 8, 8))
    assert len(opaque._GRAPHS) == 8  # conv, bn, relu, attn, norm, fc1, act, fc2: one op each
    del out
    gc.collect()
    assert not opaque._GRAPHS


@pytest.mark.slow
def test_demo_model_compiles_without_breaks_in_mesa_or_recompiles():
    """The demo model (Swin UPerNet) after its first eager step, as ``CompileHook`` compiles
    it: no graph break in a frame of mmseg_mesa, no recompile after the first compiled step,
    and gradients within the spread of two eager draws of the same step."""
    torch._dynamo.reset()
    cfg = load_config(DEMO)
    base = build_model(cfg, 'cpu')
    batch = make_batch(cfg, 2, (64, 64), 'cpu')
    model = copy.deepcopy(base)
    convert_to_mesa(model, config=MesaConfig())
    model.train()
    loss_of(model(*batch, mode='loss')).backward()  # settles the generic path
    model.zero_grad(set_to_none=True)
    eager = copy.deepcopy(model)
    _, exact = step_gradients(eager, eager, batch)
    _, again = step_gradients(eager, eager, batch)
    compiled = torch.compile(model, backend='aot_eager')
    _, got = step_gradients(compiled, model, batch)
    first = compiled_graphs()
    for _ in range(2):
        step_gradients(compiled, model, batch)
    assert compiled_graphs() == first
    spread = relative_error(again, exact)
    assert 0 < spread < 0.02
    assert relative_error(got, exact) < 2 * spread
    sites = break_sites(copy.deepcopy(eager), batch)
    assert sites['breaks_in_mmseg_mesa'] == []
    assert sites['graphs'] >= 1


def test_autocast_reaches_the_modules_as_in_eager():
    """Under CPU autocast (bf16) the compiled forward's modules compute in the dtypes they
    compute in eagerly: the autocast state at the call is an argument of the op."""
    torch._dynamo.reset()
    model = converted_block()
    x = torch.randn(2, 3, 8, 8)
    compiled = torch.compile(copy.deepcopy(model), backend='aot_eager')
    with torch.autocast('cpu', dtype=torch.bfloat16):
        eager = model(x)
        out = compiled(x)
    assert out.dtype == eager.dtype
    assert torch.allclose(out.float(), eager.float(), rtol=1e-2, atol=1e-2)
    assert (out.float() - eager.float()).abs().max() < (eager.float() - model(x)).abs().max()
