"""Two-process training through ``tools/dist_train.sh`` on CPU (gloo), with SyncBN heads and Mesa.

Checks: the run converts SyncBN to MesaSyncBatchNorm, both ranks end with identical parameters
and buffers, the checkpoint holds exactly that state and loads (strict) into a plain mmseg model.

The OpenMMLab stack assumes GPUs for distributed runs, so the test config imports a small
CPU-only shim (written next to the config) that does three things a GPU run does not need:

- initialise the gloo process group itself: mmengine 0.10.7's ``init_dist('pytorch')`` calls
  ``torch.cuda.set_device(local_rank)``, which fails without a driver (mmengine skips its own
  initialisation when a process group exists);
- lift DDP's construction-time refusal of SyncBatchNorm layers in CPU modules (torch's SyncBN
  cannot run on CPU; MesaSyncBatchNorm can);
- dump each rank's final state (a hook), to compare ranks.

The config also sets ``model_wrapper_cfg.device_ids=None``: the Runner passes
``device_ids=[LOCAL_RANK]``, which DDP refuses for CPU modules.
"""
from __future__ import annotations

import os
import os.path as osp
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.slow  # a two-process training run

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
MESA_CONFIG = osp.join(ROOT, 'configs/demo/mesa_swin-mini_upernet_demo.py')
PLAIN_CONFIG = osp.join(ROOT, 'configs/demo/swin-mini_upernet_demo.py')
ITERS = 3

SHIM = '''
"""CPU-only scaffolding for a multi-process mmengine run (see tests/test_distributed.py)."""
import os

import torch
import torch.distributed as dist
from mmengine.dist import get_rank
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS
from torch.nn.parallel import DistributedDataParallel

from mmseg_mesa.calibration import refined_layers

if 'RANK' in os.environ and not torch.cuda.is_available() and not dist.is_initialized():
    dist.init_process_group('gloo')
DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None


@HOOKS.register_module()
class DumpRankStateHook(Hook):
    priority = 'LOWEST'

    def after_run(self, runner):
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        torch.save({'state_dict': model.state_dict(),
                    'types': sorted({type(m).__name__ for m in model.modules()}),
                    'wrapper': type(runner.model).__name__,
                    'refined': refined_layers(model)},
                   os.path.join(runner.work_dir, f'rank{get_rank()}_state.pth'))
'''

CONFIG = '''
_base_ = [{base!r}]
custom_imports = dict(imports=['mmseg_mesa.integrations', 'mmseg_mesa.demo', 'cpu_dist_shim'],
                      allow_failed_imports=False)
custom_hooks = [dict(type='MesaHook'), dict(type='DumpRankStateHook')]
model_wrapper_cfg = dict(type='MMDistributedDataParallel', device_ids=None,
                         broadcast_buffers=False, find_unused_parameters=False)
'''


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    from mmseg_mesa.demo.dataset import write_demo_dataset

    tmp = tmp_path_factory.mktemp('dist')
    data_root = str(tmp / 'data')
    write_demo_dataset(data_root, num_train=8, num_val=4, seed=0)
    (tmp / 'cpu_dist_shim.py').write_text(textwrap.dedent(SHIM))
    config = tmp / 'mesa_syncbn_dist.py'
    config.write_text(CONFIG.format(base=MESA_CONFIG))
    work_dir = str(tmp / 'work')
    options = [f'{split}_dataloader.dataset.data_root={data_root}'
               for split in ('train', 'val', 'test')]
    options += ['env_cfg.dist_cfg.backend=gloo', 'model.decode_head.norm_cfg.type=SyncBN',
                f'train_cfg.max_iters={ITERS}', f'train_cfg.val_interval={ITERS}',
                f'default_hooks.checkpoint.interval={ITERS}', 'train_dataloader.batch_size=2',
                'val_dataloader.batch_size=2', 'default_hooks.logger.interval=1',
                # bounds no layer meets at 8 bits: each rank's images alone would choose
                # differently and take different steps, SyncBatchNorm's collectives among them
                'mesa.calibrate.error=0.0005', 'mesa.calibrate.passes=8']
    env = dict(os.environ, PYTHON=sys.executable, PORT=str(free_port()),
               MASTER_ADDR='127.0.0.1', GLOO_SOCKET_IFNAME='lo', OMP_NUM_THREADS='1',
               PYTHONUNBUFFERED='1',
               PYTHONPATH=os.pathsep.join(p for p in (str(tmp), os.environ.get('PYTHONPATH'))
                                          if p))
    cmd = ['bash', osp.join(ROOT, 'tools/dist_train.sh'), str(config), '2',
           '--work-dir', work_dir, '--cfg-options', *options]
    proc = subprocess.run(cmd, cwd=str(tmp), capture_output=True, text=True, timeout=240,
                          env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return work_dir, log


def load(path: str) -> dict:
    return torch.load(path, map_location='cpu', weights_only=False)


def test_ranks_hold_identical_state(run):
    work_dir, log = run
    assert f'Iter(train) [{ITERS}/{ITERS}]' in log
    ranks = [load(osp.join(work_dir, f'rank{r}_state.pth')) for r in (0, 1)]
    for dump in ranks:
        assert dump['wrapper'] == 'MMDistributedDataParallel'
        # a Mesa class swapped into a subclass is named after both: MesaSyncBatchNorm[...]
        types = {name.split('[', 1)[0] for name in dump['types']}
        assert 'MesaSyncBatchNorm' in types and 'MesaWindowMSA' in types
        assert 'SyncBatchNorm' not in types
    # one calibration's choice on both ranks (the search sums their errors)
    assert 'Mesa: calibration: ' in log
    assert ranks[0]['refined'] and ranks[0]['refined'] == ranks[1]['refined']
    first, second = (d['state_dict'] for d in ranks)
    assert list(first) == list(second)
    different = [k for k in first if not torch.equal(first[k], second[k])]
    assert not different, different  # parameters and running statistics alike
    assert any(k.endswith('running_var') for k in first)


def test_checkpoint_is_that_state_and_loads_in_plain_mmseg(run):
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmseg.registry import MODELS

    import mmseg_mesa.integrations  # noqa: F401  (mmengine checkpoints on torch >= 2.6)

    work_dir, _ = run
    ckpt = torch.load(osp.join(work_dir, f'iter_{ITERS}.pth'), map_location='cpu')
    state = ckpt['state_dict']
    rank0 = load(osp.join(work_dir, 'rank0_state.pth'))['state_dict']
    assert list(state) == list(rank0)
    assert all(torch.equal(state[k], rank0[k]) for k in state)
    init_default_scope('mmseg')
    model = MODELS.build(Config.fromfile(PLAIN_CONFIG).model)  # BN heads, no Mesa
    model.load_state_dict(state, strict=True)
    assert torch.equal(model.decode_head.bottleneck.bn.running_var,
                       state['decode_head.bottleneck.bn.running_var'])
