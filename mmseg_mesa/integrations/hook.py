"""``MesaHook``: converts the model of an mmengine Runner before training starts."""
from __future__ import annotations

from typing import Any

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS

from ..config import MesaConfig
from ..convert import convert_to_mesa


@HOOKS.register_module()
class MesaHook(Hook):
    """Convert the runner's model to Mesa in ``before_run``.

    ``before_run`` comes after the model is built and wrapped (DDP) and the optimizer is built,
    and before pretrained weights are loaded and a checkpoint is resumed. Conversion swaps module
    classes in place, so Parameters (and the optimizer's references to them), buffers and
    state-dict names are untouched and both loads work unchanged.

    Args:
        mesa: ``True``, a ``dict`` of ``MesaConfig`` fields, or None to read ``cfg.mesa`` from
            the runner's config. Defaults to None.
    """

    priority = 'VERY_HIGH'

    def __init__(self, mesa: bool | dict[str, Any] | None = None) -> None:
        # Validate now, so a bad key fails while the runner is built, not after data loading.
        self._explicit = mesa is not None
        self.config = MesaConfig.from_cfg(mesa) if mesa is not None else None
        self.report = None

    def before_run(self, runner: Any) -> None:
        config = self.config if self._explicit else MesaConfig.from_cfg(runner.cfg.get('mesa'))
        if config is None:
            runner.logger.info('Mesa: disabled (mesa is not set in the config)')
            return
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        # The quantizers' running estimates (non-persistent buffers) appear after DDP wrapped
        # the model, so DDP never broadcasts them and each rank keeps estimates of its own
        # batches. That is intended: they only set the range a rank quantizes its own saved
        # activations over. Parameters stay identical across ranks because DDP all-reduces the
        # gradients (tests/test_sync_batchnorm.py checks it); syncing the estimates would cost
        # a collective per layer and step for nothing.
        self.report = convert_to_mesa(model, config=config)
        runner.logger.info(f'Mesa ({config}):\n{self.report.format()}')
