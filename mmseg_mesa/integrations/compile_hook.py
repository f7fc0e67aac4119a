"""``CompileHook``: training forwards through ``torch.compile``, with or without Mesa.

mmengine's own ``compile=True`` compiles the whole ``train_step``, optimizer step included,
which fails in AdamW's step on torch 2.14 for any model. This hook compiles only the model's
training forward (``mode='loss'``: backbone, heads and losses; the backward follows through
AOT autograd), and leaves prediction and the optimizer eager.

It compiles after the run's first training iteration, which runs eagerly: Mesa's generic path
decides there which modules stay converted (``MesaModule.mesa_probe_pending``), and a compiled
graph guards on the modules' classes, so compiling before would recompile at the second step.
A Mesa module is one op of the compiled graph (``mmseg_mesa.opaque``); everything between them
is compiled. The first compiled step takes the compile time (docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Any

import torch
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS


class CompiledLoss:
    """A segmentor's ``forward`` whose ``mode='loss'`` calls go through ``torch.compile``."""

    def __init__(self, forward: Any, options: dict[str, Any]) -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, **options)

    def __call__(self, inputs: torch.Tensor, data_samples: Any = None,
                 mode: str = 'tensor') -> Any:
        if mode == 'loss':
            return self.compiled(inputs, data_samples, mode=mode)
        return self.eager(inputs, data_samples, mode=mode)


@HOOKS.register_module()
class CompileHook(Hook):
    """Compile the model's training forward after the first training iteration of a run.

    Args:
        options: keyword arguments of ``torch.compile`` (``mode``, ``dynamic``, ``backend``,
            ``fullgraph``...). Defaults to none (inductor, its default mode).
    """

    priority = 'LOW'  # after MesaHook (VERY_HIGH) has converted the model

    def __init__(self, **options: Any) -> None:
        self.options = options
        self._first: int | None = None

    def before_train(self, runner: Any) -> None:
        self._first = runner.iter

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        if self._first is None or runner.iter != self._first:
            return
        self._first = None
        model = self._model(runner)
        model.forward = CompiledLoss(model.forward, self.options)
        runner.logger.info('CompileHook: the training forward is compiled from the next '
                           f'iteration (torch.compile options: {self.options or "defaults"})')

    def after_train(self, runner: Any) -> None:
        model = self._model(runner)
        if isinstance(model.__dict__.get('forward'), CompiledLoss):
            del model.forward

    @staticmethod
    def _model(runner: Any) -> torch.nn.Module:
        return runner.model.module if is_model_wrapper(runner.model) else runner.model
