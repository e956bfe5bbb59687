"""Recover in place (``docs/recovering.md``): when the training function raises on every rank, each
rank records the failure, agrees on the first attempt's store (:mod:`.agree`) whether the job recovers
and from which state (:mod:`.live_state`), tears the attempt down, re-forms the group over the same
store under a new namespace and calls the function again, in the same process. A dead rank's process
is replaced by its keeper (:mod:`.keeper`), a lost one by a spare (:mod:`.spares`); a hung rank is
interrupted in its main thread (:mod:`..core.interrupts`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp

from ..core import attempts, compat_torch as _compat_torch, config, hooks, interrupts, recoveries
from ..core.config import RECOVER_TEARDOWN_SEC
from ..core.errors import RecoveryError
from ..core.failure import FailureRecord, PeerFailedError, cap_head, tag_of
from ..core.hooks import log
from ..core.phases import LIVE_NAME, RecoveryState
from ..core.recoveries import RecoveryInfo, RecoveryPhase
from ..core.session import live_sessions
from . import agree, keeper, live_state, spares
from .agree import AsIs, Decision, Misplaced, Unsafe, cause_of
from .live_state import LivePlan, LiveReport
from .spares import check_spares

T = TypeVar("T")

#: The signal that interrupts a hung rank's main thread (real-time: no launcher or framework uses it).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None


def _fresh(value: Any, depth: int = 0) -> Any:
    """``value`` with its plain containers copied (``dict``, ``list``, ``tuple``, ``set``,
    ``argparse.Namespace``: a config), anything else the same object (a dataset is not copied). Each
    attempt gets such a copy of the arguments as first given: Ignite's cifar10 example sets
    ``config["output_path"]`` to the folder it made, and the next attempt made its folder inside it."""
    kind = type(value)
    if depth > 32:  # a container that holds itself: as it is
        return value
    if kind is dict:
        return {k: _fresh(v, depth + 1) for k, v in value.items()}
    if kind in (list, tuple, set):
        return kind(_fresh(v, depth + 1) for v in value)
    if kind is argparse.Namespace:
        return argparse.Namespace(**_fresh(vars(value), depth + 1))
    return value


def recovery_attempt() -> int:
    """How many times this process recovered in place so far: 0 in the first call of the training
    function, 1 in the call after the first recovery, ... (torchrun's restarts not counted: its
    ``TORCHELASTIC_RESTART_COUNT`` tells those)."""
    return attempts.in_place()


class _Recovery:
    def __init__(self, fn: Callable[..., T], max_restarts: int, join_timeout: timedelta,
                 replace_dead: bool = False, spares: int = 0) -> None:
        self.fn, self.max_restarts, self.join_timeout, self.replace_dead, self.spares = (
            fn, max_restarts, join_timeout, replace_dead, spares)
        self.layout: spares.Layout | None = None  # with spares: this process's place in the launched world
        self._order: spares.Order | None = None  # a spare's order to take a lost rank's place
        self._failure_wall = 0.0  # when the failure reached this rank (wall clock: a spare's log line)
        self.on_attempt: Callable[[int], None] | None = None  # told each attempt's number (a keeper's child)
        self.causes: list[FailureRecord] = []  # the primary cause of each failed attempt
        self._left = threading.Event()  # the main thread reached the recovery
        self._sessions: list = []  # the failed attempt's sessions, stopped, to abandon
        self.live = live_state.Held(self._state)
        self._joined: tuple[Any, int, int] | None = None  # a keeper's replacement: the store it joined over
        self.backend: str | None = None  # the first attempt's group's, and its store's timeout
        self.timeout: timedelta | None = None
        self.given: tuple[Any, int, int, str, timedelta] | None = None  # the group existed before: its world

    # -- the world the attempts share ------------------------------------------------------------------
    def _world(self) -> tuple[Any, int, int, str, timedelta] | None:
        """``(store, rank, world_size, backend, timeout)`` of the first attempt's group."""
        if self.given is not None:
            return self.given
        provider = hooks.provider(hooks.WORLD)  # the launchers know the first rendezvous's
        first = self._joined or (None if provider is None else provider())
        if first is None:
            return None
        store, rank, world = first
        return _compat_torch.store_chain(store)[-1], rank, world, self.backend or "gloo", self.timeout or store.timeout

    def _state(self, **changes: Any) -> RecoveryState:
        """The recovery as its phases' steps see it (:mod:`..core.phases`)."""
        world = self._world()
        fields: dict[str, Any] = {"attempt": attempts.in_place(), "cause": self.causes[-1] if self.causes else None,
                                  "plan": self.live.plan}
        if world is not None:
            fields.update(store=world[0], rank=world[1], world_size=world[2])
        return RecoveryState(**{**fields, **changes})

    def _note_group(self) -> None:
        """Remember the current default group's backend and timeout (for the rendezvous's store)."""
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                self.backend = str(dist.get_backend())
                self.timeout = _compat_torch.default_store().timeout

    # -- the loop --------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> T:
        if dist.is_available() and dist.is_initialized():  # the group exists: re-made here after a failure
            self._note_group()
            self.given = (_compat_torch.store_chain(_compat_torch.default_store())[-1], dist.get_rank(),
                          dist.get_world_size(), self.backend or "gloo", self.timeout)
        if self.spares:
            if self.given is not None:
                raise RecoveryError(f"recover_in_place(spares={self.spares}) must be called before "
                                    "init_process_group: the training world's group is made inside the training "
                                    "function (the launched world, spares included, never forms one)")
            self.layout = spares.layout(self.spares)
            if self.layout.is_spare:
                served = spares.serve(self.layout, self.join_timeout)
                if served is None:
                    return None
                order, cause = served  # it takes the seat under a keeper of its own, as every training rank
                if self.replace_dead and keeper.why_not(self) is None:
                    return keeper.Keeper(self).run(args, kwargs, replacement=cause, order=order)
                return self.run(args, kwargs, replacement=cause, order=order)
            spares.enter_training_world(self.layout)
        if self.replace_dead:
            return keeper.run(self, args, kwargs)
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict, replacement: FailureRecord | None = None,
            order: spares.Order | None = None) -> T:
        """The attempts, in this process; a ``replacement`` (a keeper's new child, a spare with its ``order``)
        first joins the recovery its peers wait in."""
        self._order = order
        hooks.run(hooks.BEGIN, RecoveryState(attempt=attempts.in_place()))
        recoveries.forget()  # recovery_history(): this recovery's moments only
        running = attempts.enter_recovery()
        interrupter = self._install_interrupter()
        frozen_by_caller = gc.get_freeze_count() > 0
        try:
            if replacement is not None:
                self._reform(self._join_as_replacement(replacement))
                if self._order is not None:
                    spares.log_takeover(self.layout, self._order, time.time())
            elif self.layout is not None and self._joined is None:
                # a training rank's first attempt, with spares: the store the attempts share is torchrun's
                lay = self.layout
                self._joined = (spares.take_own_seat(lay, self.join_timeout), lay.launched_rank, lay.training_world)
                hooks.run(hooks.RE_FORM, self._state())  # the launchers: init_process_group is given this world
            given = _fresh((args, kwargs))  # the arguments as called: an attempt's changes to its own do not carry over
            while True:
                started = time.monotonic()
                gc.freeze()  # the teardown's collection visits only what the attempt made (0.6 s -> 0.01 s)
                interrupts.arm()  # a hang of this attempt is interrupted again (take() stopped them)
                try:
                    result = self.fn(*args, **kwargs)
                    world = self._world() if self.layout is not None else None
                    if world is not None and world[1] == 0:
                        spares.tell_end(world[0], self.layout, True, "the training ended")
                    return result
                except BaseException as err:  # noqa: BLE001 - decided below; re-raised unless recovered
                    interrupts.take()  # first: from here on no signal raises the interrupt
                    self._left.set()
                    decision, timings = self._failed(err, started)
                    if not decision.restart:
                        world = self._world() if self.layout is not None else None
                        if world is not None:
                            spares.tell_end(world[0], self.layout, False, decision.why)
                        if isinstance(decision, AsIs):
                            raise
                        if isinstance(decision, Misplaced) or (attempts.in_place() and isinstance(decision, Unsafe)):
                            raise RecoveryError(decision.why) from err
                        self._add_note(err, decision)
                        raise
                # Outside the except block: the failed attempt's frames (and its loaders) are free.
                self._teardown(timings)
                self._reform(timings)
                args, kwargs = _fresh(given)
        finally:
            sessions, self._sessions = self._sessions, []
            for session in sessions:  # not abandoned: the liveness helpers a recovery kept, stopped on every way out
                session.stop()
            if not frozen_by_caller:
                gc.unfreeze()
            self._restore_interrupter(interrupter)
            attempts.leave_recovery(running)
            # the launchers forget the first rendezvous; the data layer its snapshots and live state
            hooks.run(hooks.END, RecoveryState(attempt=attempts.in_place()))

    def _join_as_replacement(self, cause: FailureRecord) -> dict:
        """A keeper's new child (or a spare): join the recovery its peers wait in, over torchrun's store."""
        t0 = time.monotonic()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = attempts.agent_store(self.join_timeout)
        self._joined = (store, rank, world_size)
        if self.layout is not None:
            spares.write_seat(store, rank, self.layout.launched_rank)
        decision = self._agree(self._world(), cause)
        if not decision.restart:
            raise RecoveryError(f"the replacement of rank {rank}'s process could not join the recovery: {decision.why}")
        self.causes.append(decision.cause or cause)
        self.live.settle(decision.restart, decision.live, rank, world_size)
        self._announce(RecoveryPhase.FAILURE_SEEN, rank, cause, t0)
        self._announce(RecoveryPhase.RECOVERY_STARTED, rank, self.causes[-1], t0)
        now = time.monotonic()
        return {"detected": t0, "stopped": t0, "agreed": now, "torn_down": now}

    def _failed(self, err: BaseException, started: float) -> tuple[Decision, dict]:
        t0 = time.monotonic()
        self._failure_wall = time.time()
        self._note_group()
        world = self._world()
        sessions = live_sessions()
        rank = world[1] if world is not None else (dist.get_rank() if dist.is_initialized() else 0)
        cause = cause_of(err, rank, [session.failure for session in sessions])
        # what the process that spawned the ranks gets when one failed
        if world is None and isinstance(err, (mp.ProcessRaisedException, mp.ProcessExitedException)):
            return Misplaced(False, (
                "recover_in_place wraps a function that spawned the ranks (idist.Parallel(nproc_per_node=...), "
                "Lightning strategy='ddp_spawn' or 'ddp_fork', torch.multiprocessing.spawn): a rank failed "
                f"({type(err).__name__}), and its process is gone, so nothing can be recovered in place. Wrap the "
                "function each rank runs instead: with idist.Parallel(...) as p: p.run(recover_in_place(training, "
                "max_restarts=N), cfg); with Lightning, strategy='ddp' or torchrun")), {}
        if world is None and not sessions and not isinstance(err, PeerFailedError):  # the job's own error, unchanged
            return AsIs(False, "it was raised before any process group existed"), {}
        if world is None:
            return Unsafe(False, "recover_in_place found no process group store to recover over (the group "
                                 "was made with init_process_group(store=...))"), {}
        if attempts.in_place() and not sessions and not isinstance(err, PeerFailedError) \
                and tag_of(err).record is None:
            live_hint = (". It read the name latest_checkpoint gave for the live state as a file: load it with "
                         "load_checkpoint(path), Checkpoint.load_objects(to_load, path) or "
                         f"trainer.fit(ckpt_path=path), or set {config.LIVE_STATE_ENV}=0 (resume from the newest "
                         "checkpoint)"
                         if isinstance(err, OSError) and LIVE_NAME.split("{")[0] in str(err) else "")
            return Unsafe(False, (
                f"recover_in_place: attempt {attempts.in_place()} of the training function failed before it "
                f"trained (no fail-together session had started): {type(err).__name__}: {cap_head(str(err), 300)}. "
                "The function must build everything it uses each time it is called (init_process_group, model, "
                "optimizer, loaders, Engine/Trainer and FaultTolerance): an object made once outside it, or a "
                "global only a fresh process has, breaks the second call" + live_hint)), {}
        if not sessions and not attempts.in_place():
            return Decision(False, "no fail-together session ran (attach FaultTolerance, or use fail_together): "
                                   "the peers cannot be told"), {}
        self._announce(RecoveryPhase.FAILURE_SEEN, rank, cause, t0)
        # 1. record: a failure no section published is published now, for the peers' watchdogs
        if cause.own and tag_of(err).record is None and not tag_of(err).agreed:
            for session in sessions:
                if session.group is None:
                    session.report_error(err, section="recover_in_place", release=True)
        self._sessions = sessions  # stopped: out of the registry, abandoned at the teardown
        # with spares the liveness helpers go on until the teardown: a rank found silent later gets one too
        keep = self.layout is not None and self.layout.spares > 0
        for session in sessions:
            session.stop(keep_liveness=keep)
        stopped = time.monotonic()
        self.live.collect(rank)  # the state this rank holds, as of the last step it completed
        # 2. agree, on the first attempt's store
        decision = self._agree(world, cause)
        timings = {"detected": t0, "stopped": stopped, "agreed": time.monotonic(), "attempt_ran": t0 - started}
        if decision.restart:
            self.causes.append(decision.cause or cause)
        self.live.settle(decision.restart, decision.live, world[1], world[2])
        if decision.restart:
            self._announce(RecoveryPhase.RECOVERY_STARTED, rank, self.causes[-1], t0)
        return decision, timings

    def _agree(self, world: tuple, cause: FailureRecord) -> Decision:
        """This rank's part of the agreement (:func:`.agree.agree`), on the first attempt's store."""
        store, rank, world_size, _, _ = world
        report = self.live.report or LiveReport(rank, -1, "", "a spare took its place (it holds no state)"
                                                if self._order is not None else
                                                "its process was replaced (its state ended with it)")
        return agree.agree(store, rank, world_size, cause, report, max_restarts=self.max_restarts,
                           history=self.causes, join_timeout=self.join_timeout, layout=self.layout,
                           since=self._failure_wall, sessions=self._sessions)

    def _add_note(self, err: BaseException, decision: Decision) -> None:
        lines = [f"fault-tolerant-handlers: not recovered in place: {decision.why}"]
        if self.causes:
            lines += ["causes of the attempts recovered in place before:",
                      *(f"  attempt {i}: {c.describe()}" for i, c in enumerate(self.causes))]
        log(logging.ERROR, "%s", "\n".join(lines))
        with contextlib.suppress(Exception):  # an exception type that refuses notes
            err.add_note("\n".join(lines))

    # -- teardown and re-forming -------------------------------------------------------------------------
    def _teardown(self, timings: dict) -> None:
        world = self._world()
        state = self._state(timings=timings)
        hooks.run(hooks.TEAR_DOWN, state)  # before the groups go (the launchers: this rank's address keys)
        parts = timings.setdefault("parts", {})
        mark = time.monotonic()

        def part(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            parts[name] = parts.get(name, 0.0) + now - mark
            mark = now

        part("keys")
        self._abandon_sessions()
        part("sessions")
        interrupts.destroy_process_groups(RECOVER_TEARDOWN_SEC)
        timings["quieted"] = interrupts.quiet_released()  # the destroyed groups' loops (alive while held): no spinning
        _compat_torch.forget_destroyed_groups()  # torch's functions that keep one as a default: freed with the rest
        part("groups")
        hooks.run(hooks.RESET_FRAMEWORKS, state)  # the adapters: frameworks' process-wide state
        part("frameworks")
        gc.collect()  # the failed attempt's groups, sessions and loaders (their workers shut down with them)
        part("collected")
        hooks.run(hooks.COLLECTED, state)  # the data layer: the DataLoader workers still running
        if world is not None:
            world[0].set_timeout(world[4])
        part("workers")
        timings["torn_down"] = time.monotonic()

    def _abandon_sessions(self) -> None:
        """Stop and abandon the failed attempt's sessions, in a frame of its own: nothing refers to them
        after, so the teardown's collection frees what they hold (before the next ``gc.freeze()``)."""
        sessions = self._sessions + live_sessions()
        for session in sessions:  # the liveness helpers kept for the recovery, first: none writes after
            session.stop()
        self._sessions = []
        for session in sessions:  # every rank reached the recovery: nobody reads their keys any more
            session.abandon(shared_keys=session.table.group_rank == 0)

    def _reform(self, timings: dict) -> None:
        store, rank, world_size, backend, timeout = self._world()
        attempts.set_in_place(attempts.in_place() + 1)
        if self.on_attempt is not None:
            self.on_attempt(attempts.in_place())
        hooks.run(hooks.RE_FORM, self._state(timings=timings))  # the launchers: the rendezvous over ``store``
        self.live.send(store, rank, world_size, self.join_timeout, timings)
        if self.given is not None:
            dist.init_process_group(backend, store=dist.PrefixStore(attempts.namespace(), store), rank=rank,
                                    world_size=world_size, timeout=timeout)
        timings["reformed"] = time.monotonic()
        cause = self.causes[-1]
        parts = ", ".join(f"{name} {took:.2f}" for name, took in timings.get("parts", {}).items() if took >= 0.005)
        plan = self.live.plan or LivePlan(-1, "", "no plan was made")
        log(logging.WARNING, "recovering in place, attempt %d (max_restarts=%d), after %s; watchdogs stopped %.2f s, "
            "agreed %.2f s, torn down %.2f s (%s), re-formed %.2f s after the failure reached this rank; "
            "%d socket registrations of the released groups quieted; %s",
            attempts.in_place(), self.max_restarts, cause.describe(),
            timings["stopped"] - timings["detected"], timings["agreed"] - timings["detected"],
            timings["torn_down"] - timings["detected"], parts or "-", timings["reformed"] - timings["detected"],
            timings.get("quieted", 0), plan.describe())
        self._announce(RecoveryPhase.RECOVERED, rank, cause, timings["detected"], timings["reformed"])

    def _announce(self, phase: RecoveryPhase, rank: int, cause: FailureRecord, since: float,
                  now: float | None = None) -> None:
        """Tell the recovery's moment ``phase``, ``since`` the failure reached this rank."""
        plan = None if phase is RecoveryPhase.FAILURE_SEEN else self.live.plan
        live = plan is not None and plan.step >= 0
        recoveries.announce(RecoveryInfo(
            phase, attempts.in_place() + (phase is not RecoveryPhase.RECOVERED), rank, cause,
            0.0 if plan is None else max(0.0, (time.monotonic() if now is None else now) - since),
            None if plan is None else (recoveries.LIVE if live else recoveries.CHECKPOINT),
            plan.step if live else None, 0 if live else None))

    # -- interrupting a hung main thread -------------------------------------------------------------------
    def _install_interrupter(self) -> Any:
        global _interruptible
        if INTERRUPT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
            log(logging.INFO, "recover_in_place runs outside the main thread: a hung rank ends as without recovery")
            return None
        # _Recovery.run takes the interrupt: a signal while it runs (fn returned or raised) raises nothing
        installed = interrupts.install(INTERRUPT_SIGNAL, config.settings().interrupt_defer, takers=(_Recovery.run.__code__,))
        installed, _interruptible = (installed, _interruptible), self
        return installed

    def _restore_interrupter(self, installed: Any) -> None:
        global _interruptible
        if installed is not None:
            installed, _interruptible = installed
            interrupts.uninstall(installed)


#: The recovery running in the main thread (set while its ``run`` runs): what :func:`interrupt` answers from.
_interruptible: _Recovery | None = None


def interrupt(error: BaseException) -> threading.Event | None:
    """``INTERRUPT`` (``wiring.py``): raise ``error`` in the hung main thread of the recovery running
    here; the event is set when that thread reached the recovery. ``None``: no recovery runs here."""
    recovery = _interruptible
    if recovery is None:
        return None
    recovery._left.clear()
    if not interrupts.interrupt(error) and interrupts.taken():  # the main thread is in the recovery already
        recovery._left.set()
    return recovery._left


def recover_in_place(fn: Callable[..., T] | None = None, *, max_restarts: int = 3,
                     join_timeout: timedelta | float | str | dict | None = None, replace_dead: bool = True,
                     spares: int = 0):
    """Run ``fn`` and, when it fails on every rank, recover in place: tear the attempt down, re-form the
    process group in the same processes and call ``fn`` again (see the module's text).

    Use it as a decorator (``@recover_in_place(max_restarts=2)``) or a call
    (``recover_in_place(train, max_restarts=2)(cfg)``). It returns what ``fn`` returns.

    Args:
        fn: the training function; it must build everything it uses each time it is called.
        max_restarts: how many recoveries in place at most (an int >= 0); one more failure ends the job.
        join_timeout: how long ranks wait for each other at a recovery, from 1 s to 1 day: a
            ``timedelta``, a number of seconds, a ``"DD:HH:MM:SS"`` string or a dict such as
            ``{"minutes": 2}`` (the forms of ``hang_timeout``, but ``"auto"``); ``None``:
            ``FTH_RECOVER_JOIN_SEC``, else 60 s.
        replace_dead: under torchrun, run ``fn`` in a child of the launcher's process that is replaced
            when it dies (:mod:`.keeper`): a killed rank recovers in place too. ``fn``'s return value
            is handed back pickled. ``False``: ``fn`` runs in the launcher's process, and a dead rank
            ends the job as without recovery.
        spares: under torchrun, how many of the launched ranks (the last ones) are spares: they never
            call ``fn`` and wait until a training rank is lost with no keeper to replace it, then one
            takes its place and every training rank calls ``fn`` again (:mod:`.spares`). Inside ``fn``
            the world is the training world (``WORLD_SIZE``, ``RANK``, ``dist.get_world_size()``).
            An int from 0 (the default: none) to the launched world size - 1. A spare's call returns
            ``None`` when the training ended without needing it.

    Raises:
        TypeError, ValueError: a bad argument (named, with what it accepts), at the call.
        RecoveryError: ``spares`` outside torchrun or after ``init_process_group``; a later attempt failed
            before it trained (``fn`` cannot be called twice); ``fn`` spawns the ranks (wrap the function
            each rank runs instead).
        The last attempt's exception, with a note naming each attempt's cause, when not recovered in place.

    Examples:
        .. code-block:: python

            @recover_in_place(max_restarts=2)
            def train(cfg):
                dist.init_process_group("gloo")
                ...  # model, optimizer, loader, Engine with FaultTolerance().attach(engine)
                Checkpoint.load_objects(to_load, latest_checkpoint(cfg.dir))  # resume
                engine.run(loader, max_epochs=cfg.epochs)

            train(cfg)
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"recover_in_place(max_restarts=...) must be an int >= 0 (0: never recover), got {max_restarts!r}")
    join = config.check_join_timeout(join_timeout, what="recover_in_place(join_timeout=...)")
    if join is None:
        join = config.settings().recover_join_timeout
    if not isinstance(replace_dead, bool):
        raise TypeError(f"recover_in_place(replace_dead=...) must be True or False, got {replace_dead!r}")
    spares = check_spares(spares)
    if fn is None:
        return lambda f: recover_in_place(f, max_restarts=max_restarts, join_timeout=join, replace_dead=replace_dead,
                                          spares=spares)
    if not callable(fn):
        raise TypeError(f"recover_in_place(fn): fn must be the training function (a callable), got {fn!r}")

    return _InPlace(fn, max_restarts, join, replace_dead, spares)


class _InPlace:
    """What :func:`recover_in_place` returns: ``fn`` wrapped, picklable (launchers that spawn their ranks
    pickle the function each runs): by the name it is bound to as a decorator, else as ``fn`` and the settings."""

    def __init__(self, fn: Callable[..., T], max_restarts: int, join_timeout: timedelta,
                 replace_dead: bool = True, spares: int = 0) -> None:
        functools.update_wrapper(self, fn)  # first: it copies fn's attributes, which must not replace these
        self.fn, self.max_restarts, self.join_timeout, self.replace_dead, self.spares = (
            fn, max_restarts, join_timeout, replace_dead, spares)

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        return _Recovery(self.fn, self.max_restarts, self.join_timeout, self.replace_dead, self.spares)(*args, **kwargs)

    def __reduce__(self) -> str | tuple:
        bound = sys.modules.get(getattr(self, "__module__", None) or "")
        for part in (getattr(self, "__qualname__", "") or "").split("."):
            bound = getattr(bound, part, None)  # None for a function defined in a function (<locals>)
        if bound is self:
            return self.__qualname__
        return _InPlace, (self.fn, self.max_restarts, self.join_timeout, self.replace_dead, self.spares)

    def __repr__(self) -> str:
        return f"recover_in_place({self.fn!r}, max_restarts={self.max_restarts})"

