"""What every Mesa module shares: the class swap that converts a module in place, and the
quantizers it attaches for what it saves.

The rest of what layers share lives beside it, one concern a module: ``autocast`` (autocast and
what a forward records for its backward), ``formulas`` (backward formulas several layers share)
and ``chunking`` (working through large tensors a few samples at a time).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

import torch
from torch import nn

from .. import opaque
from ..config import MesaConfig
from ..division import DivisionCompressor, DivisionSpec
from ..quantizer import ActivationQuantizer, QuantSpec
from ..state import SWAPPED_CLASSES

M = TypeVar('M', bound=nn.Module)


def quant_spec(config: MesaConfig, group_dim: int, group_size: int | None = None) -> QuantSpec:
    """The spec for one saved activation; ``group_size=None`` means the config's channel groups."""
    return QuantSpec(bits=config.bits, group_dim=group_dim,
                     group_size=config.group_size if group_size is None else group_size,
                     stochastic=config.stochastic_rounding, ema_decay=config.ema_decay,
                     backend=config.backend, refine_error=config.attention_refine_error,
                     refine_below=config.batchnorm_refine_below)


def row_group_config(config: MesaConfig) -> MesaConfig:
    """The config of quantizers with one group per row: Mesa's quantizer (DIVISION's low-pass
    needs channels), and the batch's own range, since a row index is a different image and
    class each batch and a running estimate would only widen its range."""
    return dataclasses.replace(config, compressor='mesa', ema_decay=0.0)


def make_quantizer(config: MesaConfig, group_dim: int, group_size: int | None = None
                   ) -> ActivationQuantizer | DivisionCompressor:
    """The compressor of one saved activation, as ``config.compressor`` says.

    A DIVISION-compressed activation treats ``group_dim`` as its channel dimension.
    """
    if config.compressor == 'division':
        return DivisionCompressor(DivisionSpec(
            block=config.division_block, bits=config.division_bits, channel_dim=group_dim,
            stochastic=config.stochastic_rounding, backend=config.backend))
    return ActivationQuantizer(quant_spec(config, group_dim, group_size))


class MesaModule:
    """Mixin of every Mesa module: a torch module whose saved activations are compressed.

    Conversion swaps the class of an existing module in place (``convert``), so Parameters,
    buffers, hooks, the training flag and state-dict names all stay what they were.
    """

    mesa_config: MesaConfig
    mesa_original_type: str  # the torch/mmcv class it was converted from (reports, memory)
    # The activations a layer saves: attribute name -> (group_dim, group_size), where a
    # group_size of None means the config's channel groups. One ActivationQuantizer each.
    mesa_quantizers: dict[str, tuple[int, int | None]] = {}
    # Set on an instance before its conversion by a parent that knows the rows of its inputs
    # (dim 0) are unrelated vectors of very different scales (K-Net's proposals): every
    # quantizer then gets one group per row over the batch's own range.
    mesa_row_groups: bool = False
    # Set by a converter that had to keep more than the layer type usually keeps (an attention
    # whose maps could not be left out); the conversion report lists it.
    mesa_note: str | None = None
    # The layer type whose settings (``MesaConfig.for_layer``: bit width, rounding) a module built
    # directly takes from the config it is given; conversion hands each module its own already.
    mesa_layer_type: str | None = None
    # A layer whose forward is the same in train and eval mode compresses in either, wherever a
    # backward will follow: a model may keep trainable modules in eval mode (mmpretrain's ViG
    # puts its stem there in every training step). Layers whose forward depends on the mode
    # (dropout, BatchNorm, attention with dropout) compress in train mode only.
    mesa_any_mode: bool = False
    # Set on a module whose first training step decides whether it stays converted (the generic
    # path, ``MesaFunctional``). Until then dynamo traces its own forward (unconverted, its
    # children each one op) rather than making it one op: a compiled graph's modules cannot
    # change class between steps without a recompile.
    mesa_probe_pending: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every Mesa forward is one op under ``torch.compile`` (``opaque``): dynamo meets the
        call, not the layer's Python."""
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get('forward')
        if forward is None or getattr(forward, 'mesa_opaque', False):
            return

        @functools.wraps(forward)
        def compiled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if (torch.compiler.is_compiling() and not self.mesa_probe_pending
                    and opaque.wanted(self, args, kwargs)):
                return opaque.call(self, args, kwargs)
            return forward(self, *args, **kwargs)

        compiled_forward.mesa_opaque = True  # type: ignore[attr-defined]
        cls.forward = compiled_forward

    def __setstate__(self, state: dict) -> None:
        """A copied module (``copy.deepcopy``, pickle) is registered like a converted one."""
        super().__setstate__(state)  # type: ignore[misc]
        opaque.register(self)  # type: ignore[arg-type]

    def __init__(self, *args: Any, mesa_config: MesaConfig | None = None, **kwargs: Any) -> None:
        """Build the torch module from its usual arguments, then attach Mesa."""
        super().__init__(*args, **kwargs)
        config = mesa_config or MesaConfig()
        if self.mesa_layer_type is not None:
            config = config.for_layer(self.mesa_layer_type)
        self.mesa_setup(config)

    def mesa_setup(self, config: MesaConfig) -> None:
        """Attach the quantizers; called once after the class swap (or from ``__init__``)."""
        self.mesa_config = config
        opaque.register(self)  # type: ignore[arg-type]
        if self.mesa_row_groups:
            config = row_group_config(config)
        for name, (group_dim, group_size) in self.mesa_quantizers.items():
            if self.mesa_row_groups:
                group_dim, group_size = 0, 1
            setattr(self, name, make_quantizer(config, group_dim, group_size))

    @classmethod
    def convert(cls: type[M], module: nn.Module, config: MesaConfig) -> M:
        """Turn ``module`` (an instance of this class's torch base) into this Mesa class, in place.

        A subclass of the base (e.g. mmcv's ``Linear``) becomes a class deriving from both, so its
        own behaviour stays on the unmodified path and ``isinstance`` checks keep working.
        """
        original = type(module)
        base = next(b for b in cls.__bases__
                    if issubclass(b, nn.Module) and not issubclass(b, MesaModule))
        if not isinstance(module, base):
            raise TypeError(f'{cls.__name__}.convert expects a {base.__name__}, '
                            f'got {original.__name__}')
        if original is base:
            target = cls
        else:
            key = (cls, original)
            if key not in SWAPPED_CLASSES:
                # named after both: code that recognises a model by its class name (mmseg's
                # layer-decay optimizer constructor looks for 'BEiT' in the backbone's) still does
                name = f'{cls.__name__}[{original.__name__}]'
                SWAPPED_CLASSES[key] = type(name, (cls, original),
                                            {'__module__': cls.__module__,
                                             '__qualname__': f'{cls.__qualname__}'
                                                             f'[{original.__name__}]'})
            target = SWAPPED_CLASSES[key]
        module.__class__ = target
        module.mesa_original_type = original.__name__
        module.mesa_setup(config)
        return module

    def mesa_active(self, *tensors: torch.Tensor | None) -> bool:
        """Compress only when something will be saved for backward: grad mode on, an input
        that needs a gradient, and train mode unless ``mesa_any_mode``. What dynamo traces of a
        Mesa module (a method other than ``forward``, which is one op: ``opaque``) takes the
        unconverted path, which inductor compiles as it compiles the baseline."""
        if torch.compiler.is_compiling():
            return False
        if not ((self.training or self.mesa_any_mode) and self.mesa_config.enabled  # type: ignore[attr-defined]
                and torch.is_grad_enabled()):
            return False
        for t in tensors:  # a loop, not any() over a generator: every layer call asks
            if t is not None and t.requires_grad:
                return True
        return False
