"""Mesa versions of mmcv / mmseg modules whose forward must be rewritten.

- mmcv's ``DropPath`` becomes ``MesaDropPath`` (one saved bit per sample).
- Decode heads using ``BaseDecodeHead.loss_by_feat`` (UPerHead, FCNHead, ...) become
  ``MesaDecodeHead``: per-pixel cross-entropies are computed band by band
  (``layers.banded_loss``) and reduced once as mmseg reduces them; other losses (Dice, Lovasz,
  a pixel sampler) run whole through ``RecomputedLoss``, and the log says why. Both are exact.
- Heads with a loss of their own (PIDNet's and DDRNet's OHEM and boundary losses, STDC's detail
  loss, EncNet's semantic-encoding loss, PointRend's point loss) become
  ``MesaRecomputedLossHead``: that loss runs whole through ``RecomputedLoss``, keeping only the
  head's logits.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from mmcv.cnn.bricks.drop import DropPath
from mmengine.logging import print_log
from mmseg.models.decode_heads.da_head import DAHead
from mmseg.models.decode_heads.decode_head import BaseDecodeHead
from mmseg.models.losses import CrossEntropyLoss
from mmseg.models.losses.cross_entropy_loss import cross_entropy
from mmseg.models.losses.utils import weight_reduce_loss
from mmseg.utils import add_prefix
from torch import nn

from ..config import MesaConfig
from ..layers.banded_loss import BandedLossSpec, PixelCrossEntropy, banded_cross_entropy
from ..layers.base import MesaModule
from ..layers.dropout import MesaDropPathFunction
from ..layers.intercept import own_type
from ..layers.recompute import recomputed_losses


class MesaDropPath(MesaModule, DropPath):
    """mmcv ``DropPath`` keeping a 1-bit keep mask per sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mesa_active(x) or not 0.0 < self.drop_prob < 1.0:
            return super().forward(x)
        return MesaDropPathFunction.apply(x, self.drop_prob)


def head_losses(head: BaseDecodeHead) -> list[nn.Module]:
    return list(head.loss_decode) if isinstance(head.loss_decode, nn.ModuleList) else [
        head.loss_decode]


def banded_loss_blocker(head: BaseDecodeHead) -> str | None:
    """Why ``head``'s losses cannot be computed band by band (None: they can)."""
    if head.sampler is not None:
        return f'{type(head.sampler).__name__} weighs pixels by the whole batch\'s logits'
    for loss in head_losses(head):
        if own_type(loss) is not CrossEntropyLoss:
            return f'{type(loss).__name__} is not a per-pixel cross-entropy'
        if loss.use_sigmoid or loss.use_mask or loss.cls_criterion is not cross_entropy:
            return 'CrossEntropyLoss with use_sigmoid/use_mask is not banded'
    return None


def reduce_cross_entropy(loss: CrossEntropyLoss, pixel: torch.Tensor, label: torch.Tensor,
                         ignore_index: int, score_dtype: torch.dtype) -> torch.Tensor:
    """``loss(resized_logits, label, ignore_index=...)`` from its per-pixel values ``pixel``.

    The steps of mmseg 1.2.2's ``CrossEntropyLoss.forward`` / ``cross_entropy`` after
    ``F.cross_entropy(reduction='none')`` (tests hold it to mmseg's result bit for bit).
    """
    class_weight = None
    if loss.class_weight is not None:
        class_weight = torch.tensor(loss.class_weight, dtype=score_dtype, device=pixel.device)
    avg_factor = None
    if loss.reduction == 'mean':
        if class_weight is None:
            avg_factor = label.numel()
            if loss.avg_non_ignore:  # as a tensor: mmseg's .item() would wait for a device
                avg_factor = (avg_factor - (label == ignore_index).sum()).float()
        else:
            label_weights = torch.stack([class_weight[cls] for cls in label]).to(
                device=class_weight.device)
            if loss.avg_non_ignore:
                label_weights[label == ignore_index] = 0
            avg_factor = label_weights.sum()
    return loss.loss_weight * weight_reduce_loss(pixel, weight=None, reduction=loss.reduction,
                                                 avg_factor=avg_factor)


def top1_accuracy(correct: torch.Tensor, label: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """mmseg's ``accuracy(logits, label, ignore_index=...)`` (top-1) from the correct-pixel map,
    with masked sums where mmseg indexes with a boolean mask (which waits for a device): the
    same values while the counts stay below 2**24, where fp32 sums of ones are exact."""
    valid = label != ignore_index
    hits = (correct & valid).sum().float().reshape(1) + 1e-6
    return hits.mul_((100.0 / (valid.sum(dtype=torch.float64) + 1e-6)).float())


class MesaDecodeHead(MesaModule, BaseDecodeHead):
    """A decode head whose loss keeps only the low-resolution logits for backward and never
    holds the full-resolution logits of more than one band of rows of one image."""

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        self.mesa_loss_blocker = banded_loss_blocker(self)
        if self.mesa_loss_blocker is not None:
            print_log(f'{type(self).__name__}: loss recomputed whole, not in bands: '
                      f'{self.mesa_loss_blocker}', logger='current', level=logging.INFO)

    def loss_by_feat(self, seg_logits: torch.Tensor, batch_data_samples: list) -> dict:
        if not self.mesa_active(seg_logits):
            return BaseDecodeHead.loss_by_feat(self, seg_logits, batch_data_samples)
        if self.mesa_loss_blocker is None and seg_logits.dim() == 4 and len(seg_logits):
            return self.banded_loss_by_feat(seg_logits, batch_data_samples)
        return recomputed_losses(
            lambda logits: BaseDecodeHead.loss_by_feat(self, logits, batch_data_samples),
            seg_logits)

    def banded_loss_by_feat(self, seg_logits: torch.Tensor, batch_data_samples: list) -> dict:
        """``BaseDecodeHead.loss_by_feat`` for per-pixel cross-entropies, band by band."""
        def labels() -> torch.Tensor:
            return self._stack_batch_gt(batch_data_samples).squeeze(1)

        label = labels()
        losses = head_losses(self)
        spec = BandedLossSpec(
            losses=tuple(PixelCrossEntropy(None if loss.class_weight is None else
                                           tuple(float(w) for w in loss.class_weight))
                         for loss in losses),
            ignore_index=self.ignore_index, align_corners=bool(self.align_corners))
        pixels, correct, score_dtype = banded_cross_entropy(seg_logits, label, spec, labels)
        result: dict = {}
        for loss, pixel in zip(losses, pixels):
            value = reduce_cross_entropy(loss, pixel, label, self.ignore_index, score_dtype)
            if loss.loss_name in result:
                result[loss.loss_name] += value
            else:
                result[loss.loss_name] = value
        result['acc_seg'] = top1_accuracy(correct, label, self.ignore_index)
        return result


class MesaDAHead(MesaDecodeHead, DAHead):
    """DANet's head: its three losses (on the PAM + CAM, PAM and CAM logits), each as
    ``MesaDecodeHead`` computes a head's loss. ``DAHead.loss_by_feat`` calls the base's loss
    three times with these prefixes; this does the same through Mesa's loss."""

    def loss_by_feat(self, seg_logit: tuple, batch_data_samples: list, **kwargs: Any) -> dict:
        losses: dict = {}
        for prefix, logits in zip(('pam_cam', 'pam', 'cam'), seg_logit):
            losses.update(add_prefix(
                MesaDecodeHead.loss_by_feat(self, logits, batch_data_samples), prefix))
        return losses


class MesaRecomputedLossHead(MesaModule, BaseDecodeHead):
    """A decode head whose own ``loss_by_feat`` keeps only its logits for backward.

    Such losses (OHEM cross-entropy, boundary and detail losses, EncNet's semantic-encoding
    loss) upsample each logit map to the label size and keep every intermediate there; the
    head's own code runs instead through ``RecomputedLoss``, from the same random state in
    backward, so its values and gradients are exactly the unconverted head's. The first
    argument (a tensor, or a tuple / list of them) is what is kept.
    """

    def loss_by_feat(self, seg_logits: Any, *args: Any, **kwargs: Any) -> dict:
        own = super().loss_by_feat
        many = isinstance(seg_logits, (tuple, list))
        parts = list(seg_logits) if many else [seg_logits]
        if not all(isinstance(t, torch.Tensor) for t in parts) or not self.mesa_active(*parts):
            return own(seg_logits, *args, **kwargs)
        rebuild = type(seg_logits) if many else (lambda tensors: tensors[0])
        return recomputed_losses(
            lambda *tensors: own(rebuild(tensors), *args, **kwargs), *parts)


def own_loss_heads() -> tuple[type, ...]:
    """mmseg's decode heads with a loss of their own that ``MesaRecomputedLossHead`` keeps
    (PointRend's point head: the cross-entropy of its point logits)."""
    from mmseg.models.decode_heads.ddr_head import DDRHead
    from mmseg.models.decode_heads.enc_head import EncHead
    from mmseg.models.decode_heads.pid_head import PIDHead
    from mmseg.models.decode_heads.point_head import PointHead
    from mmseg.models.decode_heads.stdc_head import STDCHead
    return PIDHead, DDRHead, STDCHead, EncHead, PointHead
