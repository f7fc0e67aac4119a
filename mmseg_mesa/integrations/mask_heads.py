"""mmdet's MaskFormer and Mask2Former heads (mmseg's ``MaskFormerHead`` / ``Mask2FormerHead``
derive from them): each decoder layer's loss keeps only its class scores and mask logits.

A layer's loss samples points on every mask (Mask2Former: uncertain points, 12544 per mask),
matches queries to ground truth and takes cross-entropy, dice and focal losses on the samples;
autograd keeps the sampled logits, the grids and every intermediate of the losses for each of
the ten decoder layers: most of what Mask2Former saves at small crops (docs/benchmarks.md).
``_loss_by_feat_single`` runs through ``RecomputedLoss`` instead: forward keeps the layer's class
scores and mask logits, backward runs the same code again from the same random state (the same
points), so the gradients are exact. Mask2Former's matching (Hungarian assignment and sampling,
not differentiable) runs once, in forward, and backward reuses it, as mmdet matches once a step.

Mask2Former's layer loss also reads the ground truth only at points, and runs as
``mask2former_loss.point_losses``: the same values without full-resolution float copies of the
masks. mmseg's Mask2Former head keeps its masks as ``bool`` rather than ``int64`` (1 byte a
pixel instead of 8, alive from before the head's forward to the end of its losses), which the
losses read only through ``.float()``.
"""
from __future__ import annotations

from typing import Any

import torch

from ..layers.base import MesaModule
from ..layers.recompute import recomputed_losses
from .mask2former_loss import (
    LOSS_NAMES,
    PointTargets,
    point_losses,
    point_targets,
    supports_point_losses,
)


class MesaMaskLoss:
    """Mixin of the Mesa mask-classification heads: the per-layer loss recomputed."""

    def _loss_by_feat_single(self, cls_scores: torch.Tensor, mask_preds: torch.Tensor,
                             batch_gt_instances: list, batch_img_metas: list
                             ) -> tuple[torch.Tensor, ...]:
        if not self.mesa_active(cls_scores, mask_preds):  # type: ignore[attr-defined]
            return super()._loss_by_feat_single(  # type: ignore[misc]
                cls_scores, mask_preds, batch_gt_instances, batch_img_metas)

        def targets(scores: torch.Tensor, masks: torch.Tensor) -> Any:
            return self._mesa_layer_targets(scores, masks, batch_gt_instances, batch_img_metas)

        def losses(found: Any, scores: torch.Tensor, masks: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
            return dict(zip(LOSS_NAMES, self._mesa_layer_loss(
                scores, masks, batch_gt_instances, batch_img_metas, found)))

        result = recomputed_losses(losses, cls_scores, mask_preds, targets_fn=targets)
        return tuple(result[name] for name in LOSS_NAMES)

    def _mesa_layer_targets(self, cls_scores: torch.Tensor, mask_preds: torch.Tensor,
                            batch_gt_instances: list, batch_img_metas: list) -> Any:
        """The layer's matching, computed once a step (in forward) and handed to both runs of
        ``_mesa_layer_loss``: None here, where the head's own loss matches in each (mmdet's
        targets hold full-resolution masks, too large to keep from forward to backward)."""
        return None

    def _mesa_layer_loss(self, cls_scores: torch.Tensor, mask_preds: torch.Tensor,
                         batch_gt_instances: list, batch_img_metas: list, targets: Any
                         ) -> tuple[torch.Tensor, ...]:
        """The layer's loss that ``RecomputedLoss`` runs: the head's own."""
        return super()._loss_by_feat_single(  # type: ignore[misc]
            cls_scores, mask_preds, batch_gt_instances, batch_img_metas)


class MesaMask2FormerLoss(MesaMaskLoss):
    """Mask2Former's per-layer loss recomputed, sampling its ground truth a block of masks at a
    time (``mask2former_loss.point_losses``) where the head's sampler allows it, and matching
    once a step: backward reuses the forward's ``point_targets``."""

    def _mesa_layer_targets(self, cls_scores: torch.Tensor, mask_preds: torch.Tensor,
                            batch_gt_instances: list, batch_img_metas: list
                            ) -> PointTargets | None:
        if supports_point_losses(self) is not None:
            return None
        return point_targets(self, cls_scores, mask_preds, batch_gt_instances, batch_img_metas)

    def _mesa_layer_loss(self, cls_scores: torch.Tensor, mask_preds: torch.Tensor,
                         batch_gt_instances: list, batch_img_metas: list,
                         targets: PointTargets | None) -> tuple[torch.Tensor, ...]:
        if targets is None:
            return super()._mesa_layer_loss(cls_scores, mask_preds, batch_gt_instances,
                                            batch_img_metas, targets)
        return point_losses(self, cls_scores, mask_preds, batch_gt_instances, batch_img_metas,
                            targets)


class MesaSegMask2FormerLoss(MesaMask2FormerLoss):
    """mmseg's Mask2Former head: its ground-truth masks built as ``bool``."""

    def _seg_data_to_instance_data(self, batch_data_samples: list) -> tuple[list, list]:
        """The ground truth of mmseg 1.2.2's ``Mask2FormerHead._seg_data_to_instance_data``,
        with each image's masks one ``bool`` comparison of its label map against its labels.

        Only in a Mesa training step: otherwise the head's own (``int64`` masks).
        """
        if not (self.training and self.mesa_config.enabled  # type: ignore[attr-defined]
                and torch.is_grad_enabled()):
            return super()._seg_data_to_instance_data(batch_data_samples)  # type: ignore[misc]
        from mmengine.structures import InstanceData
        batch_gt_instances, batch_img_metas = [], []
        for data_sample in batch_data_samples:
            batch_img_metas.append(data_sample.metainfo)
            gt_sem_seg = data_sample.gt_sem_seg.data
            # mmseg's classes[classes != ignore_index] without a bool mask, which the host
            # would read: with ignore_index made present, it is the one value of the unique
            # ones to drop, and a stable sort moves it last (the labels keep their order)
            ignored = gt_sem_seg.new_full((1,), self.ignore_index)  # type: ignore[attr-defined]
            classes = torch.unique(torch.cat([gt_sem_seg.flatten(), ignored]), sorted=False,
                                   return_inverse=False, return_counts=False)
            gt_labels = classes[torch.argsort(classes == ignored, stable=True)[:-1]]
            # (num_gts, 1, H, W) -> (num_gts, H, W), as mmseg stacks one mask per label
            labels_at = gt_labels.view(-1, *[1] * gt_sem_seg.dim())
            gt_masks = (gt_sem_seg.unsqueeze(0) == labels_at).squeeze(1)
            batch_gt_instances.append(InstanceData(labels=gt_labels, masks=gt_masks))
        return batch_gt_instances, batch_img_metas


# Methods a Mesa head no longer runs: a subclass defining one keeps its own path (unconverted).
MASK2FORMER_REPLACES = ('_loss_by_feat_single', '_get_targets_single', 'get_targets')


def mask_head_handlers() -> list[tuple[type, type, tuple[str, ...]]]:
    """(head type, its Mesa class, the methods that class replaces) for mmdet's MaskFormer and
    Mask2Former heads and mmseg's Mask2Former head; empty where mmdet is not installed."""
    try:
        from mmdet.models.dense_heads.mask2former_head import Mask2FormerHead
        from mmdet.models.dense_heads.maskformer_head import MaskFormerHead
        from mmseg.models.decode_heads.mask2former_head import (
            Mask2FormerHead as SegMask2FormerHead,
        )
    except ImportError:
        return []

    def mesa_class(mixin: type, head: type, what: str) -> type:
        return type(f'Mesa{head.__name__}', (mixin, MesaModule, head),
                    {'__module__': __name__, '__doc__': f'{head.__module__}.{head.__name__} '
                     f'whose {what}'})

    layer_losses = "decoder layers' losses keep only their inputs"
    return [
        (MaskFormerHead, mesa_class(MesaMaskLoss, MaskFormerHead, layer_losses),
         ('_loss_by_feat_single',)),
        (Mask2FormerHead, mesa_class(MesaMask2FormerLoss, Mask2FormerHead, layer_losses),
         MASK2FORMER_REPLACES),
        (SegMask2FormerHead, mesa_class(MesaSegMask2FormerLoss, SegMask2FormerHead,
                                        f'{layer_losses} and whose masks are bool'),
         (*MASK2FORMER_REPLACES, '_seg_data_to_instance_data')),
    ]

