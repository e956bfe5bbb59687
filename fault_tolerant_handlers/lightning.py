"""Lightning adapter: ``Trainer(callbacks=[FaultTolerance()])`` maps Lightning's hooks onto a
:class:`~.core.session.Guard` (docs/lightning.md); a ``Callback`` of ``lightning.pytorch`` and of
``pytorch_lightning`` when both are installed; Lightning's private API is in :mod:`.adapters.compat_lightning`."""

from __future__ import annotations

import functools
import logging
import math
import os
import weakref
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from . import adapters
from .adapters import LiveLoop, LoopRecovery, compat_lightning as _compat_lightning
from .core import attempts, phases, recoveries
from .core.errors import HangInterrupted
from .core.failure import tag, tag_of
from .core.hooks import first_line, log
from .core.inject import Injector
from .core.session import Guard
from .data import dcp, live, snapshots
from .data.ddp_buckets import DDPBucketLayout
from .detect.autohang import CHECKPOINT, EVALUATION, START, STEP

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback as _CallbackBase
else:
    _CallbackBase = _compat_lightning.callback_base(__name__)

__all__ = ["FaultTolerance"]


def _guarded(what: str, fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - logged: the cause must reach every rank unchanged
        log(logging.WARNING, "%s failed while the job fails together (ignored, the cause is raised instead): %s: %s",
            what, type(err).__name__, first_line(err, 300))


class FaultTolerance(_CallbackBase):
    """Make a distributed Lightning run fail together: an exception on one rank makes ``trainer.fit``
    raise on every rank, the others :class:`~fault_tolerant_handlers.PeerFailedError` naming it; ranks
    blocked in a collective with it are released at once (docs/lightning.md). On one device it does
    nothing. Arguments as :class:`fault_tolerant_handlers.ignite.FaultTolerance`'s (``sync_every`` counts
    training batches; ``name`` is part of :attr:`state_key`).

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers.lightning import FaultTolerance

            trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[FaultTolerance()])
            trainer.fit(model, datamodule)   # raises on every rank if any rank raises

    .. warning::
        Give it to the ``Trainer`` of **every** rank. Wrong: ``callbacks=[FaultTolerance()] if rank == 0
        else []`` (the other ranks would not join the agreements). Correct: unconditionally.
    """

    def __init__(self, sync_every: int | None = 100, hang_timeout: timedelta | float | str | dict | None = None,
                 watchdog: bool = True, name: str = "train") -> None:
        self.guard = Guard(sync_every=sync_every, hang_timeout=hang_timeout, watchdog=watchdog, name=name)
        self.name = name
        self._batches = 0
        self._in_batch: int | None = None  # the step a training batch trains (global_step + 1), while it runs
        self._other_work = False  # the last beat began other work than a step (a checkpoint, an evaluation)
        self._buckets: DDPBucketLayout | None = None  # the DDP's bucket layout, from on_fit_start on
        self._loaded_buckets: Any = None  # the checkpoint's, until the DDP exists (on_fit_start)
        self._injector = Injector.from_env()  # FTH_INJECT: rehearse a failure without editing the job
        self._live = LightningLive()  # recovering in place: the trainer's live state (data.live)
        self._recovery = LightningRecovery()  # recovering in place: its hooks and numbers

    # -- state ---------------------------------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"batches": self._batches}
        buckets = self._buckets.buckets if self._buckets is not None else self._loaded_buckets
        if buckets is not None:
            state["ddp_buckets"] = buckets
        return state

    @override
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        batches = state_dict.get("batches", 0)  # absent in checkpoints of version 0.1
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"state_dict['batches'] must be a non-negative int, got {batches!r}")
        self._batches = batches
        self._loaded_buckets = state_dict.get("ddp_buckets")  # absent before 0.2; given to the DDP in on_fit_start

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """A state saved at an epoch's last batch (a step-interval checkpoint, live state) resumes as one saved
        at the epoch's end (:func:`.adapters.compat_lightning.finish_epoch`)."""
        if self.guard.active and _compat_lightning.finish_epoch(checkpoint.get("loops")):
            log(logging.INFO, "the checkpoint of global step %s was saved at its epoch's last batch: resumed at the "
                "epoch's end (Lightning would start the next epoch without its start)", checkpoint.get("global_step"))

    def _where(self, trainer: pl.Trainer) -> dict[str, int]:
        """Where this rank is: in a training batch the step it trains (``global_step + 1``, as Ignite counts)."""
        step = self._in_batch if self._in_batch is not None else int(trainer.global_step)
        return {"step": step, "epoch": int(trainer.current_epoch)}

    # -- hooks -------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._in_batch = None
        self.guard.start()
        if not self.guard.active:
            return  # a single device, or no process group: nothing to coordinate
        _compat_lightning.check(trainer)
        _compat_lightning.set_sampler_epochs_first(trainer.fit_loop)
        if attempts.recovering():
            self._recovery.setup(trainer)
            if _compat_lightning.keep_launched_ranks(trainer):  # the next attempt's Trainer starts no rank again
                log(logging.INFO, "recover_in_place: LOCAL_RANK set in this process, which started the other "
                    "ranks, so that the next attempt's Trainer does not start them again")
            if stage == "fit":  # live state the script did not pass as ckpt_path: loaded by fit all the same
                _compat_lightning.substitute_ckpt_path(
                    trainer, lambda path: live.substitute(path, "the trainer's fit(ckpt_path=...)"))
            # the newest checkpoint in memory for the next fit(ckpt_path=...), unless the strategy loads it itself
            strategy = trainer.strategy
            why = _compat_lightning.restores_itself(strategy)
            if not why:
                _compat_lightning.keep_checkpoints_in_memory(strategy, snapshots.keep, snapshots.take)
            else:
                log(logging.WARNING, "checkpoints are not kept in memory for a recovery in place: %s", why)
                if _compat_lightning.model_parallel(strategy):  # live state: this rank's shard, loaded here
                    _compat_lightning.keep_checkpoints_in_memory(strategy, None,
                                                                 functools.partial(_load_shards, strategy))
        # first in line on the exception path: release before any other on_exception runs a collective
        callbacks = trainer.callbacks
        if callbacks and callbacks[0] is not self and self in callbacks:
            callbacks.remove(self)
            callbacks.insert(0, self)
        if not _compat_lightning.on_exception_runs_in_rank(trainer):
            _compat_lightning.wrap_run_stage(trainer, functools.partial(self._run_stage_in_rank, trainer))
        self.guard.beat(int(trainer.global_step), START)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The DDP exists and the checkpoint is loaded: it gets the saved bucket layout before its first step."""
        model = getattr(trainer.strategy, "model", None)
        if not isinstance(model, DistributedDataParallel):
            self._buckets = None
            return
        self._buckets = DDPBucketLayout(model)
        if self._loaded_buckets is not None:
            self._buckets.load_state_dict({"buckets": self._loaded_buckets})

    def _run_stage_in_rank(self, trainer: pl.Trainer, run_stage: Callable[[], Any]) -> Any:
        """Spawned ranks: Lightning's exception path (the parent's only), checkpoint callbacks run here."""
        try:
            return run_stage()
        except (Exception, HangInterrupted) as exc:
            to_raise = self.guard.on_exception(exc, **self._where(trainer))
            for callback in list(trainer.callbacks):
                if isinstance(callback, _compat_lightning.checkpoint_types()):
                    _guarded(f"{type(callback).__name__}.on_exception", callback.on_exception, trainer,
                             trainer.lightning_module, exc)
            if to_raise is exc:
                raise
            raise to_raise from exc

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard.active and attempts.recovering():
            live.loop_starts("global step", lambda: int(trainer.global_step), None,
                             "fit(ckpt_path=...) did not load it", data=lambda: _mid_epoch_data(trainer))
            self._live.train_start(trainer)
            self._recovery.train_start(trainer)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._live.update_begins()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._in_batch = int(trainer.global_step) + 1  # taken before the optimizer step moves global_step
        if self._other_work:  # that work is over: a hang from here on is in this step, under a step's deadline
            self._other_work = False
            self.guard.beat(int(trainer.global_step), STEP)
        self._live.step_starts(int(trainer.global_step))
        self.guard.check(**self._where(trainer))  # the watchdog may already know a peer failed
        if self._injector is not None:
            self._injector.maybe_fire(trainer.global_rank, self._in_batch, trainer.current_epoch,
                                      trainer.train_dataloader)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1
        self._in_batch = None
        self._live.batch_end()
        self._recovery.batch_end(trainer, pl_module)
        self.guard.beat(int(trainer.global_step), STEP, completed=True)
        if self.guard.due(self._batches):
            self.guard.sync("training batch", **self._where(trainer))
        else:
            self.guard.check(**self._where(trainer))

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self.guard.beat(int(trainer.global_step), _evaluation(trainer), completed=True)
        self.guard.check(**self._where(trainer))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.beat(int(trainer.global_step), STEP)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.beat(int(trainer.global_step), _evaluation(trainer))

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if not self._live.capturing:
            self.guard.beat(int(trainer.global_step), CHECKPOINT)  # the file is written after this hook
            self._other_work = True

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.sync("validation end", **self._where(trainer))
        self.guard.beat(int(trainer.global_step), "after evaluation")
        self._other_work = True

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.sync("epoch end", **self._where(trainer))
        self.guard.beat(int(trainer.global_step), "epoch end")
        restarts = getattr(trainer.train_dataloader, "restart_count", None)
        if restarts is not None:  # a RestartableDataLoader: its worker restarts, as a metric (max over ranks)
            pl_module.log("dataloader_restarts", float(restarts), reduce_fx="max", sync_dist=self.guard.active)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.guard.sync("end of run", **self._where(trainer))
        self._live.close()
        self.guard.stop()  # every rank is past the last agreement

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.guard.stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if tag_of(exception).taken:
            return  # another FaultTolerance instance already finished the exception path
        in_parent = False
        if self.guard.active:
            to_raise = self.guard.on_exception(exception, **self._where(trainer))
            self._live.failed()  # the peers told first; then the state, before the teardown
            LightningRecovery.last_completed = self._recovery.completed  # what the next attempt may compute twice
        elif isinstance(exception, ProcessException):  # what torch.multiprocessing raises for a failed rank
            to_raise, in_parent = exception, True  # the parent of spawned ranks: keep the rank's error visible
        else:
            return  # a single process: stock Lightning
        if not isinstance(exception, (Exception, HangInterrupted)):
            return  # KeyboardInterrupt / SystemExit: Lightning's own path (it also stops the launcher)
        self._finish_exception_path(trainer, pl_module, exception, in_parent=in_parent)
        tag(exception, taken=True)  # once a FaultTolerance callback finished Lightning's exception path
        tag(to_raise, taken=True)
        if to_raise is exception:
            raise exception
        raise to_raise from exception

    def _finish_exception_path(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException,
                               *, in_parent: bool = False) -> None:
        callbacks = list(trainer.callbacks)
        start = callbacks.index(self) + 1 if self in callbacks else 0
        for callback in callbacks[start:]:
            if isinstance(callback, FaultTolerance):
                continue
            if in_parent and isinstance(callback, _compat_lightning.checkpoint_types()):
                log(logging.INFO, "%s.on_exception is not run in the parent of spawned ranks (it holds only the "
                    "untrained model; the ranks ran it)", type(callback).__name__)
                continue
            _guarded(f"{type(callback).__name__}.on_exception", callback.on_exception, trainer, pl_module, exception)
        for what, step in _compat_lightning.interrupt_steps(trainer, exception):
            _guarded(what, step)
        trainer.state.stage = None


def _evaluation(trainer: pl.Trainer) -> str:
    return "sanity check" if trainer.sanity_checking else EVALUATION


# -- live state --------------------------------------------------------------------------------------
class LightningLive(LiveLoop):
    """Live state (:mod:`.data.live`) of one Lightning ``Trainer``: what ``trainer.save_checkpoint`` would write."""

    unit = "global step"
    replicates = True
    trainer: Any = None
    capturing = False  #: in capture(): the on_save_checkpoint it calls writes no checkpoint

    def __init__(self) -> None:
        self._parts: tuple[list, list] = ([], [])

    def train_start(self, trainer: Any) -> None:
        self.close()
        if not live.enabled():
            return
        self.trainer, self.why_not, self.directory = trainer, "", None
        if not _compat_lightning.plain_ddp(trainer.strategy) and not _compat_lightning.model_parallel(trainer.strategy):
            self.why_not = (f"the strategy {type(trainer.strategy).__name__} builds its checkpoint with collectives "
                            "(live state: DDPStrategy and ModelParallelStrategy only)")
            log(logging.WARNING, "live state refused: %s; a recovery in place resumes from the newest checkpoint",
                self.why_not)
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath:
                self.directory = str(Path(dirpath).resolve())
                break
        self._parts = _compat_lightning.loop_parts(trainer.fit_loop)
        self._begin([trainer.lightning_module], update_at_pre_hook=False)

    def update_begins(self) -> None:
        if self.tracker is not None:
            self.tracker.update_begins()

    def batch_end(self) -> None:
        if self.tracker is not None:
            self._mark()
            self._replicate(int(self.trainer.global_step))

    def _mark(self, initial: bool = False) -> None:
        if self.why_not:
            return
        trainer = self.trainer
        small = {
            "loops": _compat_lightning.snapshot_loops(self._parts),
            "epoch": int(trainer.current_epoch),
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "param_groups": [self.hyper(optimizer) for optimizer in trainer.optimizers],
        }
        self.tracker.complete(int(trainer.global_step), small, initial=initial)

    def capture(self) -> live.Captured:
        tracker = self._tracked("the trainer was not fitting")
        small = tracker.small
        self.capturing = True
        try:
            checkpoint = _compat_lightning.dump_checkpoint(self.trainer)
        finally:
            self.capturing = False
        checkpoint["loops"]["fit_loop"] = _compat_lightning.loop_state(self._parts, small["loops"])
        checkpoint["global_step"], checkpoint["epoch"] = tracker.step, small["epoch"]
        if "lr_schedulers" in checkpoint:
            checkpoint["lr_schedulers"] = small["lr_schedulers"]
        for saved, hyper in zip(checkpoint.get("optimizer_states", []), small["param_groups"]):
            self.with_hyper(saved, hyper)
        return live.Captured(tracker.step, "global step", checkpoint, self.directory, tracker.rng_after(tracker.step))


def _load_shards(strategy: Any, path: Any) -> dict | None:
    """A ``ModelParallelStrategy``'s ``load_checkpoint`` of live state: this rank's shard loaded here."""
    checkpoint = live.take(path, [strategy.model])
    if checkpoint is not None:
        dcp.load_shards(strategy.model, strategy.optimizers, checkpoint["state_dict"], checkpoint["optimizer_states"])
    return checkpoint


# -- a recovery in place's moments, as hooks ------------------------------------------------------------
HOOKS = {recoveries.RecoveryPhase.FAILURE_SEEN: "on_failure_seen",
         recoveries.RecoveryPhase.RECOVERY_STARTED: "on_recovery_started",
         recoveries.RecoveryPhase.RECOVERED: "on_recovered"}


def dispatch(trainer: Any, hook: str, info: recoveries.RecoveryInfo) -> None:
    pl_module = getattr(trainer, "lightning_module", None)
    for callback in list(trainer.callbacks):
        method = getattr(callback, hook, None)
        if callable(method):
            method(trainer, pl_module, info)
    method = getattr(pl_module, hook, None)
    if callable(method):
        method(info)


class LightningRecovery(LoopRecovery):
    """One callback's part of a recovery in place: its hooks, and its numbers logged at the next batch."""

    loops: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
    last_completed: int | None = None
    _log_pending = False  # the recovery's numbers are logged at the next training batch's end

    def setup(self, trainer: Any) -> None:
        self.attached(trainer)
        try:  # one logger version for the whole run: a recovered attempt's loggers take the first's
            if not attempts.in_place():
                adapters.logger_versions[:] = _compat_lightning.logger_versions(trainer)
                if attempts.recovering() and trainer.global_rank == 0:  # for a replacement of any rank's process
                    adapters.publish_logger_versions()
            else:
                restored = _compat_lightning.restore_csv_metrics(trainer, adapters.kept_metrics)
                if restored:
                    log(logging.INFO, "the recovered attempt logs on in the first attempt's folder: %s",
                        "; ".join(restored))
        except Exception as err:  # noqa: BLE001 - a logger of another shape: a version of its own, as before
            log(logging.WARNING, "could not keep the first attempt's logger version: %s: %s", type(err).__name__,
                first_line(err))

    def train_start(self, trainer: Any) -> None:
        info = self.carried_on(int(trainer.global_step))
        if info is not None:
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


def _hook(info: recoveries.RecoveryInfo) -> None:
    LightningRecovery.tell_failed_loops(info, lambda trainer: dispatch(trainer, HOOKS[info.phase], info),
                                        f"{HOOKS[info.phase]} hook")


def _mid_epoch_data(trainer: pl.Trainer) -> str | None:
    """Why the fit's data does not resume at its global step (Lightning's own check: a loader without
    ``state_dict``/``load_state_dict``, inside an epoch), else ``None``."""
    batches = trainer.num_training_batches
    if not batches or batches == float("inf"):
        return None
    per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
    done = trainer.global_step % per_epoch
    plain = [loader for loader in _compat_lightning.train_loaders(trainer)
             if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)))]
    if not done or not plain:
        return None
    return (f"the data of the resumed epoch restarts from its beginning ({type(plain[0]).__name__} has no "
            f"state_dict/load_state_dict): Lightning draws its remaining {per_epoch - done} steps from the start of "
            "the epoch")
