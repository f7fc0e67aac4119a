"""The heads' upsampling of a level to a fixed size, with the backward op torch's autograd calls
for it, so that a backward which upsamples nothing itself (``layers.upsample_add``,
``layers.level_fusion``) need not rerun the upsampling on a probe to get its gradient."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from mmseg.models.utils import resize


@dataclass(frozen=True)
class Resize:
    """``mmseg.models.utils.resize(x, size, mode=mode, align_corners=align_corners)``.

    ``adjoint(grad, shape)`` is the gradient of an input of ``shape`` from ``grad``, the
    output's: for 4-d bilinear resizing by size, ``upsample_bilinear2d``'s own backward op (the
    one its autograd node calls: no scale factors, ``align_corners`` as ``F.interpolate`` reads
    it), so the result is torch's bit for bit; None for other modes (the caller's probe then
    runs the resizing).
    """

    size: tuple[int, ...]
    mode: str = 'bilinear'
    align_corners: bool | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return resize(x, size=self.size, mode=self.mode, align_corners=self.align_corners)

    def adjoint(self, grad: torch.Tensor, shape: torch.Size | tuple[int, ...]
                ) -> torch.Tensor | None:
        if self.mode != 'bilinear' or len(shape) != 4 or grad.dim() != 4:
            return None
        return torch.ops.aten.upsample_bilinear2d_backward(
            grad, [int(s) for s in self.size], [int(s) for s in shape],
            bool(self.align_corners), None, None)
