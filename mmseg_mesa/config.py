"""The one configuration object of mmseg-mesa.

A frozen dataclass, validated on construction and passed explicitly to every conversion; there is no
global state. ``MesaConfig.from_cfg`` is the single place where an mmengine ``mesa=...`` value
becomes a ``MesaConfig``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_BITS = (2, 4, 8)
BACKENDS = ('auto', 'cuda', 'torch')
LAYER_TYPES = (
    'linear', 'conv2d', 'gelu', 'softmax', 'layernorm', 'matmul', 'batchnorm', 'relu', 'dropout',
    'droppath', 'attention', 'loss',
)


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f'MesaConfig: invalid {key}={value!r}; allowed: {allowed}')


@dataclass(frozen=True)
class MesaConfig:
    """How Mesa compresses the activations it saves for backward.

    Args:
        enabled: When False every converted layer runs the unmodified torch path.
            Defaults to True.
        bits: Bit width of saved activations (masks of ReLU/Dropout are always 1 bit).
            Defaults to 8, as in the paper.
        group_size: Channels that share one scale/offset for hidden features. Attention maps and
            the operands of attention matmuls always use one group per head. Defaults to 1: one
            group per channel, finer than the paper's head-wise groups at a cost of 8 bytes per
            channel per layer. Transformer features have outlier channels; with groups of 32 the
            layer-0 LayerNorm weight gradient of DeiT-S UPerNet measured cosine 0.986 against
            the exact one, per channel 0.994.
        ema_decay: Decay of the running estimates of each group's min and range; the first
            training step takes the batch statistics as they are. Defaults to 0.9 (the paper's).
        stochastic_rounding: Round stochastically (unbiased) instead of to nearest.
            Defaults to True.
        backend: ``'auto'`` uses the compiled CUDA kernels for CUDA tensors when they are built,
            ``'cuda'`` requires them, ``'torch'`` always uses the pure-PyTorch reference.
            Defaults to ``'auto'``.
        layers: Layer types to compress, a subset of ``LAYER_TYPES``; ``'loss'`` makes decode
            heads keep only their low-resolution logits for the loss (exact recomputation, no
            quantization). Defaults to all of them.
        skip: ``fnmatch`` patterns of qualified module names left unconverted. Defaults to ().
    """

    enabled: bool = True
    bits: int = 8
    group_size: int = 1
    ema_decay: float = 0.9
    stochastic_rounding: bool = True
    backend: str = 'auto'
    layers: frozenset[str] = field(default_factory=lambda: frozenset(LAYER_TYPES))
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            _fail('enabled', self.enabled, 'True or False')
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            _fail('bits', self.bits, ', '.join(map(str, SUPPORTED_BITS)))
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or self.group_size < 1:
            _fail('group_size', self.group_size, 'an integer >= 1')
        if isinstance(self.ema_decay, bool) or not isinstance(self.ema_decay, (int, float)) \
                or not 0.0 <= self.ema_decay < 1.0:
            _fail('ema_decay', self.ema_decay, 'a number in [0, 1)')
        if not isinstance(self.stochastic_rounding, bool):
            _fail('stochastic_rounding', self.stochastic_rounding, 'True or False')
        if self.backend not in BACKENDS:
            _fail('backend', self.backend, ', '.join(BACKENDS))
        layers = self.layers
        if isinstance(layers, str) or not isinstance(layers, Iterable):
            _fail('layers', layers, 'a collection of ' + ', '.join(LAYER_TYPES))
        layers = frozenset(layers)
        unknown = sorted(layers - set(LAYER_TYPES))
        if unknown:
            _fail('layers', unknown, ', '.join(LAYER_TYPES))
        object.__setattr__(self, 'layers', layers)
        skip = self.skip
        if isinstance(skip, str):
            skip = (skip,)
        if not all(isinstance(p, str) for p in skip):
            _fail('skip', self.skip, 'a sequence of fnmatch patterns (strings)')
        object.__setattr__(self, 'skip', tuple(skip))

    @classmethod
    def from_cfg(cls, value: bool | Mapping[str, Any] | MesaConfig | None) -> MesaConfig | None:
        """Build from an mmengine config value: ``True``, ``dict(...)``, or falsy for "off".

        Unknown keys are an error that lists the valid ones, so a typo never silently
        falls back to a default.
        """
        if isinstance(value, MesaConfig):
            return value
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(f'mesa must be True, False or a dict, got {type(value).__name__}')
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise ValueError(f'mesa: unknown key(s) {unknown}; valid keys: {valid}')
        kwargs = dict(value)
        if 'layers' in kwargs and not isinstance(kwargs['layers'], str):
            kwargs['layers'] = frozenset(kwargs['layers'])
        if 'skip' in kwargs and isinstance(kwargs['skip'], list):
            kwargs['skip'] = tuple(kwargs['skip'])
        return cls(**kwargs)
