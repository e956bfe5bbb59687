"""Ignite: live state (:mod:`..data.live`) from what the trainer's ``Checkpoint`` handler saves.

Attached by :class:`~fault_tolerant_handlers.ignite.FaultTolerance` while a recovery in place runs.
At ``STARTED`` it finds the ``Checkpoint`` handlers attached to the engine and their ``to_save``.
After a recovery, its first ``STARTED`` handler (before any other, after the script loaded what it
loads) restores the live state the ranks agreed on into that ``to_save``, unless the script loaded it
itself (``latest_checkpoint`` named it): whatever folder the script names, a folder made anew at each
call or known to rank 0 only (:func:`..data.live.loop_starts` tells what the run carries on from).
Then, every iteration:

* ``ITERATION_STARTED`` (first handler): torch's RNG as the iteration starts (and, in the first
  iteration after live state was loaded, put back as the failed attempt had it there);
* ``ITERATION_COMPLETED`` (last handler, after the checkpoint's): the iteration completed; the
  ``state_dict()`` of each small object of ``to_save`` (the engine, the loader or its sampler,
  schedulers, anything but modules, optimizers, ``DDPBucketLayout`` and ``GradScaler``) and the
  optimizers' hyper-parameters, as the checkpoint would have saved them then;
* ``EXCEPTION_RAISED``: the capture, the dict the checkpoint would hold as of the last completed
  iteration (the modules' and optimizers' ``state_dict()`` as they are: no update ran since).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..core import sharded
from ..core.log import log
from ..data import live
from ..data.dcp import ShardedState
from ..data.ddp_buckets import DDPBucketLayout
from . import compat_ignite as _compat_ignite

#: Objects of ``to_save`` whose state only an optimizer update changes: taken at the failure.
_BIG = (torch.nn.Module, torch.optim.Optimizer, DDPBucketLayout, torch.amp.GradScaler)


def _unwrap(obj: Any) -> Any:
    return obj.module if isinstance(obj, (torch.nn.DataParallel, DistributedDataParallel)) else obj


class IgniteLive:
    """Live state of one Ignite trainer (see the module's text)."""

    def __init__(self) -> None:
        self.to_save: dict[str, Any] = {}
        self.directory: str | None = None
        self.tracker: live.StepTracker | None = None
        self.why_not = ""

    def attach(self, engine: Any) -> None:
        from ignite.engine import Events

        _compat_ignite.prepend(engine, Events.STARTED, self._restore)
        _compat_ignite.prepend(engine, Events.ITERATION_STARTED, self._iteration_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        engine.add_event_handler(Events.STARTED, self._started)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    # -- events ---------------------------------------------------------------------------------------
    def _find(self, engine: Any) -> None:
        """The ``to_save`` of the ``Checkpoint`` handlers attached to ``engine`` (the first handler's
        object for a key that several save), their folder, or why there is nothing to capture."""
        from ignite.handlers import Checkpoint

        checkpoints = [h for h in _compat_ignite.attached_handlers(engine) if isinstance(h, Checkpoint)]
        self.to_save, self.directory, self.why_not = {}, None, ""
        for handler in checkpoints:
            for key, obj in (handler.to_save or {}).items():
                self.to_save.setdefault(key, obj)
            dirname = getattr(handler.save_handler, "dirname", None)
            if dirname is not None and self.directory is None:
                self.directory = str(Path(dirname).resolve())
        if not checkpoints:
            self.why_not = "no ignite Checkpoint handler is attached to the trainer: nothing says what to capture"
        elif any(not callable(getattr(obj, "state_dict", None)) for obj in self.to_save.values()):
            self.why_not = "the Checkpoint's to_save holds objects without state_dict (nested containers)"

    def _restore(self, engine: Any) -> None:
        """The first ``STARTED`` handler: live state the script did not load goes into ``to_save``."""
        from ignite.handlers import Checkpoint

        self._find(engine)
        to_save, why = dict(self.to_save), self.why_not

        def restore(state: Any) -> str:
            to_load = {key: obj for key, obj in to_save.items() if key in state}
            Checkpoint.load_objects(to_load=to_load, checkpoint=state)
            left = sorted(set(to_save) - set(to_load))
            return (f"the trainer's Checkpoint objects ({', '.join(to_load)})"
                    + (f"; not in the live state: {', '.join(left)}" if left else ""))

        live.loop_starts("iteration", lambda: int(engine.state.iteration), None if why else restore, why)

    def _started(self, engine: Any) -> None:
        from ignite.engine import Events

        self._close()
        if not live.enabled():
            return
        _compat_ignite.append_last(engine, Events.ITERATION_COMPLETED, self._iteration_completed)
        self._find(engine)
        modules = [_unwrap(o) for o in self.to_save.values() if isinstance(o, torch.nn.Module)]
        shards = [f"to_save[{key!r}] is a {type(obj).__name__}" for key, obj in self.to_save.items()
                  if isinstance(obj, ShardedState)]
        shards += [f"{why}" for why in map(sharded.in_module, modules) if why]
        if shards:  # shards in the peers' memory: not served (a recovery resumes from the newest checkpoint)
            self.why_not = f"the model is sharded ({shards[0]}): live state carries replicated models only"
            log(logging.WARNING, "live state refused: %s; a recovery in place resumes from the newest checkpoint",
                self.why_not)
        self.tracker = live.StepTracker(modules, update_at_pre_hook=True)
        self._mark(engine, initial=True)
        live.register(self.capture)

    def _iteration_started(self, engine: Any) -> None:
        if self.tracker is not None:
            live.restore_rng(engine.state.iteration - 1)
            self.tracker.start_step(engine.state.iteration - 1)

    def _iteration_completed(self, engine: Any) -> None:
        if self.tracker is not None:
            self._mark(engine)

    def _completed(self, engine: Any) -> None:
        self._close()

    def failed(self) -> None:
        """``EXCEPTION_RAISED``: capture now (see :func:`..data.live.capture_now`)."""
        if self.tracker is not None:
            live.capture_now(self.capture)

    def _close(self) -> None:
        live.unregister(self.capture)
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    # -- state ----------------------------------------------------------------------------------------
    def _mark(self, engine: Any, initial: bool = False) -> None:
        if self.why_not:
            return
        small: dict[str, Any] = {}
        for key, obj in self.to_save.items():
            if isinstance(obj, torch.optim.Optimizer):
                small[key] = [{k: v for k, v in group.items() if k != "params"} for group in obj.param_groups]
            elif not isinstance(obj, _BIG):
                small[key] = obj.state_dict()
        self.tracker.complete(engine.state.iteration, small, initial=initial)

    def capture(self) -> live.Captured:
        tracker = self.tracker
        if tracker is None:
            raise live.NotLive("the trainer was not running")
        if self.why_not:
            raise live.NotLive(self.why_not)
        tracker.check("iteration")
        state: dict[str, Any] = {}
        for key, obj in self.to_save.items():
            if isinstance(obj, torch.optim.Optimizer):
                saved = obj.state_dict()
                saved["param_groups"] = [{**group, **hyper} for group, hyper in zip(saved["param_groups"], tracker.small[key])]
                state[key] = saved
            elif isinstance(obj, _BIG):
                state[key] = _unwrap(obj).state_dict()
            else:
                state[key] = tracker.small[key]
        return live.Captured(tracker.step, "iteration", state, self.directory, tracker.rng_after(tracker.step))
