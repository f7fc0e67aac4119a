"""SyncBatchNorm with ``bits``-bit saved inputs, for any process group (gloo on CPU, NCCL on GPU).

Same numerics as ``MesaBatchNorm`` (``norm.py``) with the per-channel moments taken over the
process group, and the same semantics as ``torch.nn.SyncBatchNorm``:

- forward: every rank all-gathers ``(mean, M2, count)`` of its batch (counts may differ between
  ranks, a rank may have an empty batch) and combines them into the global mean and biased
  variance, so the output is ``BatchNorm`` of the concatenated global batch; running statistics
  get the unbiased variance with the global count, and ``num_batches_tracked`` / ``momentum``
  behave as in ``_BatchNorm``.
- backward: one all-reduce of the per-channel sums the input gradient needs; the weight and bias
  gradients returned are the *local* ones, as torch's SyncBN returns them: DDP averages them like
  every other parameter gradient, so DDP training with this layer is DDP training with SyncBN.

Without a process group of more than one rank (not distributed, world size 1) it runs the
single-process ``MesaBatchNorm`` path, as ``nn.SyncBatchNorm`` falls back to ``F.batch_norm``;
eval mode and steps that save nothing run ``nn.SyncBatchNorm.forward`` unchanged.

Where conversion happens with mmengine 0.10.7 (``Runner.__init__`` then ``Runner.train``):

1. ``Runner.wrap_model``, not distributed: ``revert_sync_batchnorm`` turns every SyncBN into
   mmengine's ``_BatchNormXd``, which the ``_BatchNorm`` handler converts to ``MesaBatchNorm``.
2. ``Runner.wrap_model``, distributed: ``cfg.sync_bn`` (if set) turns BatchNorms into torch's
   ``nn.SyncBatchNorm`` (``'torch'``) or mmcv's ``SyncBatchNorm`` (``'mmcv'``: not a
   ``_BatchNorm``, so it is left unconverted and listed in the report), then the model is wrapped
   in ``MMDistributedDataParallel`` with ``broadcast_buffers=False``.
3. ``Runner.train``: ``before_run`` hooks (``MesaHook`` converts ``runner.model.module`` in place),
   then weight init and checkpoint loading. Nothing after ``before_run`` rebuilds norm layers, and
   the class swap keeps the Parameters DDP registered its gradient hooks on.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..quantizer import ActivationQuantizer, unpack
from ..registry import mesa_layer
from ..saved import load, save
from .autocast import no_autocast_backward, record_input, returns_owned
from .base import MesaModule
from .layout import mark_channels_first
from .norm import (
    MesaBatchNormFunction,
    batch_norm_momentum,
    channel_shape,
    eval_batch_norm,
    few_values,
    standardize_scale,
)
from .norm_backward import NormSets, normalization_backward


def global_moments(x: torch.Tensor, process_group: Any, world_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of fp32 ``x`` over the group's concatenated batch.

    Each rank contributes ``(mean, M2 = var * n, n)``; combining them with Chan's formula (in
    float64: exact counts, no cancellation) is as stable as a two-pass variance, unlike summing
    ``x`` and ``x**2``. An all-gather, not an all-reduce, because the counts may differ.

    Returns:
        mean and variance (fp32, shape ``(C,)``) and the global count per channel (a 0-d fp64
        tensor on the device: reading it would wait for the collective).
    """
    channels = x.shape[1]
    count = x.numel() // channels
    if count > 0:
        dims = [0] + list(range(2, x.dim()))
        var, mean = torch.var_mean(x, dim=dims, correction=0)
    else:  # an empty batch still takes part in the collective, with zero weight
        mean = var = torch.zeros(channels, dtype=torch.float32, device=x.device)
    local = torch.cat([mean.double(), var.double() * count,
                       torch.full((1,), float(count), dtype=torch.float64, device=x.device)])
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=process_group)
    stats = torch.stack(gathered)
    means, m2s, counts = stats[:, :channels], stats[:, channels:-1], stats[:, -1:]
    total = counts.sum()
    global_mean = (counts * means).sum(0) / total
    global_m2 = (m2s + counts * (means - global_mean).square()).sum(0)
    return global_mean.float(), (global_m2 / total).float(), total


class MesaSyncBatchNormFunction(torch.autograd.Function):
    """Training-mode synchronized batch norm saving the packed normalized input and 1/std.

    Saves what ``MesaBatchNormFunction`` saves: ``(x - mean) * invstd`` with the global moments,
    one quantization group per channel, and invstd. Backward all-reduces, in one collective, the
    per-channel sums of ``dy``, ``dy * x_hat``, ``x_hat`` and ``x_hat**2`` (``x_hat`` the
    dequantized normalized input): the last two re-standardize ``x_hat`` to the exact global
    moments (``standardize`` in ``norm.py``), which is affine per channel, so the sum of
    ``dy * x_norm`` follows from the first two without a second collective. The collective runs
    in every backward (torch's skips it when the input needs no gradient): the weight gradient
    needs the global moments of ``x_hat`` too.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, momentum: float, eps: float,
                process_group: Any, world_size: int, quantizer: ActivationQuantizer
                ) -> torch.Tensor:
        record_input(ctx, x)
        ctx.eps = eps
        ctx.process_group = process_group
        # batch_norm is not an autocast op: output in the input dtype, statistics in fp32.
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            x32 = x.float()
            mean, var, count = global_moments(x32, process_group, world_size)
            # only a rank with at most one value asks (a wait): if the group has at most one,
            # so has every rank, and every rank raises
            local_count = x.numel() // x.shape[1]
            if local_count <= 1 and float(count) <= 1:
                raise ValueError('Expected more than 1 value per channel when training, got '
                                 f'{int(count)} over the process group')
            if running_mean is not None:
                running_mean.mul_(1.0 - momentum).add_(momentum * mean.to(running_mean.dtype))
            if running_var is not None:
                unbiased = var * (count / (count - 1))
                running_var.mul_(1.0 - momentum).add_(momentum * unbiased.to(running_var.dtype))
            shape = channel_shape(x)
            invstd = torch.rsqrt(var + eps).view(shape)
            x_norm = (x32 - mean.view(shape)) * invstd
            y = x_norm
            if weight is not None:
                y = y * weight.float().view(shape)
            if bias is not None:
                y = y + bias.float().view(shape)
            y = y.to(x.dtype)
            if not x.numel():
                packed = None
            # the group's count as the ranks' batches are alike (reading it would wait)
            elif few_values(quantizer, local_count * world_size):  # DIVISION's: no refine
                packed = quantizer.pack(x_norm, refined=True)
            else:
                packed = quantizer.pack(x_norm)
        ctx.count = count
        save(ctx, packed, invstd, weight, bias)
        return mark_channels_first(y)

    @staticmethod
    @no_autocast_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        packed, invstd, weight, bias = load(ctx)
        g = grad.float()
        dims = [0] + list(range(2, g.dim()))
        if packed is None:  # empty local batch: contribute zeros to the collective
            x_hat = None
            local = g.new_zeros(4, g.shape[1])
        else:
            x_hat = unpack(packed, torch.float32)
            local = torch.stack([g.sum(dims), (g * x_hat).sum(dims), x_hat.sum(dims),
                                 x_hat.square().sum(dims)])
        total = local.clone()
        dist.all_reduce(total, dist.ReduceOp.SUM, group=ctx.process_group)
        shape = invstd.shape
        count = ctx.count
        hat_mean = (total[2] / count).view(shape)
        hat_var = (total[3] / count).view(shape) - hat_mean.square()
        scale = standardize_scale(hat_var, invstd, ctx.eps)

        def sum_dy_xnorm(sums: torch.Tensor) -> torch.Tensor:
            return scale * (sums[1].view(shape) - hat_mean * sums[0].view(shape))

        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if x_hat is None:
                grad_x = torch.zeros_like(grad, dtype=ctx.input_dtype)
            else:
                x_norm = (x_hat - hat_mean) * scale
                grad_x = normalization_backward(
                    g, x_norm, invstd, weight, bias, NormSets.channels(), (True, False, False),
                    set_sums=(total[0].view(shape), sum_dy_xnorm(total), count))[0]
                grad_x = grad_x.to(ctx.input_dtype)
        # Local weight / bias gradients, as torch's SyncBN: DDP all-reduces parameter gradients.
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xnorm(local).flatten().to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = local[0].to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


@mesa_layer(nn.SyncBatchNorm, 'batchnorm')
class MesaSyncBatchNorm(MesaModule, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` whose saved input is ``bits``-bit, per channel; runs on CPU (gloo) too.

    Unlike torch's SyncBN it does not refuse CPU tensors, and with a process group of one rank it
    takes the local path instead of refusing CPU input (torch checks the device first).
    """

    mesa_quantizers = {'quant_input': (1, 1)}

    def sync_world_size(self) -> int:
        """Ranks in this layer's process group; 1 when not distributed."""
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group or dist.group.WORLD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        evaluated = eval_batch_norm(self, x)  # eval mode: no communication
        if evaluated is not None:
            return evaluated
        if not self.mesa_active(x, self.weight, self.bias):
            return super().forward(x)
        self._check_input_dim(x)
        self._check_non_zero_input_channels(x)
        momentum = batch_norm_momentum(self)
        track = self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        world_size = self.sync_world_size()
        if world_size == 1:
            return MesaBatchNormFunction.apply(x, self.weight, self.bias, running_mean,
                                               running_var, momentum, self.eps, self.quant_input)
        return MesaSyncBatchNormFunction.apply(
            x, self.weight, self.bias, running_mean, running_var, momentum, self.eps,
            self.process_group or dist.group.WORLD, world_size, self.quant_input)
