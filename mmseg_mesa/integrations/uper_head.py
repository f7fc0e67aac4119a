"""UPerHead whose FPN fusion never holds its concatenated features twice.

mmseg's ``UPerHead._forward_feature`` keeps the ``laterals`` list alive through the bottleneck
and builds the list of upsampled FPN outputs next to their concatenation: on Swin-T UPerNet that
would be the peak of a whole Mesa training step (docs/benchmarks.md). ``MesaUPerHead`` runs the
same modules and ops in the same order, but writes each FPN output into its channel slice of one
buffer as soon as it exists and drops the laterals once they are used. The buffer holds exactly
what ``torch.cat`` returns and the gradients are the same slices, so forward and backward are
unchanged. The buffer is freed once the bottleneck conv has run (``releasing_input``), and that
conv saves it as the codes of the FPN outputs before upsampling (``FusedCodes``) when it is a
converted layer. Given a ``FeatureList`` (``MesaEncoderDecoder``), it also drops each input level
once its lateral conv has read it.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from mmcv.cnn import ConvModule
from mmseg.models.decode_heads.uper_head import UPerHead
from mmseg.models.utils import resize
from torch import nn

from ..config import MesaConfig
from ..handoff import INPUT_GRADIENT_BY_PARTS
from ..layers.autocast import cast, returns_owned
from ..layers.base import make_quantizer
from ..layers.chunking import rows_of, sample_slices, summed
from ..layers.conv import MesaConv2d
from ..quantizer import ActivationQuantizer, Packed, sample_range, unpack
from ..reuse import attach_codes
from ..saved import load
from .modules import MesaDecodeHead
from .segmentor import FeatureList


class LevelGradients:
    """The bottleneck conv's backward, one channel slice (FPN level) at a time.

    The conv (``MesaConv2dFunction``, reading the buffer ``concat_channels`` wrote) hands its
    backward here. The weight gradient is taken a level at a time from that level's codes
    (decoded and upsampled a few samples at a time), and the input gradient is not formed whole
    (on Swin-T UPerNet the largest temporary of its backward): the
    conv keeps its output gradient and weight here, and each ``WriteChannels`` backward takes its
    own slice, ``conv2d_input`` through that slice of the weight, which is that slice of the
    whole input gradient (each input channel's gradient reads only its own weights); it goes
    back through its upsampling before the next slice exists. Gradients are the whole conv's up
    to the order of float sums. The weight gradient is not ``weighted_backward``'s: that decodes
    all levels of a sample at once, four times what a level at a time holds, and measurably
    raised the bottleneck's own backward peak (docs/benchmarks.md).
    """

    def __init__(self, slices: int) -> None:
        self.remaining = slices
        self.source: tuple | None = None  # (grad, weight, conv_args, input shape, dtype)

    def backward(self, ctx: Any, grad: torch.Tensor) -> tuple:
        """``MesaConv2dFunction.backward`` for the buffer's conv: its codes are ``FusedCodes``."""
        codes, weight = load(ctx)
        grad = cast(grad, ctx.compute_dtype)
        w = cast(weight, ctx.compute_dtype)
        needs = ctx.needs_input_grad
        grad_x = grad_w = grad_b = None
        if needs[1]:
            starts = [0]
            for part in codes.parts:
                starts.append(starts[-1] + part.shape[1])
            grad_w = torch.cat([
                level_weight_grad(part, codes, grad, w[:, a:b].shape, ctx.conv_args)
                for part, a, b in zip(codes.parts, starts, starts[1:])], dim=1)
            grad_w = cast(grad_w, weight.dtype)
        if needs[2]:
            grad_b = cast(grad.sum((0, 2, 3)), weight.dtype)
        if needs[0]:
            self.source = (grad, w, ctx.conv_args, ctx.input_shape, ctx.input_dtype)
            # a zero of no storage: every WriteChannels takes its own slice instead
            grad_x = grad.new_zeros((), dtype=ctx.input_dtype).expand(ctx.input_shape)
        return (grad_x, grad_w, grad_b, *[None] * (len(needs) - 3))

    def take(self, start: int, stop: int) -> torch.Tensor:
        grad, weight, conv_args, shape, dtype = self.source
        piece = torch.nn.grad.conv2d_input((shape[0], stop - start, *shape[2:]),
                                           weight[:, start:stop], grad, *conv_args)
        self.remaining -= 1
        if self.remaining == 0:
            self.source = None
        return piece.to(dtype)


def level_weight_grad(part: Packed, codes: FusedCodes, grad: torch.Tensor,
                      weight_shape: torch.Size, conv_args: tuple) -> torch.Tensor:
    """The bottleneck weight's gradient for one level's channels (fp32), from that level's codes
    decoded and upsampled (as ``FusedCodes.restore`` does) a few samples at a time."""
    slices = sample_slices(torch.Size((part.shape[0], part.shape[1], *codes.shape[2:])), 4)
    pieces = [(rows, sample_range(part, rows.start, rows.stop)) for rows in slices
              if len(slices) > 1]
    if not pieces or any(piece is None for _, piece in pieces):
        pieces = [(slice(None), part)]
    return summed(torch.nn.grad.conv2d_weight(
        codes.upsampled(unpack(piece, torch.float32)).to(grad.dtype), weight_shape,
        rows_of(grad, rows), *conv_args).float() for rows, piece in pieces)


class WriteChannels(torch.autograd.Function):
    """``buffer[:, start:start + piece.shape[1]] = piece`` in place: one step of a concatenation.

    Backward passes ``grad`` on unchanged (every other piece reads only its own slice) and gives
    ``piece`` a copy of its slice. ``copy_`` into a view would record ``CopySlices``, which clones
    the whole gradient once per piece; a view of the slice would keep the whole gradient alive
    until the last piece's backward has run (the first FPN output's, after its whole branch).
    Where the one reader of the buffer left its input gradient in ``levels`` (``LevelGradients``),
    the piece's slice is taken from there.
    """

    @staticmethod
    @returns_owned
    def forward(ctx: Any, buffer: torch.Tensor, piece: torch.Tensor, start: int,
                levels: LevelGradients | None = None) -> torch.Tensor:
        ctx.start, ctx.stop, ctx.piece_dtype = start, start + piece.shape[1], piece.dtype
        ctx.levels = levels
        buffer[:, start:ctx.stop].copy_(piece)
        ctx.mark_dirty(buffer)
        return buffer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.levels is not None and ctx.levels.source is not None:
            grad_piece = ctx.levels.take(ctx.start, ctx.stop).to(ctx.piece_dtype)
        else:
            grad_piece = grad[:, ctx.start:ctx.stop].to(ctx.piece_dtype, copy=True)
        return (grad if ctx.needs_input_grad[0] else None), grad_piece, None, None


def cat_memory_format(pieces: list[torch.Tensor]) -> torch.memory_format:
    """The layout ``torch.cat`` gives 4-d inputs: channels-last only if all of them are."""
    def channels_last(t: torch.Tensor) -> bool:
        return (t.dim() == 4 and not t.is_contiguous()
                and t.is_contiguous(memory_format=torch.channels_last))
    if all(channels_last(p) for p in pieces):
        return torch.channels_last
    return torch.contiguous_format


def concat_channels(pieces: list[torch.Tensor | None],
                    upsample: Callable[[torch.Tensor], torch.Tensor],
                    levels: LevelGradients | None = None) -> torch.Tensor:
    """``torch.cat([pieces[0], *map(upsample, pieces[1:])], dim=1)`` with only one upsampled
    piece alive at a time: each is upsampled just before it is written, last first (mmseg's
    order), into one buffer of ``pieces[0]``'s spatial size.

    ``pieces`` is emptied as it goes (its entries are the only references the caller keeps).
    Dtype, layout and values are ``torch.cat``'s: the buffer has the promoted dtype of all pieces.
    ``levels``: where the buffer's one reader leaves its input gradient (``LevelGradients``).
    """
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in pieces])
    channels = [p.shape[1] for p in pieces]
    first = pieces[0]
    buffer = torch.empty((first.shape[0], sum(channels), *first.shape[2:]), dtype=dtype,
                         device=first.device, memory_format=cat_memory_format(pieces))
    del first  # the first piece is freed once written
    starts = [sum(channels[:i]) for i in range(len(pieces))]
    for i in [0, *range(len(pieces) - 1, 0, -1)]:
        piece = pieces[i]
        pieces[i] = None
        if i:
            piece = upsample(piece)
        buffer = WriteChannels.apply(buffer, piece, starts[i], levels)
        del piece
    return buffer


@dataclass
class FusedCodes:
    """The bottleneck's input (the FPN outputs, upsampled and concatenated) saved as the codes of
    each FPN output before its upsampling.

    Three of the four pieces are bilinear upsamplings of smaller maps; their codes at the
    source resolution are 1/4, 1/16 and 1/64 of the upsampled ones, a third of the codes of the
    whole concatenation. Decoding and then
    upsampling interpolates the rounding errors, so no value is further from the exact one than
    its own codes would put it. The fields ``attached_codes`` checks are the pieces'.
    """

    parts: list[Packed]
    shape: torch.Size  # of the concatenation
    dtype: torch.dtype
    align_corners: bool

    @property
    def bits(self) -> int:
        return self.parts[0].bits

    @property
    def group_dim(self) -> int:
        return 1

    @property
    def group_size(self) -> int:
        return self.parts[0].group_size

    @property
    def backend(self) -> str:
        return self.parts[0].backend

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for part in self.parts for t in part.tensors())

    def meta(self) -> tuple:
        return tuple(part.meta() for part in self.parts), self.shape, self.dtype, self.align_corners

    @classmethod
    def rebuild(cls, tensors: tuple[torch.Tensor, ...], meta: tuple) -> FusedCodes:
        metas, *rest = meta
        parts = [Packed.rebuild(tensors[3 * i:3 * i + 3], m) for i, m in enumerate(metas)]
        return cls(parts, *rest)

    def sample_range(self, start: int, stop: int) -> FusedCodes | None:
        parts = [sample_range(part, start, stop) for part in self.parts]
        if any(part is None for part in parts):
            return None
        return dataclasses.replace(self, parts=parts,
                                   shape=torch.Size((stop - start, *self.shape[1:])))

    def upsampled(self, piece: torch.Tensor) -> torch.Tensor:
        """A decoded level at the concatenation's size, as the forward upsampled it."""
        if piece.shape[2:] == self.shape[2:]:
            return piece
        return resize(piece, size=self.shape[2:], mode='bilinear',
                      align_corners=self.align_corners)

    def restore(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        first = self.parts[0]
        out = torch.empty(self.shape, dtype=torch.float32, device=first.data.device)
        start = 0
        for part in self.parts:
            piece = self.upsampled(unpack(part, torch.float32))
            out[:, start:start + piece.shape[1]] = piece
            start += piece.shape[1]
            del piece
        return out.to(dtype or self.dtype)


def plain_conv_module(module: nn.Module) -> bool:
    """An mmcv ``ConvModule`` whose forward is the conv, norm, act steps and nothing else: no
    subclass, hooks, explicit padding or fused eval-mode conv-bn."""
    return (type(module) is ConvModule and not module.with_explicit_padding
            and module.efficient_conv_bn_eval_forward is None
            and not (module._forward_pre_hooks or module._forward_hooks
                     or module._backward_pre_hooks or module._backward_hooks))


def releasing_input(module: nn.Module, holder: list[torch.Tensor]) -> torch.Tensor:
    """``module(holder.pop())``, but a plain mmcv ``ConvModule`` drops its input once its first
    layer has run.

    A module call keeps its arguments alive until it returns, so ``fpn_bottleneck(buffer)`` holds
    the concatenation, the largest tensor of the head, through its BatchNorm and ReLU, though
    only the conv reads it. The steps are ``ConvModule.forward``'s with ``activate`` and ``norm``
    on. Anything else (a subclass, hooks on the module, explicit padding or the fused eval-mode
    conv-bn) is called as it is.
    """
    x = holder.pop()
    if not plain_conv_module(module):
        return module(x)
    for layer in module.order:
        if layer == 'conv':
            x = module.conv(x)
        elif layer == 'norm' and module.with_norm:
            x = module.norm(x)
        elif layer == 'act' and module.with_activation:
            x = module.activate(x)
    return x


class MesaUPerHead(MesaDecodeHead, UPerHead):
    """``UPerHead`` with the banded loss of ``MesaDecodeHead`` and a lean FPN fusion."""

    def mesa_setup(self, config: MesaConfig) -> None:
        super().mesa_setup(config)
        # One quantizer per FPN level, for the bottleneck input's codes (FusedCodes): its
        # conv's own config, one group per channel. Non-persistent: no state-dict keys.
        conv_config = config.for_layer('conv2d')
        self.mesa_fused_quantizers = nn.ModuleList(
            make_quantizer(conv_config, 1)
            for _ in range(len(getattr(self, 'lateral_convs', ())) + 1)
        ) if conv_config.compressor == 'mesa' else None

    def fpn_out_codes(self, fpn_outs: list[torch.Tensor | None]) -> list[Packed] | None:
        """The codes of each FPN output, when the bottleneck conv will save its input as them
        (``FusedCodes``): a converted, active conv with zero padding whose quantizer keeps what
        ours keep."""
        conv = getattr(self.fpn_bottleneck, 'conv', None)
        quantizers = self.mesa_fused_quantizers
        if (quantizers is None or not isinstance(conv, MesaConv2d) or conv.padding_mode != 'zeros'
                or not conv.mesa_active(fpn_outs[0], conv.weight)
                or not conv.weight.requires_grad
                or not isinstance(conv.quant_input, ActivationQuantizer)
                or conv.quant_input.spec != quantizers[0].spec
                or len(fpn_outs) != len(quantizers)):
            return None
        return [q.pack(p) for q, p in zip(quantizers, fpn_outs)]

    def _forward_feature(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if not self.mesa_active(*inputs):
            return super()._forward_feature(inputs)
        # The steps of UPerHead._forward_feature (mmseg 1.2.2), in its order.
        features = self._transform_inputs(inputs)
        if isinstance(inputs, FeatureList):
            inputs.release(self.in_index)  # ours now hold them, and let go of each once read
        del inputs
        laterals = []
        for i, conv in enumerate(self.lateral_convs):
            laterals.append(conv(features[i]))
            features[i] = None
        laterals.append(self.psp_forward(features))
        del features
        levels = len(laterals)
        for i in range(levels - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + resize(
                laterals[i], size=laterals[i - 1].shape[2:], mode='bilinear',
                align_corners=self.align_corners)
        fpn_outs: list[torch.Tensor | None] = []
        for i in range(levels - 1):
            fpn_outs.append(self.fpn_convs[i](laterals[i]))
            laterals[i] = None  # used only here
        fpn_outs.append(laterals.pop())
        del laterals
        upsample = functools.partial(resize, size=fpn_outs[0].shape[2:], mode='bilinear',
                                     align_corners=self.align_corners)
        parts = self.fpn_out_codes(fpn_outs)
        # the bottleneck conv hands its input gradient out level by level where it is the
        # buffer's only reader (a plain ConvModule, below) and saves it as the levels' codes
        levels = LevelGradients(len(fpn_outs)) if parts is not None and plain_conv_module(
            self.fpn_bottleneck) and self.fpn_bottleneck.conv.groups == 1 else None
        fused = [concat_channels(fpn_outs, upsample, levels)]  # the only reference: freed
        if parts is not None:
            attach_codes(fused[0], FusedCodes(parts, fused[0].shape, fused[0].dtype,
                                              bool(self.align_corners)))
        if levels is not None:
            INPUT_GRADIENT_BY_PARTS.offer(fused[0], levels)
        return releasing_input(self.fpn_bottleneck, fused)
