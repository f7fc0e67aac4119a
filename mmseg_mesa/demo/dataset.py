"""A small procedurally generated segmentation dataset in ADE20K layout, and its mmseg class.

Every scene is a textured ``ground`` with a handful of shapes on it. Each class has its own shape
and its own texture (smooth gradient, checkerboard, speckle, stripes, ...) and a colour drawn
around its own mean, with per-image colour casts, contrast changes and pixel noise on top, so a
per-pixel colour lookup is not enough near the boundaries and for similar colours, but a small
network gets close to its plateau (mIoU in the mid 80s) within the demo's 1000 steps. That matters
for the comparison: on a harder version (colour spread 30, pixel noise 12) neither run had
converged after 1000 steps and single runs spread by 3-5 mIoU (see docs/benchmarks.md).

Labels follow the ADE20K convention: ``0`` is "other" (small clutter blobs, ignored in training
and evaluation once ``reduce_zero_label=True`` maps it to 255), classes are ``1..K``.
"""
from __future__ import annotations

import json
import math
import os
import os.path as osp
from collections.abc import Callable
from glob import glob
from typing import Any

import cv2
import numpy as np
from mmseg.datasets import BaseSegDataset
from mmseg.registry import DATASETS

CLASSES = ('ground', 'disc', 'box', 'triangle', 'stripes', 'ring')
PALETTE = [[120, 110, 90], [220, 60, 50], [50, 90, 220], [60, 180, 70], [230, 200, 40],
           [170, 70, 190]]
# Mean colour (RGB) of each class's texture; shapes draw theirs with a spread of COLOUR_SPREAD,
# enough that the nearest classes still overlap in colour once casts and noise are added.
CLASS_COLOURS = np.array([[125, 115, 100], [190, 90, 80], [90, 110, 180], [100, 160, 100],
                          [190, 170, 90], [150, 100, 160]], dtype=np.float32)
COLOUR_SPREAD = 15.0
PIXEL_NOISE = 6.0
# Settings of the generator: (colour spread, pixel noise). 'hard' is the version that neither run
# of the demo model had converged on after 1000 steps: a harder test of training fidelity.
DIFFICULTIES = {'standard': (COLOUR_SPREAD, PIXEL_NOISE), 'hard': (30.0, 12.0)}
FORMAT_VERSION = 2
MARKER = 'mesa_demo.json'
SPLITS = {'training': 0, 'validation': 1}

Rng = np.random.Generator


def _colour(rng: Rng, label: int, spread: float) -> np.ndarray:
    return np.clip(CLASS_COLOURS[label - 1] + rng.normal(0.0, spread, 3), 0, 255)


def _smooth_noise(rng: Rng, size: int, cells: int) -> np.ndarray:
    """Low-frequency noise in about [-1, 1]: a coarse random grid, upsampled bicubically."""
    grid = rng.uniform(-1.0, 1.0, (cells, cells)).astype(np.float32)
    return cv2.resize(grid, (size, size), interpolation=cv2.INTER_CUBIC)


def _coords(size: int) -> tuple[np.ndarray, np.ndarray]:
    return np.mgrid[0:size, 0:size].astype(np.float32)


# Textures: (rng, size, colour spread) -> float32 image HxWx3 in about [0, 255], one per class.
def _ground(rng: Rng, size: int, spread: float) -> np.ndarray:
    base = _colour(rng, 1, spread)
    shade = _smooth_noise(rng, size, 5)[..., None] * 35.0
    return base + shade + _smooth_noise(rng, size, size // 3)[..., None] * 12.0


def _disc(rng: Rng, size: int, spread: float) -> np.ndarray:
    yy, xx = _coords(size)
    angle = rng.uniform(0, 2 * math.pi)
    ramp = (np.cos(angle) * xx + np.sin(angle) * yy) / size
    tint = np.array([1.0, 0.6, 0.4])
    return _colour(rng, 2, spread) + ramp[..., None] * rng.uniform(40, 80) * tint


def _box(rng: Rng, size: int, spread: float) -> np.ndarray:
    yy, xx = _coords(size)
    period = int(rng.integers(4, 8))
    checker = ((xx // period + yy // period) % 2)[..., None]
    return _colour(rng, 3, spread) + (checker - 0.5) * rng.uniform(30, 60)


def _triangle(rng: Rng, size: int, spread: float) -> np.ndarray:
    speckle = (rng.random((size, size)) < 0.25).astype(np.float32)[..., None]
    return _colour(rng, 4, spread) + (speckle - 0.25) * rng.uniform(60, 100)


def _stripes(rng: Rng, size: int, spread: float) -> np.ndarray:
    yy, xx = _coords(size)
    angle = rng.uniform(0, math.pi)
    period = rng.uniform(5, 9)
    phase = (np.cos(angle) * xx + np.sin(angle) * yy) * (2 * math.pi / period)
    return _colour(rng, 5, spread) + np.sin(phase)[..., None] * rng.uniform(30, 50)


def _ring(rng: Rng, size: int, spread: float) -> np.ndarray:
    return _colour(rng, 6, spread) + _smooth_noise(rng, size, size // 2)[..., None] * 25.0


TEXTURES: dict[int, Callable[[Rng, int, float], np.ndarray]] = {
    1: _ground, 2: _disc, 3: _box, 4: _triangle, 5: _stripes, 6: _ring}


# Shapes: draw class `label` into the uint8 mask (value 1 inside) at a random place and size.
def _draw_shape(rng: Rng, mask: np.ndarray, label: int) -> None:
    size = mask.shape[0]
    cx, cy = (int(v) for v in rng.integers(0, size, 2))
    r = int(size * rng.uniform(0.11, 0.24))
    if label == 2:
        axes = (r, max(2, int(r * rng.uniform(0.7, 1.0))))
        cv2.ellipse(mask, (cx, cy), axes, float(rng.uniform(0, 180)), 0, 360, 1, -1)
    elif label == 3:
        w, h = (int(v) for v in rng.integers(max(3, r // 2), 2 * r + 1, 2))
        cv2.rectangle(mask, (cx - w // 2, cy - h // 2), (cx + w // 2, cy + h // 2), 1, -1)
    elif label == 4:
        angles = rng.uniform(0, 2 * math.pi) + np.array([0, 2.1, 4.2]) + rng.normal(0, 0.2, 3)
        points = np.stack([cx + 1.3 * r * np.cos(angles), cy + 1.3 * r * np.sin(angles)], 1)
        cv2.fillPoly(mask, [points.round().astype(np.int32)], 1)
    elif label == 5:
        w, h = 2 * r, max(3, int(r * rng.uniform(0.6, 1.2)))
        box = cv2.boxPoints(((cx, cy), (w, h), float(rng.uniform(0, 180))))
        cv2.fillPoly(mask, [box.round().astype(np.int32)], 1)
    elif label == 6:
        cv2.circle(mask, (cx, cy), r, 1, max(2, r // 2))
    else:
        raise ValueError(f'no shape for label {label}')


def make_scene(rng: Rng, size: int, difficulty: str = 'standard'
               ) -> tuple[np.ndarray, np.ndarray]:
    """One image (uint8 HxWx3, RGB) and its label map (uint8 HxW, ADE convention), with the
    colour spread and pixel noise of ``difficulty`` (a key of ``DIFFICULTIES``)."""
    spread, noise = DIFFICULTIES[difficulty]
    image = TEXTURES[1](rng, size, spread)
    label = np.ones((size, size), np.uint8)
    num_classes = len(CLASSES)
    for cls in rng.integers(2, num_classes + 1, int(rng.integers(3, 7))):
        mask = np.zeros((size, size), np.uint8)
        _draw_shape(rng, mask, int(cls))
        inside = mask.astype(bool)
        image[inside] = TEXTURES[int(cls)](rng, size, spread)[inside]
        label[inside] = cls
    # Clutter: small blobs of unrelated colour noise, labelled "other" (0).
    for _ in range(int(rng.integers(0, 3))):
        mask = np.zeros((size, size), np.uint8)
        centre = tuple(int(v) for v in rng.integers(0, size, 2))
        cv2.circle(mask, centre, max(2, int(size * rng.uniform(0.02, 0.05))), 1, -1)
        inside = mask.astype(bool)
        image[inside] = rng.uniform(0, 255, (int(inside.sum()), 3))
        label[inside] = 0
    cast = rng.normal(0.0, 10.0, 3)
    contrast = rng.uniform(0.8, 1.2)
    image = (image - 128.0) * contrast + 128.0 + cast + rng.normal(0.0, noise, image.shape)
    return np.clip(image, 0, 255).round().astype(np.uint8), label


def _stem(split: str, index: int) -> str:
    return f'demo_{split}_{index:05d}'


def write_demo_dataset(root: str, *, num_train: int = 2000, num_val: int = 200, size: int = 64,
                       seed: int = 0, difficulty: str = 'standard') -> dict[str, Any]:
    """Write the demo dataset under ``root`` in ADE20K layout, unless it is already there.

    ``root/images/{training,validation}/*.jpg`` and ``root/annotations/{training,validation}/*.png``
    with the same stems. Image ``i`` of a split depends only on ``(seed, split, i, size)``, so the
    result is deterministic. A marker file records the parameters; a second call with the same
    ones does nothing, a call with other ones removes the previous demo files and writes anew.

    Args:
        root: Directory of the dataset (created if needed).
        num_train: Number of training images. Defaults to 2000.
        num_val: Number of validation images. Defaults to 200.
        size: Side of the square images, in pixels. Defaults to 64.
        seed: Seed of the scene generator. Defaults to 0.
        difficulty: ``'standard'`` or ``'hard'`` (``DIFFICULTIES``: twice the colour spread
            and pixel noise). Defaults to ``'standard'``.

    Returns:
        ``dict(root, classes, num_train, num_val, size, seed, difficulty, written)``, where
        ``written`` says whether files were written by this call.
    """
    if size < 16:
        raise ValueError(f'write_demo_dataset: size must be >= 16, got {size}')
    if difficulty not in DIFFICULTIES:
        raise ValueError(f'write_demo_dataset: difficulty must be one of '
                         f'{", ".join(DIFFICULTIES)}, got {difficulty!r}')
    params = dict(version=FORMAT_VERSION, num_train=int(num_train), num_val=int(num_val),
                  size=int(size), seed=int(seed), difficulty=difficulty)
    info = dict(root=root, classes=CLASSES, num_train=num_train, num_val=num_val, size=size,
                seed=seed, difficulty=difficulty)
    marker = osp.join(root, MARKER)
    if osp.isfile(marker):
        with open(marker) as f:
            if json.load(f) == params:
                return dict(info, written=False)
        os.remove(marker)
    for split, split_id in SPLITS.items():
        image_dir = osp.join(root, 'images', split)
        label_dir = osp.join(root, 'annotations', split)
        os.makedirs(image_dir, exist_ok=True)
        os.makedirs(label_dir, exist_ok=True)
        for stale in glob(osp.join(image_dir, 'demo_*.jpg')) + \
                glob(osp.join(label_dir, 'demo_*.png')):
            os.remove(stale)
        count = params['num_train'] if split == 'training' else params['num_val']
        for index in range(count):
            rng = np.random.default_rng([seed, split_id, index, size])
            image, label = make_scene(rng, size, difficulty)
            stem = _stem(split, index)
            cv2.imwrite(osp.join(image_dir, stem + '.jpg'), image[..., ::-1],
                        [cv2.IMWRITE_JPEG_QUALITY, 95])
            cv2.imwrite(osp.join(label_dir, stem + '.png'), label)
    # The marker goes last: an interrupted write is redone by the next call.
    with open(marker, 'w') as f:
        json.dump(params, f)
    return dict(info, written=True)


@DATASETS.register_module()
class MesaDemoDataset(BaseSegDataset):
    """The demo dataset (``write_demo_dataset``): ADE20K layout and label convention.

    Args:
        img_suffix: Suffix of images. Defaults to '.jpg'.
        seg_map_suffix: Suffix of label maps. Defaults to '.png'.
        reduce_zero_label: Map "other" (0) to the ignore index and classes ``1..K`` to
            ``0..K-1``. Defaults to True.
    """

    METAINFO = dict(classes=CLASSES, palette=PALETTE)

    def __init__(self, img_suffix: str = '.jpg', seg_map_suffix: str = '.png',
                 reduce_zero_label: bool = True, **kwargs: Any) -> None:
        super().__init__(img_suffix=img_suffix, seg_map_suffix=seg_map_suffix,
                         reduce_zero_label=reduce_zero_label, **kwargs)
