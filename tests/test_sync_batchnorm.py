"""MesaSyncBatchNorm: 2-process gloo runs on CPU against BatchNorm on the global batch.

torch's own SyncBatchNorm refuses CPU tensors in its synchronized path, so the reference is
``nn.BatchNorm{1,2,3}d`` applied to the concatenation of every rank's batch, with the loss summed
over ranks (the input gradient of SyncBN is the gradient of that sum; the weight/bias gradients
it returns are local and DDP averages them, so their all-reduced sum is compared).

The layer cases run in one pair of processes (a module fixture); the assertions run here, on
metrics that rank 0 gathered over both ranks.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import warnings
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import cosine
from torch import nn

import mmseg_mesa.handlers  # noqa: F401  (imported once here; forked ranks inherit it)
from mmseg_mesa import MesaConfig, MesaModule, convert_to_mesa
from mmseg_mesa.layers.sync_batchnorm import MesaSyncBatchNorm
from mmseg_mesa.memory import count_saved_tensors

WORLD_SIZE = 2
CHANNELS = 6
FP32_ATOL = 2e-5
GRAD_COSINE = 0.999
MAX_SAVED_RATIO = 0.27
# name -> (per-rank batch sizes, spatial shape, channels_last, dtype under autocast or None,
#          momentum)
LAYER_CASES = {
    'even': ((3, 3), (9, 7), False, None, 0.1),
    'uneven': ((2, 5), (9, 7), False, None, 0.1),
    'uneven_channels_last': ((4, 1), (9, 7), True, None, 0.1),
    'empty_rank': ((0, 4), (9, 7), False, None, 0.1),
    'cumulative_momentum': ((3, 2), (9, 7), False, None, None),
    'bf16_autocast': ((3, 3), (9, 7), True, torch.bfloat16, 0.1),
    'features_2d': ((9, 14), (), False, None, 0.1),
    'sequence_3d': ((2, 3), (11,), False, None, 0.1),
    'volume_5d': ((1, 2), (3, 4, 5), False, None, 0.1),
}
REFERENCE_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ['GLOO_SOCKET_IFNAME'] = 'lo'  # keep gloo's own connections on 127.0.0.1
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, *args: object, world_size: int = WORLD_SIZE) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` processes joined by a gloo process group.

    Forked where possible: a forked child starts in well under a second, a spawned one imports
    torch, mmcv and mmseg again (about 10-20 s per test on 2 cores). The children use the CPU
    only and set one thread before any op, so fork's caveats (CUDA, OpenMP pools) do not apply.
    """
    method = 'fork' if 'fork' in mp.get_all_start_methods() else 'spawn'
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       join=True, start_method=method)


def dump(path: str, results: dict) -> None:
    with open(path, 'w') as f:
        json.dump(results, f, indent=1)


def global_cosine(local_a: torch.Tensor, local_b: torch.Tensor) -> float:
    """Cosine of two tensors split over ranks (possibly unevenly): dot products are all-reduced."""
    a, b = local_a.double().flatten(), local_b.double().flatten()
    sums = torch.stack([(a * b).sum(), a.square().sum(), b.square().sum()])
    dist.all_reduce(sums)
    return (sums[0] / (sums[1].sqrt() * sums[2].sqrt())).item()


def all_reduced(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


# ---------------------------------------------------------------------------------------------
# (a) + (b): the layer against BatchNorm2d on the global batch, and its saved bytes
# ---------------------------------------------------------------------------------------------

def _layer_case(rank: int, sizes: tuple[int, int], spatial: tuple[int, ...],
                channels_last: bool, dtype: torch.dtype | None, momentum: float | None) -> dict:
    gen = torch.Generator().manual_seed(7)
    ref = REFERENCE_BN[2 + len(spatial)](CHANNELS, momentum=momentum)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(CHANNELS, generator=gen) + 0.5)
        ref.bias.copy_(torch.randn(CHANNELS, generator=gen))
    ours = MesaSyncBatchNorm(CHANNELS, momentum=momentum)
    ours.load_state_dict(ref.state_dict())
    start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
    out: dict = {'output_max_abs_diff': 0.0, 'grad_x_cosine': 1.0, 'grad_w_cosine': 1.0,
                 'grad_b_cosine': 1.0, 'running_max_abs_diff': 0.0}
    for step in range(2):
        # Per-channel offsets and scales far from 0 / 1, as real features have.
        per_channel = (CHANNELS,) + (1,) * len(spatial)
        x_global = (torch.randn(sum(sizes), CHANNELS, *spatial, generator=gen)
                    * (torch.rand(per_channel, generator=gen) * 3 + 0.2)
                    + torch.randn(per_channel, generator=gen) * 4)
        g_global = torch.randn(x_global.shape, generator=gen)
        if dtype is not None:
            x_global = x_global.to(dtype)
        x_ref = x_global.clone().requires_grad_()
        x = x_global[start:stop].clone()
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        ref.weight.grad = ref.bias.grad = ours.weight.grad = ours.bias.grad = None
        device_type = 'cpu'
        with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            y_ref = ref(x_ref.float() if dtype is not None else x_ref)
            y = ours(x)
        assert y.dtype == x.dtype and y.shape == x.shape
        if channels_last:
            assert y.is_contiguous(memory_format=torch.channels_last)
        (y_ref * g_global).sum().backward()
        (y.float() * g_global[start:stop]).sum().backward()
        diff = torch.zeros(())
        if x.numel():
            diff = (y.float() - y_ref[start:stop].detach()).abs().max()
            assert x.grad.dtype == x.dtype and x.grad.shape == x.shape
        dist.all_reduce(diff, dist.ReduceOp.MAX)
        out['output_max_abs_diff'] = max(out['output_max_abs_diff'], diff.item())
        cos_x = global_cosine(x.grad.float(), x_ref.grad[start:stop].float())
        # The input gradient stays orthogonal to per-channel constants over the global batch (a
        # bias in front of BatchNorm keeps its zero gradient): re-standardization is global.
        dims = [0] + list(range(2, x.dim()))
        channel_sums = all_reduced(x.grad.double().sum(dims))
        grad_norm = all_reduced(x.grad.double().square().sum()).sqrt()
        out['grad_x_channel_sum_ratio'] = max(out.get('grad_x_channel_sum_ratio', 0.0),
                                              (channel_sums.abs().max() / grad_norm).item())
        out['grad_x_cosine'] = min(out['grad_x_cosine'], cos_x)
        out['grad_w_cosine'] = min(out['grad_w_cosine'],
                                   cosine(all_reduced(ours.weight.grad), ref.weight.grad))
        out['grad_b_cosine'] = min(out['grad_b_cosine'],
                                   cosine(all_reduced(ours.bias.grad), ref.bias.grad))
        running = max((ours.running_mean - ref.running_mean).abs().max().item(),
                      (ours.running_var - ref.running_var).abs().max().item())
        out['running_max_abs_diff'] = max(out['running_max_abs_diff'], running)
        assert ours.num_batches_tracked.item() == ref.num_batches_tracked.item() == step + 1
    return out


def _saved_bytes(rank: int) -> dict:
    x = torch.randn(4, 16, 16, 16) * 2 + 1
    ours = MesaSyncBatchNorm(16)
    ref = nn.BatchNorm2d(16)
    with count_saved_tensors(ours) as mesa_report:
        y = ours(x.clone().requires_grad_())
    with count_saved_tensors(ref) as ref_report:
        y_ref = ref(x.clone().requires_grad_())
    y.sum().backward()  # the collective of backward must run on every rank
    y_ref.sum().backward()
    return {'mesa_bytes': mesa_report.total_bytes, 'bn2d_bytes': ref_report.total_bytes,
            'ratio': mesa_report.total_bytes / ref_report.total_bytes}


def _frozen_input(rank: int) -> dict:
    """Only the affine parameters need gradients (a SyncBN right after the data)."""
    gen = torch.Generator().manual_seed(3)
    x_global = torch.randn(6, CHANNELS, 5, 5, generator=gen) * 2 - 1
    g_global = torch.randn(x_global.shape, generator=gen)
    local = slice(3 * rank, 3 * (rank + 1))
    ref, ours = nn.BatchNorm2d(CHANNELS), MesaSyncBatchNorm(CHANNELS)
    (ref(x_global) * g_global).sum().backward()
    (ours(x_global[local]) * g_global[local]).sum().backward()
    return {'grad_w_cosine': cosine(all_reduced(ours.weight.grad), ref.weight.grad),
            'grad_b_cosine': cosine(all_reduced(ours.bias.grad), ref.bias.grad)}


def _codes_kinds(rank: int) -> dict:
    """What each rank keeps where its own batch has 150 values per channel and the process
    group's 240 or 300: the global count decides (``batchnorm_refine_below``, 256)."""
    from mmseg_mesa.saved import load
    kinds = {}
    for width, compressor in ((12, 'mesa'), (15, 'mesa'), (12, 'division')):
        bn = nn.SyncBatchNorm(CHANNELS)
        convert_to_mesa(bn, config=MesaConfig(compressor=compressor))
        x = torch.randn(1, CHANNELS, 10, width, requires_grad=True)
        y = bn(x)
        kinds[f'{compressor} {2 * 10 * width}'] = type(load(y.grad_fn)[0]).__name__
        y.sum().backward()  # the collective of backward must run on every rank
    return kinds


def _layer_worker(rank: int, path: str) -> None:
    torch.manual_seed(100 + rank)  # stochastic rounding differs between ranks, as in training
    results = {name: _layer_case(rank, *case) for name, case in LAYER_CASES.items()}
    results['saved_bytes'] = _saved_bytes(rank)
    results['frozen_input'] = _frozen_input(rank)
    results['codes_kinds'] = _codes_kinds(rank)
    if rank == 0:
        dump(path, results)


@pytest.fixture(scope='module')
def layer_results(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp('sync_bn') / 'layer.json')
    spawn(_layer_worker, path)
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize('name', list(LAYER_CASES))
def test_matches_batchnorm_on_global_batch(layer_results, name):
    r = layer_results[name]
    dtype = LAYER_CASES[name][3]
    # bf16: one rounding of the fp32 result (|y| <= ~8 here, bf16 has 8 significant bits).
    atol = FP32_ATOL if dtype is None else 8 * 2 ** -8
    assert r['output_max_abs_diff'] <= atol, r
    assert r['running_max_abs_diff'] <= FP32_ATOL, r  # statistics are fp32 in both dtypes
    for key in ('grad_x_cosine', 'grad_w_cosine', 'grad_b_cosine'):
        assert r[key] >= GRAD_COSINE, (key, r)
    assert r['grad_x_channel_sum_ratio'] <= (1e-5 if dtype is None else 1e-2), r


def test_frozen_input(layer_results):
    r = layer_results['frozen_input']
    assert min(r.values()) >= GRAD_COSINE, r


def test_few_values_over_the_process_group_refine_the_codes(layer_results):
    assert layer_results['codes_kinds'] == {'mesa 240': 'Refined', 'mesa 300': 'Packed',
                                            'division 240': 'DivisionPacked'}


def test_saved_bytes(layer_results):
    r = layer_results['saved_bytes']
    assert r['ratio'] <= MAX_SAVED_RATIO, r


# ---------------------------------------------------------------------------------------------
# (c) DDP: convert after wrapping (as MesaHook does), train, compare ranks and a reference
# ---------------------------------------------------------------------------------------------

def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.SyncBatchNorm(8), nn.ReLU(),
                         nn.Conv2d(8, 4, 1))


def plain_bn_copy(model: nn.Module) -> nn.Module:
    """The same model with BatchNorm2d for SyncBN (what SyncBN is on the global batch)."""
    ref = copy.deepcopy(model)
    bn = ref[1]
    ref[1] = nn.BatchNorm2d(bn.num_features)
    ref[1].load_state_dict(bn.state_dict())
    return ref


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(WORLD_SIZE * 3, 3, 12, 12, generator=gen) + 0.5
    target = torch.randn(WORLD_SIZE * 3, 4, 12, 12, generator=gen)
    return x, target


def ddp_on_cpu(model: nn.Module, **kwargs: object) -> nn.parallel.DistributedDataParallel:
    """DDP of a CPU module holding SyncBatchNorm layers.

    DDP refuses them at construction (``_passing_sync_batchnorm_handle``: torch's SyncBN only
    runs on GPUs); MesaSyncBatchNorm runs on CPU, so the tests lift that one check.
    """
    ddp_cls = nn.parallel.DistributedDataParallel
    with mock.patch.object(ddp_cls, '_passing_sync_batchnorm_handle', lambda self, m: None):
        return ddp_cls(model, **kwargs)


def _ddp_worker(rank: int, path: str, steps: int) -> None:
    torch.manual_seed(rank)  # different stochastic rounding per rank
    model = make_model()
    ref = plain_bn_copy(model)
    start_params = [p.detach().clone() for p in model.parameters()]
    # mmengine wraps with broadcast_buffers=False (deprecated name in recent torch, still honored)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)
        ddp = ddp_on_cpu(model, broadcast_buffers=False)
    report = convert_to_mesa(ddp.module, config=MesaConfig())
    assert isinstance(ddp.module[1], MesaSyncBatchNorm), report
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    local = slice(3 * rank, 3 * (rank + 1))
    for step in range(steps):
        x, target = batches(step)
        optimizer.zero_grad()
        loss = (ddp(x[local]) - target[local]).square().mean()  # different data per rank
        loss.backward()
        optimizer.step()
        # DDP averages the ranks' gradients: the reference loss is the mean of the rank losses.
        ref_optimizer.zero_grad()
        ref_loss = (ref(x) - target).square().mean()
        ref_loss.backward()
        ref_optimizer.step()
    state = torch.cat([t.detach().flatten().double() for t in model.state_dict().values()])
    gathered = [torch.empty_like(state) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, state)
    identical = all(torch.equal(gathered[0], other) for other in gathered[1:])
    estimates = torch.cat([b.flatten().double() for n, b in model.named_buffers()
                           if n.endswith(('.lower', '.span'))])
    gathered_est = [torch.empty_like(estimates) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered_est, estimates)
    # The first conv's bias feeds BatchNorm only: its gradient is analytically zero.
    deltas = [(p.detach() - p0, q.detach() - p0)
              for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(),
                                          start_params) if name != '0.bias']
    if rank == 0:
        dump(path, {
            'identical_state_across_ranks': identical,
            'quantizer_estimates_identical_across_ranks':
                all(torch.equal(gathered_est[0], o) for o in gathered_est[1:]),
            'update_cosine_vs_plain_syncbn': min(cosine(a, b) for a, b in deltas),
            'param_max_abs_diff_vs_plain_syncbn': max(
                (p - q).abs().max().item() for p, q in zip(model.parameters(),
                                                           ref.parameters())),
            'running_var_max_abs_diff_vs_plain_syncbn':
                (model[1].running_var - ref[1].running_var).abs().max().item(),
            'converted': sorted(t for _, t in report.converted.values()),
        })


def test_ddp_training_keeps_ranks_identical(tmp_path):
    path = str(tmp_path / 'ddp.json')
    spawn(_ddp_worker, path, 4)
    with open(path) as f:
        r = json.load(f)
    assert 'MesaSyncBatchNorm' in r['converted'], r
    assert r['identical_state_across_ranks'], r  # parameters and running statistics
    # Quantizer running estimates are per rank (each rank observes its own batches); they only
    # shape what a rank saves, so the parameters stay identical regardless.
    assert not r['quantizer_estimates_identical_across_ranks'], r
    assert r['update_cosine_vs_plain_syncbn'] >= 0.999, r
    assert r['param_max_abs_diff_vs_plain_syncbn'] <= 1e-3, r
    assert r['running_var_max_abs_diff_vs_plain_syncbn'] <= 1e-4, r


def _sync_count_worker(rank: int, path: str) -> None:
    from mmseg_mesa.bench.dispatch import count_step
    from mmseg_mesa.host import device_path
    model = make_model()
    convert_to_mesa(model, config=MesaConfig())
    x, target = batches(rank)

    def step() -> None:
        (model(x) - target).square().mean().backward()
        model.zero_grad(set_to_none=True)

    with device_path():
        step()  # a first step reads its own values once
        count = count_step(step)
    if rank == 0:
        dump(path, {'layer': type(model[1]).__name__, 'kernel_ops': count.kernel_ops,
                    'syncs': [f'{name} at {site}' for (name, site) in count.syncs]})


def test_a_synchronized_step_makes_the_host_wait_nowhere(tmp_path):
    """Forward and backward of SyncBN over gloo, on a device's branches: no syncing op (the
    group's count stays on the device; refinement reads the local count)."""
    path = str(tmp_path / 'syncs.json')
    spawn(_sync_count_worker, path)
    with open(path) as f:
        r = json.load(f)
    assert r['layer'] == 'MesaSyncBatchNorm' and r['kernel_ops'] > 0, r
    assert r['syncs'] == [], r


# ---------------------------------------------------------------------------------------------
# One rank, and no process group at all: the local path
# ---------------------------------------------------------------------------------------------

def _check_local_path(layer: MesaSyncBatchNorm) -> None:
    ref = nn.BatchNorm2d(CHANNELS)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(4, CHANNELS, 5, 5) * 3 + 1
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(xr), layer(xo)
    assert torch.equal(y, y_ref)  # MesaBatchNorm's path: F.batch_norm itself
    assert torch.equal(layer.running_var, ref.running_var)
    grad = torch.randn(y.shape)
    y_ref.backward(grad)
    y.backward(grad)
    assert cosine(xo.grad, xr.grad) >= GRAD_COSINE
    assert cosine(layer.weight.grad, ref.weight.grad) >= GRAD_COSINE
    layer.eval()
    ref.eval()
    assert torch.equal(layer(x), ref(x))


def _one_rank_worker(rank: int) -> None:
    torch_sync = nn.SyncBatchNorm(CHANNELS)
    with pytest.raises(ValueError, match='expected input tensor to be on GPU'):
        torch_sync(torch.randn(2, CHANNELS, 3, 3))  # torch checks the device before world size
    _check_local_path(MesaSyncBatchNorm(CHANNELS))


def test_world_size_one_takes_the_local_path():
    spawn(_one_rank_worker, world_size=1)


def test_not_distributed_takes_the_local_path():
    assert not dist.is_initialized()
    model = nn.Sequential(nn.SyncBatchNorm(CHANNELS))
    keys = list(model.state_dict())
    params = list(model.parameters())
    report = convert_to_mesa(model)
    layer = model[0]
    assert report.converted['0'] == ('SyncBatchNorm', 'MesaSyncBatchNorm')
    assert isinstance(layer, MesaSyncBatchNorm) and isinstance(layer, MesaModule)
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    _check_local_path(layer)


def test_disabled_or_no_grad_runs_torch_syncbn():
    layer = MesaSyncBatchNorm(CHANNELS, mesa_config=MesaConfig(enabled=False))
    ref = nn.SyncBatchNorm(CHANNELS)
    x = torch.randn(3, CHANNELS, 4, 4).requires_grad_()
    assert torch.equal(layer(x), ref(x))
    with torch.no_grad():
        assert torch.equal(MesaSyncBatchNorm(CHANNELS)(x), ref(x))
