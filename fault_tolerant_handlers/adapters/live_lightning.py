"""Lightning: live state (:mod:`..data.live`) from what ``trainer.save_checkpoint`` would write.

Driven by :class:`~fault_tolerant_handlers.lightning.FaultTolerance` (the first callback) while a
recovery in place runs:

* ``on_train_start``: the loops are set up; the state the loop starts from is the first mark;
* ``on_train_batch_start``: torch's RNG as the batch starts (and, in the first batch after live
  state was loaded, put back as the failed attempt had it there);
* ``on_before_optimizer_step``: the optimizer's update begins (the training step and backward ran
  inside ``optimizer.step``'s closure before this; a failure there leaves the state trusted);
* ``on_train_batch_end``: the batch completed: the loops' state (progress, the loader's position),
  the global step and epoch, the LR schedulers and the optimizers' hyper-parameters, as a
  ``ModelCheckpoint`` saving in this hook would hold them;
* ``on_exception``: the capture: ``dump_checkpoint`` (model, optimizers, callbacks, as they are: no
  update ran since the mark), with the marked parts put in.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..core import sharded
from ..core.log import log
from ..data import live
from . import compat_lightning as _compat_lightning


class LightningLive:
    """Live state of one Lightning ``Trainer`` (see the module's text)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.tracker: live.StepTracker | None = None
        self.directory: str | None = None
        self.why_not = ""
        self._parts: tuple[list, list] = ([], [])

    def train_start(self, trainer: Any) -> None:
        self.close()
        if not live.enabled():
            return
        self.trainer, self.why_not, self.directory = trainer, "", None
        if not _compat_lightning.plain_ddp(trainer.strategy):
            self.why_not = (f"the strategy {type(trainer.strategy).__name__} builds its checkpoint with collectives "
                            "(live state: DDPStrategy only)")
            found = sharded.in_module(trainer.lightning_module)
            if found:  # shards in the peers' memory: not served (a recovery resumes from the newest checkpoint)
                self.why_not = f"{self.why_not}; the model is sharded ({found})"
            log(logging.WARNING, "live state refused: %s; a recovery in place resumes from the newest checkpoint",
                self.why_not)
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath:
                self.directory = str(Path(dirpath).resolve())
                break
        self._parts = _compat_lightning.loop_parts(trainer.fit_loop)
        self.tracker = live.StepTracker([trainer.lightning_module], update_at_pre_hook=False)
        self._mark(initial=True)
        live.register(self.capture)

    def batch_start(self, trainer: Any) -> None:
        if self.tracker is not None:
            step = int(trainer.global_step)
            live.restore_rng(step)
            self.tracker.start_step(step)

    def update_begins(self) -> None:
        if self.tracker is not None:
            self.tracker.update_begins()

    def batch_end(self) -> None:
        if self.tracker is not None:
            self._mark()

    def failed(self) -> None:
        if self.tracker is not None:
            live.capture_now(self.capture)

    def close(self) -> None:
        live.unregister(self.capture)
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def _mark(self, initial: bool = False) -> None:
        if self.why_not:
            return
        trainer = self.trainer
        small = {
            "loops": _compat_lightning.snapshot_loops(self._parts),
            "epoch": int(trainer.current_epoch),
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "param_groups": [[{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
                             for optimizer in trainer.optimizers],
        }
        self.tracker.complete(int(trainer.global_step), small, initial=initial)

    def capture(self) -> live.Captured:
        tracker = self.tracker
        if tracker is None:
            raise live.NotLive("the trainer was not fitting")
        if self.why_not:
            raise live.NotLive(self.why_not)
        tracker.check("global step")
        small = tracker.small
        checkpoint = _compat_lightning.dump_checkpoint(self.trainer)
        checkpoint["loops"]["fit_loop"] = _compat_lightning.loop_state(self._parts, small["loops"])
        checkpoint["global_step"], checkpoint["epoch"] = tracker.step, small["epoch"]
        if "lr_schedulers" in checkpoint:
            checkpoint["lr_schedulers"] = small["lr_schedulers"]
        for saved, hyper in zip(checkpoint.get("optimizer_states", []), small["param_groups"]):
            if isinstance(saved, dict) and isinstance(saved.get("param_groups"), list):
                saved["param_groups"] = [{**group, **h} for group, h in zip(saved["param_groups"], hyper)]
        return live.Captured(tracker.step, "global step", checkpoint, self.directory, tracker.rng_after(tracker.step))
