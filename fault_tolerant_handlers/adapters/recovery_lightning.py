"""Lightning: a recovery in place's moments (:mod:`..core.recoveries`) as hooks, and its numbers logged.

Lightning runs a hook by its name on every callback that has it (and, for the model's hooks, on the
``LightningModule``); the :class:`~fault_tolerant_handlers.lightning.FaultTolerance` callback does the
same for three hooks of its own, so that any callback (no base class to inherit, either namespace)
or the module can take them:

=========================  =================================================  ========================
hook                       when                                               on the module
=========================  =================================================  ========================
``on_failure_seen``        the failure reached this rank's recovery (the      ``on_failure_seen(info)``
                           failed attempt's trainer; the recovery runs)
``on_recovery_started``    the ranks agreed to recover (the failed            ``on_recovery_started(info)``
                           attempt's trainer)
``on_recovered``           the next attempt's ``on_train_start``: the         ``on_recovered(info)``
                           checkpoint or live state is loaded, the step it
                           carries on from is its global step
=========================  =================================================  ========================

A callback's hook is called ``hook(trainer, pl_module, info)``, with ``info`` a
:class:`~..core.recoveries.RecoveryInfo`. An exception in the first two is logged, never passed on
(the recovery must go on); in ``on_recovered`` it fails the run, as in any hook. At the end of the
first training batch after a recovery the callback logs ``fault_tolerance/recoveries``,
``fault_tolerance/time_to_recover`` and ``fault_tolerance/steps_computed_twice`` to every logger of
the trainer (``logger.log_metrics``, at that step: not held back to ``log_every_n_steps``) and into
``trainer.callback_metrics`` (put there directly: :func:`.compat_lightning.put_callback_metrics`).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

from ..core import attempts, hooks, phases, recoveries
from ..core.log import log
from . import compat_lightning as _compat_lightning

#: The hooks, by the moment they tell.
HOOKS = {recoveries.RecoveryPhase.FAILURE_SEEN: "on_failure_seen",
         recoveries.RecoveryPhase.RECOVERY_STARTED: "on_recovery_started",
         recoveries.RecoveryPhase.RECOVERED: "on_recovered"}

#: The trainers the callback was set up in, with the recovery attempt they were set up in.
_trainers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
#: The failed attempt's last completed global step (set at its ``on_exception``).
_last_completed: int | None = None
#: The first attempt's loggers' ``(class, root folder, version, folder)`` (:func:`.compat_lightning.logger_versions`),
#: while a recovery in place runs.
_logger_versions: list = []
#: A CSV logger's ``metrics.csv`` as the failed attempt left it, by folder (read at the teardown).
_kept_metrics: dict[str, bytes] = {}


def _pinned_version(logger: Any) -> Any:
    """The first attempt's version for a logger of the same class and root folder (``None``: none)."""
    for cls, root, version, _ in _logger_versions:
        if type(logger) is cls and str(getattr(logger, "root_dir", "")) == root:
            return version
    return None


def _keep_logger_versions(state: phases.RecoveryState) -> None:
    """``RESET_FRAMEWORKS``: the next attempt's loggers take the first attempt's versions; a CSV
    logger's rows are read now (its writer deletes the file when the next attempt opens the folder)."""
    if not _logger_versions:
        return
    _compat_lightning.pin_next_versions({cls for cls, *_ in _logger_versions}, _pinned_version)
    for *_, folder in _logger_versions:
        path = os.path.join(folder, "metrics.csv")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                _kept_metrics[folder] = f.read()


def _forget_logger_versions(state: phases.RecoveryState) -> None:
    """``END``: loggers made after the recovery take the next free version again."""
    _logger_versions.clear()
    _kept_metrics.clear()


def dispatch(trainer: Any, hook: str, info: recoveries.RecoveryInfo) -> None:
    """Call ``hook`` on every callback of ``trainer`` that has it, then on its LightningModule."""
    pl_module = getattr(trainer, "lightning_module", None)
    for callback in list(trainer.callbacks):
        method = getattr(callback, hook, None)
        if callable(method):
            method(trainer, pl_module, info)
    method = getattr(pl_module, hook, None)
    if callable(method):
        method(info)


class LightningRecovery:
    """One ``FaultTolerance`` callback's part (see the module's text)."""

    def __init__(self) -> None:
        self.completed: int | None = None
        self._log_pending = False

    def setup(self, trainer: Any) -> None:
        _trainers[trainer] = attempts.in_place()
        # One logger version for the whole run: the first attempt's loggers' versions are recorded; a
        # recovered attempt's loggers take them (a new Trainer's would take the next free version_N).
        try:
            if not attempts.in_place():
                _logger_versions[:] = _compat_lightning.logger_versions(trainer)
            else:
                restored = _compat_lightning.restore_csv_metrics(trainer, _kept_metrics)
                if restored:
                    log(logging.INFO, "the recovered attempt logs on in the first attempt's folder: %s",
                        "; ".join(restored))
        except Exception as err:  # noqa: BLE001 - a logger of another shape: a version of its own, as before
            log(logging.WARNING, "could not keep the first attempt's logger version: %s: %s", type(err).__name__,
                (str(err).splitlines() or [""])[0][:200])

    def train_start(self, trainer: Any) -> None:
        global _last_completed
        info = recoveries.carried_on(int(trainer.global_step), _last_completed)
        if info is None:
            return
        _last_completed = None
        self._log_pending = True
        dispatch(trainer, HOOKS[info.phase], info)

    def batch_end(self, trainer: Any, pl_module: Any) -> None:
        self.completed = int(trainer.global_step)
        if not self._log_pending:
            return
        self._log_pending = False
        values = recoveries.metrics().as_dict()
        if not _compat_lightning.put_callback_metrics(trainer, values):
            for name, value in values.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, logger=False, sync_dist=False)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=int(trainer.global_step))

    def failed(self) -> None:
        """``on_exception``: what this loop completed is what the next attempt may compute twice."""
        global _last_completed
        _last_completed = self.completed


def _hook(info: recoveries.RecoveryInfo) -> None:
    for trainer, attempt in list(_trainers.items()):
        if attempt != info.attempt - 1:  # only the failed attempt's trainers
            continue
        try:
            dispatch(trainer, HOOKS[info.phase], info)
        except Exception as err:  # noqa: BLE001 - a hook must not stop the recovery (nor the other trainers)
            log(logging.WARNING, "a %s hook failed: %s: %s", HOOKS[info.phase], type(err).__name__,
                (str(err).splitlines() or [""])[0][:200])


hooks.add(hooks.FAILURE_SEEN, _hook)
hooks.add(hooks.RECOVERY_STARTED, _hook)
hooks.add(hooks.RESET_FRAMEWORKS, _keep_logger_versions, tolerate=True)
hooks.add(hooks.END, _forget_logger_versions, tolerate=True)
