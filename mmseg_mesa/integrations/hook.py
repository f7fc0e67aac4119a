"""``MesaHook``: converts the model of an mmengine Runner before training starts, and keeps
Mesa's training state in its checkpoints."""
from __future__ import annotations

import contextlib
from typing import Any

from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS

from ..calibration import CalibrationReport, agree_across_ranks, calibrate, first_images
from ..config import Calibration, MesaConfig
from ..convert import convert_to_mesa
from ..selfcheck import verify_first_use
from ..training_state import restore_training_state, training_state

# The checkpoint's top-level key of Mesa's training state; ``state_dict`` stays plain mmseg's.
CHECKPOINT_KEY = 'mesa'


@HOOKS.register_module()
class MesaHook(Hook):
    """Convert the runner's model to Mesa in ``before_run``; save and restore Mesa's training
    state (``mmseg_mesa.training_state``: running estimates, rounding streams) with checkpoints.

    ``before_run`` comes after the model is built and wrapped (DDP) and the optimizer is built,
    and before pretrained weights are loaded and a checkpoint is resumed. Conversion swaps module
    classes in place, so Parameters (and the optimizer's references to them), buffers and
    state-dict names are untouched and both loads work unchanged.

    Checkpoints keep the state under their top-level ``'mesa'`` key, so a resumed run continues
    as the uninterrupted one would (with the step's own random streams off, bit for bit), while
    ``state_dict`` keeps plain mmseg's keys and plain mmseg ignores the extra key. A checkpoint
    without it (plain mmseg's, or an older one) loads as before: the estimates start from the
    next batch. Under DDP only rank 0 saves, so every rank resumes with rank 0's estimates.

    At the first training iteration (``before_train_iter`` of a run that starts rather than
    resumes), where ``MesaConfig.calibrate`` is set, the layers whose 8-bit codes move the
    gradient too far are chosen on ``calibrate.batch`` images of that iteration's batch
    (``mmseg_mesa.calibration``) and keep refined codes from then on; the report is logged, the
    iteration itself then runs as it would have. The choice is part of the training state, so a
    resumed run keeps it; under DDP a layer is refined where any rank chose it.

    In ``before_train`` on a GPU, the CUDA kernels that will code the activations are held to
    the pure-PyTorch reference once per process and device (``selfcheck.verify_first_use``, a
    fraction of a second): kernels that disagree there would otherwise train on wrong codes
    without an error. A disagreement raises, naming the ops and ``mesa = dict(backend='torch')``.

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
        self._backend = 'auto'  # the converted model's ``MesaConfig.backend``
        self._calibration: Calibration | None = None  # until it has run (or was restored)
        self.calibration: CalibrationReport | None = None

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
        self._backend = config.backend
        self._calibration = config.calibrate
        runner.logger.info(f'Mesa ({config}):\n{self.report.format()}')

    def before_train(self, runner: Any) -> None:
        model = self._converted_model(runner)
        parameter = next(model.parameters(), None) if model is not None else None
        if parameter is None:
            return
        checks = verify_first_use(parameter.device, self._backend)
        if checks:
            runner.logger.info(f'Mesa: the {checks[0].backend} agree with the reference on '
                               f'{checks[0].device} ({len(checks)} ops)')

    def before_train_iter(self, runner: Any, batch_idx: int,
                          data_batch: dict | tuple | list | None = None) -> None:
        bounds, self._calibration = self._calibration, None
        model = self._converted_model(runner)
        if bounds is None or model is None or data_batch is None or runner.iter != 0:
            return
        batch = first_images(data_batch, bounds.batch)
        optim_wrapper = getattr(runner, 'optim_wrapper', None)

        def step() -> Any:
            context = (optim_wrapper.optim_context(model) if optim_wrapper is not None
                       else contextlib.nullcontext())
            with context:
                data = model.data_preprocessor(batch, True)
                loss, _ = model.parse_losses(model(**data, mode='loss'))
            return loss

        self.calibration = calibrate(model, step, bounds)
        agree_across_ranks(model)
        runner.logger.info(f'Mesa: {self.calibration.format()}')

    def _converted_model(self, runner: Any) -> Any:
        if self.report is None:  # Mesa is off in this run
            return None
        return runner.model.module if is_model_wrapper(runner.model) else runner.model

    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        model = self._converted_model(runner)
        if model is not None:
            checkpoint[CHECKPOINT_KEY] = training_state(model)

    def after_load_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        model = self._converted_model(runner)
        if model is None:
            return
        if CHECKPOINT_KEY not in checkpoint:
            runner.logger.info('Mesa: the checkpoint has no Mesa training state; the running '
                               'estimates start from the next batch')
            return
        self._calibration = None  # the checkpoint keeps the choice
        report = restore_training_state(model, checkpoint[CHECKPOINT_KEY])
        runner.logger.info(f'Mesa: {report.format()}')
