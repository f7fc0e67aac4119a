"""mmdet's MaskFormer and Mask2Former heads (mmseg's ``MaskFormerHead`` / ``Mask2FormerHead``
derive from them): each decoder layer's loss keeps only its class scores and mask logits.

A layer's loss samples points on every mask (Mask2Former: uncertain points, 12544 per mask),
matches queries to ground truth and takes cross-entropy, dice and focal losses on the samples;
autograd keeps the sampled logits, the grids and every intermediate of the losses for each of
the ten decoder layers: most of what Mask2Former saves at small crops (docs/benchmarks.md).
``_loss_by_feat_single`` runs through ``RecomputedLoss`` instead: forward keeps the layer's class
scores and mask logits, backward runs the same code again from the same random state (the same
points, the same matching), so the gradients are exact.
"""
from __future__ import annotations

from typing import Any

import torch

from ..layers.base import MesaModule
from ..layers.recompute import recomputed_losses

LOSS_NAMES = ('loss_cls', 'loss_mask', 'loss_dice')


class MesaMaskLoss:
    """Mixin of the Mesa mask-classification heads: the per-layer loss recomputed."""

    def _loss_by_feat_single(self, cls_scores: torch.Tensor, mask_preds: torch.Tensor,
                             batch_gt_instances: list, batch_img_metas: list
                             ) -> tuple[torch.Tensor, ...]:
        if not self.mesa_active(cls_scores, mask_preds):  # type: ignore[attr-defined]
            return super()._loss_by_feat_single(  # type: ignore[misc]
                cls_scores, mask_preds, batch_gt_instances, batch_img_metas)

        def losses(scores: torch.Tensor, masks: torch.Tensor) -> dict[str, torch.Tensor]:
            return dict(zip(LOSS_NAMES, super(MesaMaskLoss, self)._loss_by_feat_single(
                scores, masks, batch_gt_instances, batch_img_metas)))

        result = recomputed_losses(losses, cls_scores, mask_preds)
        return tuple(result[name] for name in LOSS_NAMES)


def mask_head_classes() -> dict[type, type]:
    """mmdet's head types -> their Mesa classes; empty where mmdet is not installed."""
    try:
        from mmdet.models.dense_heads.mask2former_head import Mask2FormerHead
        from mmdet.models.dense_heads.maskformer_head import MaskFormerHead
    except ImportError:
        return {}

    classes: dict[type, Any] = {}
    for head in (MaskFormerHead, Mask2FormerHead):
        classes[head] = type(f'Mesa{head.__name__}', (MesaMaskLoss, MesaModule, head),
                             {'__module__': __name__, '__doc__': f'mmdet {head.__name__} whose '
                              'decoder layers\' losses keep only their inputs.'})
    return classes
