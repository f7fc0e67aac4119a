"""The one configuration object of mmseg-mesa.

A frozen dataclass, validated on construction and passed explicitly to every conversion: no
setting of how a model is compressed is process-wide (what is process-wide, the handler table
and the like, is listed in ``mmseg_mesa.state``). ``MesaConfig.from_cfg`` is the single place
where an mmengine ``mesa=...`` value becomes a ``MesaConfig``. The layer types it names are
declared beside the layers' code (``mmseg_mesa.layer_types``).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .layer_types import (
    default_layer_types,
    default_nearest_rounding,
    division_layer_types,
    layer_types,
)

SUPPORTED_BITS = (2, 4, 8, 16)  # 16: 8-bit codes and a second 8-bit pass (quantizer.refine)
DIVISION_BITS = (2, 4, 8)  # DIVISION's residual codes
BACKENDS = ('auto', 'cuda', 'torch')
COMPRESSORS = ('mesa', 'division')
# What converted attention keeps of its maps for backward: 'recompute' keeps none (backward
# recomputes them from the 8-bit q, k and v, layers.attention_core); 'stored' keeps Mesa's 8-bit
# copy of every map.
ATTENTION_MAPS = ('recompute', 'stored')


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f'MesaConfig: invalid {key}={value!r}; allowed: {allowed}')


def _is_bits(value: Any, allowed: tuple[int, ...] = SUPPORTED_BITS) -> bool:
    return not isinstance(value, bool) and value in allowed


def _types(key: str, value: Any, allowed: tuple[str, ...]) -> frozenset[str]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        _fail(key, value, 'a collection of ' + ', '.join(allowed))
    value = frozenset(value)
    unknown = sorted(value - set(allowed))
    if unknown:
        _fail(key, unknown, ', '.join(allowed))
    return value


def _patterns(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable) or not all(isinstance(p, str) for p in value):
        _fail(key, value, 'a sequence of fnmatch patterns (strings)')
    return tuple(value)


@dataclass(frozen=True)
class Calibration:
    """Which converted layers keep about 16 bits, chosen from the gradient of one small step
    (``mmseg_mesa.calibration``): the layers whose 8-bit codes move the parameter gradients by
    more than these bounds allow, measured against a step whose codes are all refined.

    Args:
        error: The largest whole-gradient relative error the layers left at 8 bits may make
            together. Defaults to 0.02, the bound the sweeps hold every model to: a model whose
            8-bit codes already hold it keeps them (a tighter bound refined a third of the
            layers of models at 0.015, docs/sweeps.md).
        cosine: The smallest cosine of any parameter's gradient (among those at least 1e-3 of
            the largest) the layers left at 8 bits may leave. Defaults to 0.99, the sweeps'
            bound; each parameter's expected squared error is held to half its limit, since
            one step's error on one parameter is one draw.
        passes: The most training steps (forward and backward) it may run; where they run out
            it refines the groups of layers it has not split yet. Defaults to 64.
        batch: Images of the first training batch it steps on (all of them where it has
            fewer): two, since BatchNorms over pooled 1x1 maps (UPerNet's pyramid pooling)
            cannot train on one. Its step saves Mesa's codes, a fraction of the baseline's
            tensors, so it fits wherever the baseline trains on two. Defaults to 2.
    """

    error: float = 0.02
    cosine: float = 0.99
    passes: int = 64
    batch: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.error, bool) or not isinstance(self.error, (int, float)) \
                or not self.error > 0:
            _fail('calibrate.error', self.error, 'a number > 0')
        if isinstance(self.cosine, bool) or not isinstance(self.cosine, (int, float)) \
                or not 0 < self.cosine < 1:
            _fail('calibrate.cosine', self.cosine, 'a number in (0, 1)')
        for key in ('passes', 'batch'):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(f'calibrate.{key}', value, 'an integer >= 1')


def _calibration(value: Any) -> Calibration | None:
    if value is None or value is False:
        return None
    if value is True:
        return Calibration()
    if isinstance(value, Calibration):
        return value
    if isinstance(value, Mapping):
        valid = [f.name for f in dataclasses.fields(Calibration)]
        unknown = sorted(set(value) - set(valid))
        if unknown:
            _fail('calibrate', unknown, 'True, False or a dict of ' + ', '.join(valid))
        return Calibration(**value)
    _fail('calibrate', value, 'True, False or a dict of Calibration fields')


@dataclass(frozen=True)
class MesaConfig:
    """How Mesa compresses the activations it saves for backward.

    Args:
        enabled: When False every converted layer runs the unmodified torch path.
            Defaults to True.
        bits: Bit width of saved activations: 2, 4, 8 or 16 (8-bit codes and a second 8-bit
            pass over what they miss, ``quantizer.refine``); masks of ReLU/Dropout are always 1
            bit. Defaults to 8, as in the paper.
        layer_bits: Bit widths per layer type (``layer_types.layer_types()``) that override
            ``bits``, e.g. ``{'gelu': 4}`` or ``{'batchnorm': 16}`` (timm's RepViT at 128x128:
            worst cosine 0.987 -> 0.9998, saved bytes 0.196 -> 0.277 of the baseline's); an
            ``'attention'`` entry also covers the matmuls and softmax inside converted attention
            modules unless those types have entries of their own. Defaults to none.
        group_size: Channels that share one scale/offset for hidden features. Attention maps and
            the operands of attention matmuls always use one group per head. Defaults to 1: one
            group per channel, at 8 bytes per channel per layer, because transformer features
            have outlier channels that coarser groups spread over their neighbours (groups of 32
            cost DeiT-S UPerNet's LayerNorm weight gradients measurably, docs/benchmarks.md).
        ema_decay: Decay of the running estimates of each group's min and range; the first
            training step takes the batch statistics as they are. Defaults to 0.9 (the paper's).
        stochastic_rounding: Round stochastically (unbiased) instead of to nearest, in every
            layer type but those of ``nearest_rounding``. Defaults to True.
        nearest_rounding: Layer types whose codes round to nearest even where
            ``stochastic_rounding`` is True. Defaults to those declared so
            (``layer_types.default_nearest_rounding()``: ``{'batchnorm', 'gelu',
            'activation'}``); ``()`` rounds every layer stochastically.
        backend: ``'auto'`` uses the compiled kernels of the tensor's device (CPU or CUDA)
            when they are built, ``'cuda'`` requires the CUDA kernels (and CUDA tensors),
            ``'torch'`` always uses the pure-PyTorch reference; all give the same codes.
            Defaults to ``'auto'``.
        layers: Layer types to compress, a subset of ``layer_types.layer_types()``;
            ``'loss'`` makes decode heads keep only their low-resolution logits for the loss
            (exact recomputation, no quantization), UPerHead fuse its FPN outputs without
            holding them twice and drop the feature levels it has read (through
            ``EncoderDecoder``).
            Defaults to all of them but the opt-in ones (``'droppath'``).
        skip: ``fnmatch`` patterns of qualified module names left unconverted. Defaults to ().
        compressor: ``'mesa'`` (the ``bits``-bit quantizer) or ``'division'`` (DIVISION's
            low-pass copy plus a low-bit residual, see ``mmseg_mesa.division``) for every layer
            of a type whose saved activation is a feature map
            (``layer_types.division_layer_types()``); other types always use Mesa's quantizer.
            Defaults to ``'mesa'``.
        division: Layer types (from ``division_layer_types()``) that use DIVISION whatever
            ``compressor`` says. Defaults to none.
        division_modules: ``fnmatch`` patterns of qualified module names that use DIVISION
            (matching modules of other types keep Mesa's quantizer). Defaults to ().
        division_block: Side of DIVISION's average-pooling block. Defaults to 8 (the paper's).
        division_bits: Bit width of DIVISION's high-frequency residual (2, 4 or 8). Defaults
            to 2.
        attention_maps: ``'recompute'``: attention keeps no map for backward, which recomputes
            each map from the 8-bit q, k and v (O(N) memory per layer instead of O(N^2));
            ``'stored'``: Mesa's 8-bit copy of every map. Defaults to ``'recompute'``.
        attention_refine_error: The largest difference, in logits, that a replay of an
            attention's logits from its 8-bit q and k may make on a few sampled rows; beyond it
            q, k and v keep a second 8-bit pass (about 16 bits; ``layers.attention_core.
            refined_heads``). Logits grow as training sharpens maps: DeiT-S UPerNet at 512x512
            with logits 16 times their initial size measured a gradient error of 0.069-0.099
            with 8-bit operands, 0.0074 refined (docs/benchmarks.md). Measured on the device at
            every call and read by the host a call late (``host.LateReading``): a call refines
            from the previous call's error, the first from its own. ``math.inf`` never refines
            (and measures nothing). Defaults to 0.05.
        batchnorm_refine_below: A training-mode BatchNorm whose batch statistics run over fewer
            values per channel than this keeps its normalized input at about 16 bits (8-bit
            codes refined), the rest at ``bits``. Its backward sends each channel one sum of
            the codes against the output gradient, along the whole channel; over few values
            their rounding does not average out and adds up through the layers before (timm's
            RepViT UPerNet at 128x128, 128 values per channel at stride 16: worst cosine 0.987
            with 8 bits, 0.9996 with these refined; at 256x256, 512 values, 0.998 with 8 bits).
            At mmseg's training crops few BatchNorms qualify: +0.00-0.05% saved bytes
            (docs/sweeps.md). 0 never refines. Defaults to 256.
        calibrate: Choose from the gradient which layers keep about 16 bits: at the first
            training step (``MesaHook``) or ``tools/calibrate.py``, one small step is taken with
            8-bit and with refined codes, and the layers whose codes move the gradient beyond
            the bounds are found by halving groups of layers (``mmseg_mesa.calibration``). It
            finds what no rule names (ConViT's positional projection, ReXNet's). The rules
            above still apply on top, as cheap first choices it measures with. ``True`` (the
            default bounds, ``Calibration``), a dict of ``Calibration`` fields, or False (the
            rules alone). Defaults to the default bounds: where the rules hold it costs a
            forward and two steps of two images, once per run (docs/sweeps.md).

    Named presets (``MesaConfig.preset(name)``, or ``mesa=dict(preset=name, ...)`` in a config)
    bundle these fields; see ``PRESETS``.
    """

    enabled: bool = True
    bits: int = 8
    group_size: int = 1
    ema_decay: float = 0.9
    stochastic_rounding: bool = True
    nearest_rounding: frozenset[str] = field(default_factory=default_nearest_rounding)
    backend: str = 'auto'
    layers: frozenset[str] = field(default_factory=default_layer_types)
    skip: tuple[str, ...] = ()
    layer_bits: tuple[tuple[str, int], ...] = ()
    compressor: str = 'mesa'
    division: frozenset[str] = frozenset()
    division_modules: tuple[str, ...] = ()
    division_block: int = 8
    division_bits: int = 2
    attention_maps: str = 'recompute'
    attention_refine_error: float = 0.05
    batchnorm_refine_below: int = 256
    calibrate: Calibration | None = field(default_factory=Calibration)

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            _fail('enabled', self.enabled, 'True or False')
        if not _is_bits(self.bits):
            _fail('bits', self.bits, ', '.join(map(str, SUPPORTED_BITS)))
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or self.group_size < 1:
            _fail('group_size', self.group_size, 'an integer >= 1')
        if isinstance(self.ema_decay, bool) or not isinstance(self.ema_decay, (int, float)) \
                or not 0.0 <= self.ema_decay < 1.0:
            _fail('ema_decay', self.ema_decay, 'a number in [0, 1)')
        if not isinstance(self.stochastic_rounding, bool):
            _fail('stochastic_rounding', self.stochastic_rounding, 'True or False')
        object.__setattr__(self, 'nearest_rounding',
                           _types('nearest_rounding', self.nearest_rounding, layer_types()))
        if self.backend not in BACKENDS:
            _fail('backend', self.backend, ', '.join(BACKENDS))
        object.__setattr__(self, 'layers', _types('layers', self.layers, layer_types()))
        object.__setattr__(self, 'skip', _patterns('skip', self.skip))
        layer_bits = self.layer_bits
        items = layer_bits.items() if isinstance(layer_bits, Mapping) else layer_bits
        try:
            layer_bits = dict(items)
        except (TypeError, ValueError):
            _fail('layer_bits', self.layer_bits, 'a mapping of layer type to bit width')
        _types('layer_bits', layer_bits, layer_types())
        bad = {k: v for k, v in layer_bits.items() if not _is_bits(v)}
        if bad:
            _fail('layer_bits', bad, 'bit widths ' + ', '.join(map(str, SUPPORTED_BITS)))
        object.__setattr__(self, 'layer_bits', tuple(sorted(layer_bits.items())))
        if self.compressor not in COMPRESSORS:
            _fail('compressor', self.compressor, ', '.join(COMPRESSORS))
        object.__setattr__(self, 'division',
                           _types('division', self.division, division_layer_types()))
        object.__setattr__(self, 'division_modules',
                           _patterns('division_modules', self.division_modules))
        if isinstance(self.division_block, bool) or not isinstance(self.division_block, int) \
                or self.division_block < 2:
            _fail('division_block', self.division_block, 'an integer >= 2')
        if not _is_bits(self.division_bits, DIVISION_BITS):
            _fail('division_bits', self.division_bits, ', '.join(map(str, DIVISION_BITS)))
        if self.attention_maps not in ATTENTION_MAPS:
            _fail('attention_maps', self.attention_maps, ', '.join(ATTENTION_MAPS))
        if isinstance(self.attention_refine_error, bool) \
                or not isinstance(self.attention_refine_error, (int, float)) \
                or not self.attention_refine_error >= 0:
            _fail('attention_refine_error', self.attention_refine_error,
                  'a number >= 0 (math.inf: never refine)')
        if isinstance(self.batchnorm_refine_below, bool) \
                or not isinstance(self.batchnorm_refine_below, int) \
                or self.batchnorm_refine_below < 0:
            _fail('batchnorm_refine_below', self.batchnorm_refine_below,
                  'an integer >= 0 (0: never refine)')
        object.__setattr__(self, 'calibrate', _calibration(self.calibrate))

    def for_layer(self, layer_type: str, name: str = '') -> MesaConfig:
        """The config one converted module gets: its bit width, rounding and compressor
        resolved.

        ``bits`` becomes the layer type's entry of ``layer_bits`` (if any),
        ``stochastic_rounding`` False where ``nearest_rounding`` names the type, and
        ``compressor`` ``'division'`` or ``'mesa'`` for this module, so layers only read those.
        """
        if layer_type not in layer_types():
            raise ValueError(f'MesaConfig.for_layer: unknown layer type {layer_type!r}; '
                             f'known: {", ".join(layer_types())}')
        division = layer_type in division_layer_types() and (
            self.compressor == 'division' or layer_type in self.division
            or any(fnmatch.fnmatchcase(name, p) for p in self.division_modules))
        return dataclasses.replace(
            self, bits=dict(self.layer_bits).get(layer_type, self.bits),
            stochastic_rounding=self.stochastic_rounding
            and layer_type not in self.nearest_rounding,
            compressor='division' if division else 'mesa')

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MesaConfig:
        """A named preset (see ``PRESETS``) with some fields overridden; a former name
        (``RENAMED_PRESETS``) fails with its new one, a removed one (``REMOVED_PRESETS``) with
        the reason."""
        check_preset(name)
        fields = dict(PRESETS[name])
        without = fields.pop('without_layers', ())
        if without:
            fields['layers'] = default_layer_types() - set(without)
        return cls(**{**fields, **overrides})

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
        if isinstance(value, str):
            return cls.preset(value)
        if not isinstance(value, Mapping):
            raise ValueError('mesa must be True, False, a preset name or a dict, got '
                             f'{type(value).__name__}')
        valid = ['preset'] + [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise ValueError(f'mesa: unknown key(s) {unknown}; valid keys: {valid}')
        kwargs = dict(value)  # lists and ConfigDicts become tuples / frozensets in __post_init__
        preset = kwargs.pop('preset', None)
        return cls(**kwargs) if preset is None else cls.preset(preset, **kwargs)


# Named presets: fields that differ from MesaConfig's defaults. Their memory ratios and demo
# fidelity are measured in docs/benchmarks.md (`tools/benchmark_memory.py` runs each as a mode).
# ``without_layers`` removes layer types from the default ``layers`` (which are known only once
# the layers are imported).
PRESETS: dict[str, dict[str, Any]] = {
    # The paper's Mesa: the default layer types but 'loss' (the decode head's loss is left as it
    # is), and an 8-bit copy of every attention map.
    'paper': dict(without_layers=('loss',), attention_maps='stored'),
    # MesaConfig(), what ``mesa = True`` gives: the paper's layers plus the exact low-resolution
    # loss (layer type 'loss').
    'default': {},
    # The default with Mesa's 8-bit copy of every attention map instead of recomputing the maps
    # in backward: more memory on plain ViTs, no recomputation.
    'stored-maps': dict(attention_maps='stored'),
}
# Presets under a former name: asking for one fails with its new name.
RENAMED_PRESETS = {'mesa': 'paper'}
# Presets that were removed, and why: asking for one fails with the reason. No preset uses
# sub-byte codes: on LayerNorm's input alone they save next to nothing (the Linear after each
# norm packs 8-bit codes of its own), on any other input they cost the whole-gradient error an
# order of magnitude; no preset uses DIVISION (it cost mIoU on the demo). Figures:
# docs/benchmarks.md.
REMOVED_PRESETS = {
    'max-saving': "it saved no memory: its 4-bit LayerNorm codes cannot serve the 8-bit Linear "
                  "after each norm, so Swin-T UPerNet's step peak was the default's "
                  "(docs/benchmarks.md); layer_bits=dict(layernorm=4) gives the same config, and "
                  "activation checkpointing with the default a smaller step",
}


def check_preset(name: str) -> None:
    """Raise a ValueError naming the presets unless ``name`` is one of them."""
    if name in RENAMED_PRESETS:
        raise ValueError(f'MesaConfig: preset {name!r} was renamed to '
                         f'{RENAMED_PRESETS[name]!r}')
    if name in REMOVED_PRESETS:
        raise ValueError(f'MesaConfig: preset {name!r} was removed: {REMOVED_PRESETS[name]}; '
                         f'presets: {", ".join(PRESETS)}')
    if name not in PRESETS:
        raise ValueError(f'MesaConfig: unknown preset {name!r}; presets: {", ".join(PRESETS)}')
