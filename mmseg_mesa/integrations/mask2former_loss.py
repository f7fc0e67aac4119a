"""Mask2Former's per-layer loss without full-resolution copies of the ground-truth masks.

mmdet 3.3.0's ``Mask2FormerHead._loss_by_feat_single`` reads the ground truth only at points,
yet builds it whole on the way there: ``_get_targets_single`` converts every mask of an image to
float to sample it at the matching points, ``MaskSamplingResult`` and ``_get_targets_single``
each index a full-resolution copy of the matched masks, ``_loss_by_feat_single`` concatenates
those of the batch and converts them to float to sample them at the loss's points. With 150
masks of 512x512 per image that is about 1 GiB for two images, and it comes back in each of the
ten decoder layers' losses (forward and recomputation).

``point_losses`` takes the same steps in the same order, with the same random draws, and samples
the ground truth a block of masks at a time, straight from ``gt_instances.masks`` (bilinear
``grid_sample`` treats every (mask, channel) on its own, so the samples are the same bits). The
sampler is handed the sampled ground truth (``masks`` of shape (num_gts, num_points)) in place of
the full masks: ``MaskPseudoSampler`` reads only their number and indexes them for its
``pos_gt_masks``, which the loss does not use. ``supports_point_losses`` says when that holds.

The matching (``point_targets``: assignment, sampling, the class targets) is its own step, whose
small result (``PointTargets``, no masks) the recomputation of the loss in backward reuses: the
assigner runs once per layer and step, as in mmdet. Beyond the assigner's and the sampler's own,
neither step reads a value on the host: the positive queries are picked by index rather than by
a bool mask, and the loss's ``avg_factor`` is clamped on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..layers.chunking import sample_slices
from ..layers.intercept import own_type

LOSS_NAMES = ('loss_cls', 'loss_mask', 'loss_dice')


def supports_point_losses(head: Any) -> str | None:
    """Why ``point_losses`` cannot stand in for ``head``'s own per-layer loss, or None."""
    from mmdet.models.task_modules.samplers import MaskPseudoSampler
    if own_type(head.sampler) is not MaskPseudoSampler:
        return f'its sampler {type(head.sampler).__name__} may read the full ground-truth masks'
    return None


def sampled_masks(masks: Tensor, points: Tensor, rows: Tensor | None = None) -> Tensor:
    """``point_sample(masks[rows].unsqueeze(1).float(), points).squeeze(1)`` (all rows when
    ``rows`` is None), converting a block of masks to float at a time.

    Args:
        masks: (N, H, W) masks of any dtype.
        points: (R, P, 2) points in [0, 1], one row of points per selected mask.
        rows: (R,) indices of the masks to sample. Defaults to None (every mask, R = N).

    Returns:
        (R, P) float samples.
    """
    from mmcv.ops import point_sample
    count = masks.shape[0] if rows is None else rows.numel()
    picked = torch.Size((count, 1, *masks.shape[-2:]))
    parts = []
    for block in sample_slices(picked, torch.finfo(torch.float32).bits // 8):
        chunk = masks[block] if rows is None else masks[rows[block]]
        parts.append(point_sample(chunk.unsqueeze(1).float(), points[block]).squeeze(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(frozen=True)
class PointTargets:
    """What one decoder layer's loss reads of its matching, for the whole batch: the part of
    mmdet's ``_loss_by_feat_single`` (and ``get_targets``) that gives no gradient, kept small
    (no masks) so that the recomputation in backward can reuse it (``RecomputedLoss``'s
    ``targets_fn``) rather than match again.

    Attributes:
        labels: (batch * num_queries,) the class of each query, ``num_classes`` where unmatched.
        label_weights: (batch * num_queries,) ones.
        class_avg_factor: ``loss_cls``'s ``avg_factor``, ``class_weight[labels].sum()``.
        matched_gts: per image, the gt index of each positive query, in ascending query order.
        positive_rows: the positive queries' rows of ``mask_preds.flatten(0, 1)``, in the order
            of ``mask_preds[mask_weights > 0]`` (image by image, ascending query).
        num_total_masks: (1,) the dice and mask losses' ``avg_factor``, at least 1, on the
            device: mmdet's ``max(num_total_masks, 1)`` without reading it on the host.
    """

    labels: Tensor
    label_weights: Tensor
    class_avg_factor: Tensor
    matched_gts: tuple[Tensor, ...]
    positive_rows: Tensor
    num_total_masks: Tensor


def point_targets_single(head: Any, cls_score: Tensor, mask_pred: Tensor,
                         gt_instances: Any, img_meta: dict) -> tuple[Tensor, ...]:
    """One image's targets, following mmdet 3.3.0's ``Mask2FormerHead._get_targets_single``,
    with the matched ground-truth indices in place of the matched masks.

    Returns:
        ``labels``, ``label_weights``, ``matched_gts`` (the gt index of each positive query, in
        the order of ``pos_inds``), ``pos_inds`` and the sampling result's ``avg_factor``.
    """
    from mmcv.ops import point_sample
    from mmengine.structures import InstanceData
    gt_labels, gt_masks = gt_instances.labels, gt_instances.masks
    num_queries, num_gts = cls_score.shape[0], gt_labels.shape[0]
    # the matching's points: the same draw as mmdet's, then the predictions and every gt there
    point_coords = torch.rand((1, head.num_points, 2), device=cls_score.device)
    mask_points_pred = point_sample(mask_pred.unsqueeze(1),
                                    point_coords.repeat(num_queries, 1, 1)).squeeze(1)
    gt_points_masks = sampled_masks(gt_masks, point_coords.expand(num_gts, -1, -1))
    sampled_gts = InstanceData(labels=gt_labels, masks=gt_points_masks)
    assign_result = head.assigner.assign(
        pred_instances=InstanceData(scores=cls_score, masks=mask_points_pred),
        gt_instances=sampled_gts, img_meta=img_meta)
    # MaskPseudoSampler: positives and negatives from the assignment (see the module docstring)
    sampling_result = head.sampler.sample(
        assign_result=assign_result, pred_instances=InstanceData(scores=cls_score, masks=mask_pred),
        gt_instances=sampled_gts)
    pos_inds = sampling_result.pos_inds
    matched_gts = sampling_result.pos_assigned_gt_inds

    labels = gt_labels.new_full((head.num_queries,), head.num_classes, dtype=torch.long)
    labels[pos_inds] = gt_labels[matched_gts]
    label_weights = gt_labels.new_ones((head.num_queries,))
    return labels, label_weights, matched_gts, pos_inds, sampling_result.avg_factor


def point_targets(head: Any, cls_scores: Tensor, mask_preds: Tensor, batch_gt_instances: list,
                  batch_img_metas: list) -> PointTargets:
    """One decoder layer's matching for the whole batch (mmdet 3.3.0's ``get_targets`` and the
    target steps of ``_loss_by_feat_single``), drawing what mmdet's draws before its loss's
    points. Reads no value on the host but through the assigner and the sampler."""
    from mmdet.utils import reduce_mean
    num_queries = cls_scores.shape[1]
    labels, label_weights, matched_gts, positive_rows, avg_factor = [], [], [], [], 0
    for i, (gt_instances, img_meta) in enumerate(zip(batch_gt_instances, batch_img_metas)):
        image_labels, image_weights, image_matched, pos_inds, image_avg_factor = \
            point_targets_single(head, cls_scores[i], mask_preds[i], gt_instances, img_meta)
        labels.append(image_labels)
        label_weights.append(image_weights)
        matched_gts.append(image_matched)
        positive_rows.append(pos_inds + i * num_queries if i else pos_inds)
        avg_factor += image_avg_factor
    labels = torch.stack(labels, dim=0).flatten(0, 1)
    class_weight = cls_scores.new_tensor(head.class_weight)
    num_total_masks = reduce_mean(cls_scores.new_tensor([avg_factor]))
    return PointTargets(
        labels=labels, label_weights=torch.stack(label_weights, dim=0).flatten(0, 1),
        class_avg_factor=class_weight[labels].sum(), matched_gts=tuple(matched_gts),
        positive_rows=torch.cat(positive_rows), num_total_masks=num_total_masks.clamp(min=1))


def point_losses(head: Any, cls_scores: Tensor, mask_preds: Tensor, batch_gt_instances: list,
                 batch_img_metas: list, targets: PointTargets | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """``loss_cls``, ``loss_mask`` and ``loss_dice`` of one decoder layer, following mmdet
    3.3.0's ``Mask2FormerHead._loss_by_feat_single`` (and ``MaskFormerHead.get_targets``) op for
    op, the ground truth sampled a block of masks at a time (module docstring).

    Args:
        targets: the layer's matching (``point_targets``), where the caller has it already.
            Defaults to None (matched here).
    """
    from mmcv.ops import point_sample
    from mmdet.models.utils import get_uncertain_point_coords_with_randomness
    if targets is None:
        targets = point_targets(head, cls_scores, mask_preds, batch_gt_instances,
                                batch_img_metas)
    cls_scores = cls_scores.flatten(0, 1)
    loss_cls = head.loss_cls(cls_scores, targets.labels, targets.label_weights,
                             avg_factor=targets.class_avg_factor)

    # mmdet's mask_preds[mask_weights > 0], by index: a bool mask would be read on the host
    mask_preds = mask_preds.flatten(0, 1)[targets.positive_rows]
    if targets.positive_rows.numel() == 0:
        loss_dice = mask_preds.sum()
        loss_mask = mask_preds.sum()
        return loss_cls, loss_mask, loss_dice

    with torch.no_grad():
        points_coords = get_uncertain_point_coords_with_randomness(
            mask_preds.unsqueeze(1), None, head.num_points, head.oversample_ratio,
            head.importance_sample_ratio)
        # the matched masks of each image at their rows' points, in mask_preds' order
        mask_point_targets, start = [], 0
        for gt_instances, rows in zip(batch_gt_instances, targets.matched_gts):
            stop = start + rows.numel()
            mask_point_targets.append(
                sampled_masks(gt_instances.masks, points_coords[start:stop], rows))
            start = stop
        mask_point_targets = torch.cat(mask_point_targets)
    mask_point_preds = point_sample(mask_preds.unsqueeze(1), points_coords).squeeze(1)

    num_total_masks = targets.num_total_masks
    loss_dice = head.loss_dice(mask_point_preds, mask_point_targets, avg_factor=num_total_masks)
    loss_mask = head.loss_mask(mask_point_preds.reshape(-1), mask_point_targets.reshape(-1),
                               avg_factor=num_total_masks * head.num_points)
    return loss_cls, loss_mask, loss_dice
