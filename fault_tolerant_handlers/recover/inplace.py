"""Recover in place: after a failure every rank tears the attempt down and calls the training
function again, in the same process, over a re-formed process group.

``recover_in_place(train, max_restarts=2)(args)`` calls ``train(args)``. ``train`` is what a relaunched
process would run after its imports: it builds the model, optimizer, loaders and ``Engine``/``Trainer``,
calls ``init_process_group`` where it would (or runs inside a group that already exists), resumes from
``latest_checkpoint`` and trains. When it raises on every rank (the library's adapters or sections
make every rank raise together: the failing rank its own exception, the others ``PeerFailedError``),
each rank runs the recovery's phases (:mod:`..core.phases`: the launchers, the data layer and the
adapters register their parts; this module imports none of them)

1. **records** the failure (published for the peers' watchdogs, if no section did) and stops its
   watchdogs, so that nothing of the failed attempt declares or ends anything any more;
2. **agrees** on the store the first attempt's group was made over (not on the broken group): each rank
   writes what it knows of the failure and the live state it holds (the data layer's
   ``CAPTURE_LIVE``: the state of the last step it completed, captured when the failure was
   raised) and counts itself in; rank 0 decides, once every rank is in, whether the job recovers
   (:class:`Decision`) and from which state (:func:`.causes.plan_live`), and every rank follows
   that decision (the data layer's ``SETTLE_LIVE``);
3. **tears down** the attempt: the library's sessions (side groups, store keys), every process group,
   the frameworks' process-wide state (the adapters' ``RESET_FRAMEWORKS``), the DataLoader workers
   (the attempt's objects are collected, then the data layer's ``COLLECTED``);
4. **re-forms** the default group: same backend, ranks and world size, over the same store under a new
   namespace (:func:`..core.attempts.namespace`), so nothing of the failed attempt is ever read. Where
   ``train`` calls ``init_process_group`` itself, its call is given that store (the launchers'
   ``RE_FORM``); where the group existed when ``recover_in_place`` was called, the group is re-made
   here before the next call;
5. calls ``train`` again: attempt ``g`` (:func:`recovery_attempt`), which carries on from the agreed live
   state (the adapters restore it into what the loop saves when its loop starts, unless the script
   loaded it itself: ``latest_checkpoint`` names it, ``load_checkpoint`` hands it over; no step
   computed twice) or, where live state cannot serve (the log line says why), from what the script
   loads (its newest checkpoint, or nothing). What it carried on from is told when its loop started.

A rank whose process ended is replaced by its keeper (:mod:`.keeper`); one lost with no keeper to
replace it (its host gone, ``replace_dead=False``) by a spare rank, where the job was launched with
some (``spares=k``: :mod:`.spares`).

What is not recovered in place (the job ends as it does without it, with the cause, and a relaunch
resumes exactly): a rank lost (killed, its host gone, unreachable) with no keeper and no spare left, the store lost, a signal
(SIGTERM/SIGINT: someone wants the job to end), ranks out of step (a bug), more than
``max_restarts`` failures, and a failure that repeats: the same rank, exception type and iteration
as the failure before (retrying it would fail again). The exception of the last attempt is raised,
with a note naming the cause of every attempt.

A rank hung in Python (``hang_timeout`` set) is interrupted where it hangs: its watchdog raises
:class:`~..core.errors.HangInterrupted` in its main thread (a signal, :data:`INTERRUPT_SIGNAL`, whose
handler raises), and the rank recovers with the others. The interrupt is a ``BaseException``, raised
again until the recovery takes it, and it waits outside deferred sections (the library's checkpoint
writes and store calls, :class:`~..core.interrupts.deferred_interrupt`) for
``FTH_INTERRUPT_DEFER_SEC`` at most: :mod:`..core.interrupts`. A main thread stuck in C does not leave
within :data:`~..core.config.INTERRUPT_WAIT`; that rank ends as without recovery.

Launchers. ``recover_in_place`` runs in every rank's process, around what that rank runs:

* **torchrun** (``--max-restarts 0`` or more): around the script's training function, which calls
  ``init_process_group`` (or opens ``idist.Parallel(backend)``, or fits a Lightning ``Trainer``).
* **Ignite's** ``idist.Parallel``: under torchrun, ``recover_in_place(main)`` where ``main`` opens
  ``idist.Parallel(backend)``: its ``__exit__`` destroys the group on the failure path, the recovery
  re-forms over the first rendezvous's store, and ``idist`` makes a new model for the next attempt; a
  killed rank is replaced by its keeper. Around the function each rank runs,
  ``p.run(recover_in_place(training, max_restarts=2), cfg)``, with the ranks spawned
  (``nproc_per_node=...``: the wrapped function pickles) or under torchrun: the group exists when the
  recovery starts, it is re-made here over the same store (under spawn, rank 0 hosts that store on
  ``MASTER_PORT``: it is re-used, never served twice), and ``idist`` keeps telling it (same backend,
  ranks, world size); but no keeper can start inside an existing group, so a killed rank ends the job
  (under torchrun the first call warns with the line to change).
* **Lightning's** ``strategy="ddp"`` run as ``python script.py``: Lightning starts the script again for
  every other rank, so each rank wraps its own training; rank 0, which started them, starts none in
  the next attempt (``LOCAL_RANK`` stays in its environment: :func:`..adapters.compat_lightning.keep_launched_ranks`).

Not supported: ``recover_in_place`` around a launcher that *spawns* the ranks from its own process
(``idist.Parallel(nproc_per_node=...)`` inside the wrapped function, Lightning ``ddp_spawn``,
``ddp_fork``, ``ddp_notebook``, ``torch.multiprocessing.spawn``): it runs in the parent, and a failed
rank's process ends. Every rank raises :class:`~..core.errors.RecoveryError` when its fail-together
session starts, before any batch, and so does the parent once a rank failed, each naming what to
wrap instead.

Timeouts:
    ``join_timeout`` (``FTH_RECOVER_JOIN_SEC``, 60 s): every rank must reach the recovery this soon
    after rank 0 did, or the job ends as without recovery. Store calls of the recovery are bounded by
    the same timeout, each on a thread of its own (a read from a store whose host or link is gone
    would block for minutes). A rank whose cause is not recovered in place (a rank or the store
    lost, a signal) only tells the others why, within :data:`~..core.config.RECOVER_TELL_SEC` (2 s),
    and ends: a rank cut off from the store ends as soon as it has named the cause.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import sys
import threading
import time
import zlib
from dataclasses import asdict, replace
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from ..core import attempts, compat_torch as _compat_torch, config, interrupts, phases, recoveries
from ..core.config import LOOK_FOR_LOST, RECOVER_POLL, RECOVER_TEARDOWN_SEC, RECOVER_TELL_SEC
from ..core.errors import HangInterrupted, PeerFailedError, RecoveryError, SectionMismatchError, StateTransferError
from ..core.kinds import FailureKind
from ..core.log import first_line, log
from ..core.phases import LIVE_NAME, Captured, Phase, RecoveryState
from ..core.records import cap_head
from ..core.recoveries import RecoveryCause, RecoveryInfo, RecoveryPhase
from ..core.release import EXIT_TEARDOWN_STUCK, store_ports
from ..core.schema import Connection, StoreCallTimeout, unblock_stuck_calls
from ..core.failure import tag_of
from ..core.session import live_sessions
from . import keeper, live_state, spares
from .spares import check_spares
from .causes import (KEY_ROOT, NOT_IN_PLACE, Cause, Decision, LivePlan, LiveReport, base_of, needs_keeper, keeper_key,
                     plan_live)

T = TypeVar("T")

#: The signal whose handler raises a hung rank's :class:`HangInterrupted` in its main thread (a
#: real-time signal: no launcher or framework uses it; its arrival also ends a blocking ``sleep``).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
def recovery_attempt() -> int:
    """How many times this process recovered in place so far: 0 in the first call of the training
    function, 1 in the call after the first recovery, ... (torchrun's restarts not counted: its
    ``TORCHELASTIC_RESTART_COUNT`` tells those)."""
    return attempts.in_place()


def _cause_of(err: BaseException, rank: int) -> Cause:
    """This rank's view of ``err``, the exception that ended its call of the training function."""
    if isinstance(err, PeerFailedError):
        # a peer's process that ended (its host lives) is replaced by its keeper (checked in _agree),
        # unless its keeper was seen gone too
        ended = err.kind is FailureKind.PEER_LOST and err.ended is not None and not err.ended.keeper_gone
        return Cause(rank, err.failed_rank if err.failed_rank is not None else -1, err.exc_type, err.exc_message,
                     err.where, err.step if err.step is not None else -1, False,
                     "" if ended else NOT_IN_PLACE.get(err.kind, ""), err.kind.value)
    record = tag_of(err).record
    step = getattr(record, "step", None)
    where = getattr(record, "section", "") or ""
    not_in_place = ""
    if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        not_in_place = f"this rank's {type(err).__name__} ends the job"
    elif isinstance(err, SectionMismatchError):
        not_in_place = "the ranks were out of step (a bug in the job: it would repeat)"
    elif isinstance(err, RecoveryError):  # raised by the attempt: recovering in place cannot work in this job
        not_in_place = f"this rank found it cannot recover in place: {first_line(err, 300)}"
    try:
        message = str(err)
    except Exception:  # noqa: BLE001 - a broken __str__ must not stop the recovery
        message = f"<str() failed for {type(err).__name__}>"
    kind = FailureKind.RANK_HUNG if isinstance(err, HangInterrupted) else FailureKind.RAISED
    return Cause(rank, rank, type(err).__name__, cap_head(message, 500), where,
                 step if isinstance(step, int) else -1, True, not_in_place, kind.value)


class _Recovery:
    def __init__(self, fn: Callable[..., T], max_restarts: int, join_timeout: timedelta,
                 replace_dead: bool = False, spares: int = 0) -> None:
        self.fn = fn
        self.max_restarts = max_restarts
        self.join_timeout = join_timeout
        self.replace_dead = replace_dead
        self.spares = spares
        #: With spares: this process's place in the launched world (:mod:`.spares`).
        self.layout: spares.Layout | None = None
        self._order: spares.Order | None = None  # a spare's order to take a lost rank's place
        self._claimed: set[int] = set()  # lost ranks this rank found a spare for, this recovery
        self._failure_wall = 0.0  # when the failure reached this rank (wall clock: a spare's log line)
        #: Told each attempt's number as it starts (a keeper's child tells its keeper).
        self.on_attempt: Callable[[int], None] | None = None
        self.causes: list[Cause] = []  # the primary cause of each failed attempt
        self._left = threading.Event()  # the main thread reached the recovery
        self._sessions: list = []  # the failed attempt's sessions, stopped, to abandon
        self._captured: Captured | None = None  # this rank's live state of the failed attempt
        self._live_report: LiveReport | None = None  # what this rank tells the others it holds
        self._live_plan: LivePlan | None = None  # where the next attempt's state comes from (rank 0's plan)
        self._sending: Captured | None = None  # this rank's live state, kept for the transfer
        self._joined: tuple[Any, int, int] | None = None  # a keeper's replacement: the store it joined over

    # -- the world the attempts share ------------------------------------------------------------------
    def _world(self) -> tuple[Any, int, int, str, timedelta] | None:
        """``(store, rank, world_size, backend, timeout)`` of the first attempt's group."""
        if self.given is not None:
            return self.given
        first = self._joined
        if first is None:  # the launchers know the first rendezvous's
            found = phases.run(Phase.WORLD, RecoveryState())
            first = None if found.store is None else (found.store, found.rank, found.world_size)
        if first is None:
            return None
        store, rank, world = first
        backend = self.backend or "gloo"
        return base_of(store), rank, world, backend, self.timeout or store.timeout

    def _state(self, **changes: Any) -> RecoveryState:
        """The recovery as its phases' steps see it (:mod:`..core.phases`)."""
        world = self._world()
        fields: dict[str, Any] = {"attempt": attempts.in_place(), "cause": self.causes[-1] if self.causes else None,
                                  "plan": self._live_plan}
        if world is not None:
            fields.update(store=world[0], rank=world[1], world_size=world[2])
        return RecoveryState(**{**fields, **changes})

    def _note_group(self) -> None:
        """Remember the current default group's backend and timeout (for the rendezvous's store)."""
        if dist.is_available() and dist.is_initialized():
            try:
                self.backend = str(dist.get_backend())
                self.timeout = _compat_torch.default_store().timeout
            except Exception:  # noqa: BLE001
                pass

    # -- the loop --------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> T:
        self.backend: str | None = None
        self.timeout: timedelta | None = None
        self.given = None
        if dist.is_available() and dist.is_initialized():  # the group exists: re-made here after a failure
            self._note_group()
            self.given = (base_of(_compat_torch.default_store()), dist.get_rank(), dist.get_world_size(),
                          self.backend or "gloo", self.timeout)
        if self.spares:
            if self.given is not None:
                raise RecoveryError(f"recover_in_place(spares={self.spares}) must be called before "
                                    "init_process_group: the training world's group is made inside the training "
                                    "function (the launched world, spares included, never forms one)")
            self.layout = spares.layout(self.spares)
            if self.layout.is_spare:
                return self._serve_as_spare(args, kwargs)
            spares.enter_training_world(self.layout)
        if self.replace_dead:
            why = keeper.why_not(self)
            if why is None:
                return keeper.Keeper(self).run(args, kwargs)
            if self.given is not None and keeper.under_torchrun():
                _warn_group_made_before()  # names the line to change
                level = logging.INFO
            else:
                # A reason the script can change (CUDA touched first, another thread) is a WARNING;
                # where no keeper can exist at all (not torchrun, not Linux), INFO.
                level = logging.INFO if why.startswith(keeper.NO_KEEPER_HERE) else logging.WARNING
            log(level, "a dead rank's process cannot be replaced in place here (%s): its death ends the job "
                "as without recovery in place", why)
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict, replacement: Cause | None = None,
            order: spares.Order | None = None) -> T:
        """The attempts, in this process; a ``replacement`` (a keeper's new child, or a spare taking
        the seat its ``order`` names) first joins the recovery its peers wait in."""
        self._order = order
        phases.run(Phase.BEGIN, RecoveryState(attempt=attempts.in_place()))
        recoveries.forget()  # recovery_history(): this recovery's moments only
        running = attempts.enter_recovery()
        previous = self._install_interrupter()
        frozen_by_caller = gc.get_freeze_count() > 0
        try:
            if replacement is not None:
                self._reform(self._join_as_replacement(replacement))
                if self._order is not None:
                    spares.log_takeover(self.layout, self._order, time.time())
            elif self.layout is not None and self._joined is None:
                self._enter_training_world()
            while True:
                started = time.monotonic()
                # What lives now (modules, the library, the caller's objects) is left out of the
                # collector's walks: the teardown's full collection then visits only what the attempt
                # made. Measured here: 0.6 s per collection without, 0.01 s with; 8 ranks on 2 cores
                # spent 1 s of every recovery in it. Undone when the recovery ends.
                gc.freeze()
                interrupts.arm()  # a hang of this attempt is interrupted again (take() stopped them)
                try:
                    result = self.fn(*args, **kwargs)
                    if self.layout is not None and self._world()[1] == 0:
                        self._end_spares(True, "the training ended")
                    return result
                except BaseException as err:  # noqa: BLE001 - decided below; re-raised unless recovered
                    # First: the interrupt (if any) is taken, whatever ended the attempt; from here on
                    # no signal raises it (the handler never raises in this frame, nor in take()).
                    interrupts.take()
                    self._left.set()
                    decision, timings = self._failed(err, started)
                    if not decision.restart:
                        if self.layout is not None:
                            self._end_spares(False, decision.why)
                        if isinstance(decision, _AsIs):
                            raise
                        if isinstance(decision, _Misplaced) or (attempts.in_place() and isinstance(decision, _Unsafe)):
                            raise RecoveryError(decision.why) from err
                        self._add_note(err, decision)
                        raise
                # Outside the except block: the failed attempt's frames (and its loaders) are free.
                self._teardown(timings)
                self._reform(timings)
                phases.run(Phase.CALL_AGAIN, self._state(timings=timings))
        finally:
            sessions, self._sessions = self._sessions, []
            for session in sessions:  # not abandoned: the liveness helpers a recovery kept, stopped on every way out
                session.stop()
            if not frozen_by_caller:
                gc.unfreeze()
            self._restore_interrupter(previous)
            attempts.leave_recovery(running)
            # the launchers forget the first rendezvous; the data layer its snapshots and live state
            phases.run(Phase.END, RecoveryState(attempt=attempts.in_place()))

    def _join_as_replacement(self, cause: Cause) -> dict:
        """A keeper's new child: connect to torchrun's store as the rendezvous would, and take part in
        the recovery of the attempt the dead child was in (:attr:`attempts.in_place`)."""
        t0 = time.monotonic()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=self.join_timeout)
        self._joined = (store, rank, world_size)
        if self.layout is not None:
            spares.write_seat(store, rank, self.layout, self.layout.launched_rank)
        decision = self._agree(self._world(), cause)
        if not decision.restart:
            raise RecoveryError(f"the replacement of rank {rank}'s process could not join the recovery: {decision.why}")
        self.causes.append(Cause(**decision.cause) if decision.cause else cause)
        self._settle_live(decision)
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
        cause = _cause_of(err, rank)
        if world is None and _ranks_spawned_here(err):
            return _Misplaced(False, (
                "recover_in_place wraps a function that spawned the ranks (idist.Parallel(nproc_per_node=...), "
                "Lightning strategy='ddp_spawn' or 'ddp_fork', torch.multiprocessing.spawn): a rank failed "
                f"({type(err).__name__}), and its process is gone, so nothing can be recovered in place. Wrap the "
                "function each rank runs instead: with idist.Parallel(...) as p: p.run(recover_in_place(training, "
                "max_restarts=N), cfg); with Lightning, strategy='ddp' or torchrun")), {}
        if world is None and not sessions and not isinstance(err, PeerFailedError):
            # raised before any process group existed (a bad argument, a missing file): no rank was told,
            # nothing is recovered; the error is the job's own and is reported as itself, unchanged
            return _AsIs(False, "it was raised before any process group existed"), {}
        if world is None:
            return _Unsafe(False, "recover_in_place found no process group store to recover over (the group "
                                  "was made with init_process_group(store=...))"), {}
        if attempts.in_place() and not sessions and not isinstance(err, PeerFailedError) \
                and tag_of(err).record is None:
            return _Unsafe(False, (
                f"recover_in_place: attempt {attempts.in_place()} of the training function failed before it "
                f"trained (no fail-together session had started): {type(err).__name__}: {cap_head(str(err), 300)}. "
                "The function must build everything it uses each time it is called (init_process_group, model, "
                "optimizer, loaders, Engine/Trainer and FaultTolerance): an object made once outside it, or a "
                "global only a fresh process has, breaks the second call" + _live_name_read_as_file(err))), {}
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
        # With spares, its liveness helper goes on until the teardown (abandon): a rank found silent a
        # poll later gets a spare too. Without, nothing reads what it would find: it stops now (a kept
        # helper, a moment behind a peer's teardown, would write its session's keys again).
        keep = self.layout is not None and self.layout.spares > 0
        for session in sessions:
            session.stop(keep_liveness=keep)
        stopped = time.monotonic()
        phases.run(Phase.RECORD, self._state(cause=cause))
        self._collect_live(rank)  # the state this rank holds, as of the last step it completed
        # 2. agree, on the first attempt's store
        decision = self._agree(world, cause)
        for session in sessions:  # the failed attempt is over: recovered in place, or it ends the job
            session.failure.ended(recovered=decision.restart)
        timings = {"detected": t0, "stopped": stopped, "agreed": time.monotonic(), "attempt_ran": t0 - started}
        if decision.restart:
            self.causes.append(Cause(**decision.cause) if decision.cause else cause)
        self._settle_live(decision)
        if decision.restart:
            phases.run(Phase.AGREE, self._state(timings=timings))
            self._announce(RecoveryPhase.RECOVERY_STARTED, rank, self.causes[-1], t0)
        return decision, timings

    # -- spares (:mod:`.spares`) ------------------------------------------------------------------------------
    def _serve_as_spare(self, args: tuple, kwargs: dict) -> Any:
        """A spare: wait for an order; take a lost rank's place (then train as that rank, under a
        keeper of its own as every training rank: a later death of the seat's process is replaced in
        place too) or return ``None`` when the training ended."""
        lay = self.layout
        spares._set_left(lay.spares)
        # what the training's first optimizer would import (seconds), imported while nothing waits for it
        _compat_torch.import_lazy_modules()
        store = spares.connect(self.join_timeout)
        log(logging.INFO, "launched rank %d of %d is a spare: it waits for a training rank (%d of them) lost with no "
            "keeper to replace it", lay.launched_rank, lay.launched_world, lay.training_world)
        order = spares.wait_for_order(store, lay, lay.launched_rank)
        del store
        if order.kind == spares.END:
            if order.ok:
                log(logging.INFO, "spare launched rank %d: %s; it never trained (its call returns None)",
                    lay.launched_rank, order.why)
                return None
            raise RecoveryError(f"spare launched rank {lay.launched_rank}: the job ended without it: {order.why}")
        spares.take_seat(lay, order)
        attempts.set_in_place(order.attempt)
        cause = Cause(order.rank, order.rank, FailureKind.RANK_REPLACED.value,
                      f"rank {order.rank}'s process was lost with no keeper to replace it: spare launched rank "
                      f"{lay.launched_rank} took its place", "", -1, True, "")
        if self.replace_dead and keeper.why_not(self) is None:
            return keeper.Keeper(self).run(args, kwargs, replacement=cause, order=order)
        return self.run(args, kwargs, replacement=cause, order=order)

    def _enter_training_world(self) -> None:
        """A training rank's first attempt, with spares: the store the attempts share is torchrun's, and
        the training function's ``init_process_group`` makes the training world's group over it."""
        lay = self.layout
        store = spares.connect(self.join_timeout)
        self._joined = (store, lay.launched_rank, lay.training_world)
        spares.write_seat(store, lay.launched_rank, lay, lay.launched_rank)
        phases.run(Phase.RE_FORM, self._state())  # the launchers: init_process_group is given this world
        log(logging.INFO, "rank %d of a training world of %d (%d spare%s launched beside it)", lay.launched_rank,
            lay.training_world, lay.spares, "" if lay.spares == 1 else "s")

    def _end_spares(self, ok: bool, why: str) -> None:
        """Tell whoever waits for an order (the spares left, a keeper whose rank was lost) that the job
        ended; bounded by :data:`RECOVER_TELL_SEC` (the store may be what failed)."""
        world = self._world()
        if world is None:
            return
        conn = Connection(lambda: world[0], timedelta(seconds=RECOVER_TELL_SEC), "spares")
        conn.deadline = time.monotonic() + RECOVER_TELL_SEC
        try:
            spares.end(_Bounded(conn), self.layout, ok, why)
        except Exception as err:  # noqa: BLE001 - torchrun ends them anyway once a rank exits with an error
            log(logging.WARNING, "could not tell the spares that the job ended: %s: %s", type(err).__name__,
                first_line(err))
        finally:
            conn.close()

    def _lost_for_good(self, cause: Cause) -> bool:
        """A peer's process ended (or, with spares, its end was not seen: another host's rank lost, or
        silent: its host or link gone), and only its keeper or a spare can replace it. A silent rank
        that still lives never rejoins once a spare holds its seat (:meth:`_displaced`)."""
        if needs_keeper(cause):
            return True
        return (self.layout is not None and not cause.own and cause.failed_rank >= 0
                and cause.failure_kind in (FailureKind.PEER_LOST, FailureKind.PEER_SILENT)
                and cause.not_in_place == NOT_IN_PLACE[cause.failure_kind])

    def _displaced(self, store: Any, rank: int, gen: int) -> str:
        """With spares, why this process must not take part in the recovery as ``rank`` any more: a
        spare was ordered to take that rank at this recovery, or holds its seat (its peers declared this
        process lost or silent: cut off, frozen, then back). "" when it holds its seat."""
        lay = self.layout
        if lay is None or not lay.spares:
            return ""
        mine = lay.launched_rank  # a spare that took the seat: its own launched rank is the seat's
        if store.check([spares.answer_key(gen, rank)]):
            answer = spares.Answer.from_json(store.get(spares.answer_key(gen, rank)), lay.launched_world)
            if answer is not None and answer.spare >= 0 and answer.spare != mine:
                return (f"rank {rank} was declared lost by its peers and spare launched rank {answer.spare} takes its "
                        f"place: this process (launched rank {mine}) does not rejoin the job")
        if store.check([spares.seat_key(rank)]):
            seat = spares.Seat.from_json(store.get(spares.seat_key(rank)), lay.launched_world)
            if seat is not None and seat.launched != mine:
                return (f"rank {rank} was declared lost by its peers and {seat.describe()} holds its seat: this "
                        f"process (launched rank {mine}) does not rejoin the job")
        return ""

    def _call_spare(self, cause: Cause, store: Any, gen: int, seconds: float) -> Cause:
        """Rank ``cause.failed_rank`` was lost with no keeper to replace it: a spare takes its place
        (:func:`.spares.claim`), or, none left, the cause ends the job as without spares."""
        if self.layout is None or not self.layout.spares:  # a silent rank stays silent, a lost one lost
            return replace(cause, not_in_place=cause.not_in_place or NOT_IN_PLACE[FailureKind.PEER_LOST])
        return replace(cause, not_in_place=self._claim_spare(store, cause.failed_rank, gen, cause.describe(), seconds))

    def _claim_spare(self, store: Any, rank: int, gen: int, why: str, seconds: float, *, too: bool = False) -> str:
        """A spare for lost rank ``rank`` (:func:`.spares.claim`), logged; why the job ends when none
        is left, else ``""``. ``too``: a rank lost beside the cause's."""
        answer = spares.claim(store, self.layout, rank, gen, why, self._failure_wall, timedelta(seconds=seconds))
        if answer.spare < 0:
            return (f"rank {rank} was lost with no keeper to replace it, and no spare is left "
                    f"(spares={self.layout.spares}, all taken): a relaunch replaces it")
        log(logging.WARNING, "rank %d was lost%s with no keeper to replace it: spare launched rank %d takes its place "
            "(%d spare%s left after it)", rank, " too," if too else "", answer.spare, answer.left,
            "" if answer.left == 1 else "s")
        return ""

    def _lost_records(self) -> dict[int, Any]:
        """Rank -> the failed attempt's record declaring it lost or silent (:meth:`Session.lost_ranks`)."""
        lost: dict[int, Any] = {}
        for session in self._sessions:
            try:
                lost.update(session.lost_ranks())
            except Exception as err:  # noqa: BLE001 - the recovery's join timeout then names what is missing
                log(logging.DEBUG, "reading the lost ranks: %s", first_line(err))
        return lost

    def _keeper_seen_gone(self, rank: int) -> bool:
        """A record of the failed attempt says rank ``rank``'s keeper was gone when it died (its
        liveness helper's, which may come after a same-host peer's record of the same death)."""
        record = self._lost_records().get(rank)
        return record is not None and record.ended is not None and record.ended.keeper_gone

    def _spares_for_lost(self, store: Any, prefix: str, gen: int, seconds: float) -> str:
        """Every rank the failed attempt's records declare lost or silent (not only the cause's: a host
        of several ranks, two processes killed at once) that has not reached the recovery and has no
        keeper to replace it (none announced, its end not seen: ``ended`` unknown, or its keeper seen gone
        with it: ``ended.keeper_gone``) gets a spare (:func:`.spares.claim`, once per rank and recovery
        whoever asks). Returns why the job ends when one is left without a spare, else ``""``."""
        for rank, record in sorted(self._lost_records().items()):
            if rank in self._claimed or store.check([f"{prefix}cause/{rank}"]):
                continue  # found a spare already, or it (or its replacement) reached the recovery
            if _keeper_replaces(store, rank, record.ended is not None and not record.ended.keeper_gone):
                continue
            self._claimed.add(rank)
            why = f"rank {rank} failed: {record.exc_type}: {cap_head(record.exc_message, 200)}"
            ends = self._claim_spare(store, rank, gen, why, seconds, too=True)
            if ends:
                return ends
        return ""

    # -- live state (captured and held by the data layer: its CAPTURE_LIVE and SETTLE_LIVE steps) --------
    def _collect_live(self, rank: int) -> None:
        """This rank's live state of the failed attempt, and what it tells the others (with its
        checksum, which tells a diverged rank, and whether it can be sent to a rank that needs it)."""
        captured = phases.run(Phase.CAPTURE_LIVE, self._state())
        self._captured = captured.live
        if self._captured is None:
            self._live_report = LiveReport(rank, -1, "", cap_head(captured.live_why or "no layer captures it", 300))
            return
        digest, portable = "", ""
        try:
            digest = live_state.checksum(self._captured.state)
        except TypeError as err:  # a leaf that cannot be sent (named by its path): kept for this rank only
            portable = cap_head(str(err), 300)
        rng = self._captured.rng
        self._live_report = LiveReport(rank, self._captured.step, self._captured.unit, "", digest,
                                       "" if rng is None else f"{_rng_crc(rng):08x}", portable)

    def _settle_live(self, decision: Decision) -> None:
        """Follow rank 0's plan: hold this rank's live state for the next attempt (a receiver gets the
        source's when the group is re-formed: :meth:`_transfer_live`), or nothing (it resumes from
        its checkpoint)."""
        captured = self._captured
        self._captured = None
        if not decision.restart:
            self._hold(None)
            return
        world = self._world()
        world_size = world[2] if world is not None else 1
        rank = world[1] if world is not None else 0
        plan = LivePlan.from_dict(decision.live) if decision.live else LivePlan(-1, "", "rank 0 made no plan")
        plan = plan.checked(world_size)
        receives = plan.step >= 0 and rank in plan.receivers
        if plan.step >= 0 and not receives and (captured is None or captured.step != plan.step
                                                or captured.unit != plan.unit):
            plan = LivePlan(-1, "", "this rank does not hold the agreed step (a bug: the plan says it does)")
        self._live_plan = plan
        # a receiver keeps its stale state until the transfer, which writes into its tensors
        self._sending = captured if plan.step >= 0 and plan.receivers else None
        self._hold(captured if plan.step >= 0 and not receives else None)

    def _hold(self, captured: Captured | None) -> None:
        """What the next attempt resumes from: ``captured`` (``None``: its newest checkpoint)."""
        phases.run(Phase.SETTLE_LIVE, self._state(live=captured))

    def _transfer_live(self, store: Any, rank: int, world_size: int, timings: dict) -> None:
        """The plan names receivers: the source sends them its live state over a gloo group the
        recovery forms for it (on the first attempt's store, this attempt's namespace), before the
        training function is called again. A transfer that fails, fails on every rank together:
        every rank then resumes from its newest checkpoint."""
        plan, own = self._live_plan, self._sending
        self._sending = None
        if plan is None or plan.step < 0 or not plan.receivers:
            return
        t0 = time.monotonic()
        receives = rank in plan.receivers
        group_store = dist.PrefixStore(f"{attempts.namespace()}/live-state/", store)
        try:
            dist.init_process_group("gloo", store=group_store, rank=rank, world_size=world_size,
                                    timeout=self.join_timeout)
            try:
                mine = own.state if own is not None and (rank == plan.source or receives) else None
                state = live_state.transfer(mine, plan.source, plan.receivers, checksum=plan.checksum or None)
                extras = None
                if rank == plan.source:
                    extras = {"directory": own.directory,
                              "rng": list(own.rng) if plan.rng_shared and own.rng is not None else None}
                extras = live_state.transfer(extras, plan.source, plan.receivers)
            finally:
                dist.destroy_process_group()
        except (StateTransferError, TypeError, RuntimeError, ValueError) as err:
            why = f"sending it from rank {plan.source} failed: {type(err).__name__}: {cap_head(str(err), 200)}"
            self._live_plan = LivePlan(-1, "", why)
            self._hold(None)
            return
        if receives:
            directory = extras.get("directory") if isinstance(extras, dict) else None
            rng = extras.get("rng") if isinstance(extras, dict) else None
            rng = tuple(rng) if isinstance(rng, list) and len(rng) == 2 else None
            if rng is None and own is not None and own.step == plan.step:
                rng = own.rng  # diverged at the same step: its own RNG states are those of that step
            self._hold(Captured(plan.step, plan.unit, state, directory if isinstance(directory, str) else None, rng))
        timings.setdefault("parts", {})["live state sent"] = time.monotonic() - t0

    def _agree(self, world: tuple, cause: Cause) -> Decision:
        store, rank, world_size, _, _ = world
        gen = attempts.in_place()
        prefix = f"{KEY_ROOT}/{attempts.restart()}/{gen}/"
        seconds = self.join_timeout.total_seconds()
        # Every store call here runs on a thread of its own and is waited for within a deadline:
        # c10d bounds waiting for a key, not a read from a store whose host or link is gone (that
        # blocks for TCP's retransmission timeout, minutes). A rank that ends anyway (its cause is not
        # recovered in place, or tells it is: the keeper's key) only tells its peers, within
        # RECOVER_TELL_SEC; the others wait for each other within the join timeout (c10d's own
        # timeout of a wait for a key comes first: this deadline is for a store that does not answer).
        conn = Connection(lambda: store, timedelta(seconds=seconds + 5), "recover")
        bounded = _Bounded(conn)
        started = time.monotonic()
        conn.deadline = started + RECOVER_TELL_SEC
        try:
            displaced = self._displaced(bounded, rank, gen)
            if displaced:  # before it writes or counts anything: the rank is another process's now
                log(logging.ERROR, "%s", displaced)
                return Decision(False, displaced)
            if gen >= self.max_restarts and not cause.not_in_place:  # every rank knows: nobody waits for another
                cause = replace(cause, not_in_place=f"max_restarts={self.max_restarts} recoveries in place already spent")
            end_seen = needs_keeper(cause) and not self._keeper_seen_gone(cause.failed_rank)
            claim = self._lost_for_good(cause) and not _keeper_replaces(bounded, cause.failed_rank, end_seen)
            if claim:
                conn.deadline = started + seconds + 10
                cause = self._call_spare(cause, bounded, gen, seconds)
            if not cause.not_in_place and self.layout is not None and self.layout.spares:
                conn.deadline = started + seconds + 10  # other ranks lost at once: a spare each
                self._claimed = {cause.failed_rank} if claim else set()
                more = self._spares_for_lost(bounded, prefix, gen, seconds)
                if more:
                    cause = replace(cause, not_in_place=more)
            if not cause.not_in_place:
                conn.deadline = started + seconds + 10
            bounded.set(f"{prefix}cause/{rank}", cause.to_json())
            if not cause.not_in_place:  # before it counts itself in: rank 0 reads it once every rank is
                report = self._live_report or LiveReport(rank, -1, "", "a spare took its place (it holds no state)"
                                                         if self._order is not None else
                                                         "its process was replaced (its state ended with it)")
                bounded.set(f"{prefix}live/{rank}", report.to_json())
            if cause.not_in_place:
                bounded.add(f"{prefix}stop", 1)
            bounded.add(f"{prefix}arrived", 1)
            if cause.not_in_place:
                return Decision(False, cause.not_in_place)
            if rank != 0:
                bounded.wait([f"{prefix}decision"], timedelta(seconds=seconds + 5))
                decision = Decision.from_json(bounded.get(f"{prefix}decision"))
                if decision is not None and decision.spares_left >= 0:
                    spares._set_left(decision.spares_left)  # every rank tells the same after several took
                return decision or Decision(False, "rank 0's decision could not be read")
            decision = self._decide(bounded, prefix, world_size, gen, seconds)
            if decision.restart and self.layout is not None and self.layout.spares:
                decision = replace(decision, spares_left=spares.left_after(bounded, self.layout))
                spares._set_left(decision.spares_left)
            bounded.set(f"{prefix}decision", decision.to_json())
            if decision.restart and gen:  # every rank passed the recovery before this one: its keys go
                old = f"{KEY_ROOT}/{attempts.restart()}/{gen - 1}/"
                old_keys = [f"{old}{kind}/{r}" for kind in ("cause", "live") for r in range(world_size)]
                for key in old_keys + [f"{old}{k}" for k in ("arrived", "stop", "decision")]:
                    bounded.delete_key(key)
            return decision
        except Exception as err:  # noqa: BLE001 - the store may be what failed: end as without recovery
            why = first_line(err)
            if isinstance(err, StoreCallTimeout):
                # the call is left blocked in c10d: its connection is shut down, so that it returns
                # (a thread inside c10d at the interpreter's exit aborts it)
                unblock_stuck_calls(store_ports(store), wait=0.5, busy_too=True)
                why = f"the store did not answer within {time.monotonic() - started:.1f} s"
            if cause.not_in_place:
                log(logging.WARNING, "could not tell the other ranks why this rank ends (%s)", why)
                return Decision(False, cause.not_in_place)
            return Decision(False, f"the recovery's store calls failed: {why}")
        finally:
            conn.close()

    def _decide(self, store: Any, prefix: str, world_size: int, gen: int, seconds: float) -> Decision:
        deadline = time.monotonic() + seconds
        look_again = time.monotonic() + LOOK_FOR_LOST
        while True:
            arrived, stopped = store.add(f"{prefix}arrived", 0), store.add(f"{prefix}stop", 0)
            if stopped:
                break
            if arrived >= world_size:
                break
            if self.layout is not None and self.layout.spares and time.monotonic() >= look_again:
                # a rank lost after this one's failure (or at once, seen later): a spare for it too
                look_again = time.monotonic() + LOOK_FOR_LOST
                more = self._spares_for_lost(store, prefix, gen, seconds)
                if more:
                    return Decision(False, more)
            if time.monotonic() > deadline:
                return Decision(False, f"only {arrived} of {world_size} ranks reached the recovery within "
                                       f"{seconds:g} s ({config.RECOVER_JOIN_ENV})")
            time.sleep(RECOVER_POLL)
        keys = [f"{prefix}cause/{r}" for r in range(world_size)]
        present = [k for k in keys if store.check([k])]
        causes = [c for c in (Cause.from_json(raw, world_size) for raw in (store.multi_get(present) if present else []))
                  if c is not None]
        blocking = [c for c in causes if c.not_in_place]
        if blocking:
            return Decision(False, f"{blocking[0].not_in_place} (rank {blocking[0].by}: {blocking[0].describe()})")
        own = sorted((c for c in causes if c.own), key=lambda c: c.by)
        primary = own[0] if own else (causes[0] if causes else None)
        if primary is None:
            return Decision(False, "no rank could say what failed")
        if gen >= self.max_restarts:
            return Decision(False, f"max_restarts={self.max_restarts} recoveries in place already spent", asdict(primary))
        if self.causes and primary.step >= 0 and primary.signature() == self.causes[-1].signature():
            return Decision(False, f"the failure repeats at the same iteration ({primary.describe()}): recovering "
                                   "again would fail again", asdict(primary))
        live_keys = [f"{prefix}live/{r}" for r in range(world_size)]
        present = [k for k in live_keys if store.check([k])]
        reports = [LiveReport.from_json(raw, world_size) for raw in (store.multi_get(present) if present else [])]
        return Decision(True, primary.describe(), asdict(primary), plan_live(reports, world_size).to_dict())

    def _add_note(self, err: BaseException, decision: Decision) -> None:
        lines = [f"fault-tolerant-handlers: not recovered in place: {decision.why}"]
        lines += [f"  attempt {i}: {c.describe()}" for i, c in enumerate(self.causes)]
        if lines[1:]:
            lines.insert(1, "causes of the attempts recovered in place before:")
        log(logging.ERROR, "%s", "\n".join(lines))
        try:
            err.add_note("\n".join(lines))
        except Exception:  # noqa: BLE001 - an exception type that refuses notes
            pass

    # -- teardown and re-forming -------------------------------------------------------------------------
    def _teardown(self, timings: dict) -> None:
        world = self._world()
        state = self._state(timings=timings)
        phases.run(Phase.TEAR_DOWN, state)  # before the groups go (the launchers: this rank's address keys)
        parts = timings.setdefault("parts", {})
        mark = time.monotonic()

        def part(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            parts[name] = parts.get(name, 0.0) + now - mark
            mark = now

        part("keys")
        sessions = self._sessions + live_sessions()
        for session in sessions:  # the liveness helpers kept for the recovery, first: none writes after
            session.stop()
        self._sessions = []
        for session in sessions:  # every rank reached the recovery: nobody reads their keys any more
            session.abandon(shared_keys=session.group_rank == 0)
        part("sessions")
        timer = threading.Timer(RECOVER_TEARDOWN_SEC, lambda: os._exit(EXIT_TEARDOWN_STUCK))
        timer.daemon = True
        timer.start()
        try:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - released groups may complain; they are gone either way
            log(logging.DEBUG, "destroying the failed attempt's groups: %s", err)
        finally:
            timer.cancel()
        part("groups")
        phases.run(Phase.RESET_FRAMEWORKS, state)  # the adapters: frameworks' process-wide state
        part("frameworks")
        gc.collect()  # the failed attempt's loaders: their workers are shut down with them
        part("collected")
        phases.run(Phase.COLLECTED, state)  # the data layer: the DataLoader workers still running
        if world is not None:
            world[0].set_timeout(world[4])
        part("workers")
        timings["torn_down"] = time.monotonic()

    def _reform(self, timings: dict) -> None:
        store, rank, world_size, backend, timeout = self._world()
        attempts.set_in_place(attempts.in_place() + 1)
        if self.on_attempt is not None:
            self.on_attempt(attempts.in_place())
        phases.run(Phase.RE_FORM, self._state(timings=timings))  # the launchers: the rendezvous over ``store``
        self._transfer_live(store, rank, world_size, timings)
        if self.given is not None:
            dist.init_process_group(backend, store=dist.PrefixStore(attempts.namespace(), store), rank=rank,
                                    world_size=world_size, timeout=timeout)
        timings["reformed"] = time.monotonic()
        cause = self.causes[-1]
        parts = ", ".join(f"{name} {took:.2f}" for name, took in timings.get("parts", {}).items() if took >= 0.005)
        plan = self._live_plan or LivePlan(-1, "", "no plan was made")
        log(logging.WARNING, "recovering in place, attempt %d (max_restarts=%d), after %s; watchdogs stopped %.2f s, "
            "agreed %.2f s, torn down %.2f s (%s), re-formed %.2f s after the failure reached this rank; %s", attempts.in_place(), self.max_restarts, cause.describe(),
            timings["stopped"] - timings["detected"], timings["agreed"] - timings["detected"],
            timings["torn_down"] - timings["detected"], parts or "-", timings["reformed"] - timings["detected"],
            plan.describe())
        self._announce(RecoveryPhase.RECOVERED, rank, cause, timings["detected"], timings["reformed"])

    def _announce(self, phase: RecoveryPhase, rank: int, cause: Cause, since: float, now: float | None = None) -> None:
        """Tell the recovery's moment ``phase`` (:mod:`..core.recoveries`), ``since`` the failure reached
        this rank; never raises (a report must not stop the recovery)."""
        try:
            plan = None if phase is RecoveryPhase.FAILURE_SEEN else self._live_plan
            live = plan is not None and plan.step >= 0
            info = RecoveryInfo(
                phase, attempts.in_place() + (phase is not RecoveryPhase.RECOVERED), rank,
                RecoveryCause(cause.failed_rank if cause.failed_rank >= 0 else None, cause.failure_kind, cause.exc_type,
                              cause.message, cause.step if cause.step >= 0 else None, cause.where),
                0.0 if plan is None else max(0.0, (time.monotonic() if now is None else now) - since),
                None if plan is None else (recoveries.LIVE if live else recoveries.CHECKPOINT),
                plan.step if live else None, 0 if live else None)
        except Exception as err:  # noqa: BLE001
            log(logging.WARNING, "%s: its RecoveryInfo could not be made: %s: %s", phase, type(err).__name__, err)
            return
        recoveries.announce(info)

    # -- interrupting a hung main thread -------------------------------------------------------------------
    def _install_interrupter(self):
        if INTERRUPT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
            log(logging.INFO, "recover_in_place runs outside the main thread: a hung rank ends as without recovery")
            return None
        # This frame (_Recovery.run) takes the interrupt: a signal that arrives while it runs (the
        # training function has returned or raised) raises nothing.
        state = interrupts.install(INTERRUPT_SIGNAL, config.settings().interrupt_defer, takers=(_Recovery.run.__code__,))
        attempts.interrupter = self._interrupt
        return (state,)

    def _restore_interrupter(self, previous) -> None:
        attempts.interrupter = None
        if previous is not None:
            interrupts.uninstall(previous[0])

    def _interrupt(self, error: BaseException) -> threading.Event:
        self._left.clear()
        if not interrupts.interrupt(error) and interrupts.taken():  # the main thread is in the recovery already
            self._left.set()
        return self._left


class _Bounded:
    """A store whose every call (``bounded.add(key, 1)``) is :meth:`Connection.call`'s: on a thread
    of its own, waited for within the connection's deadline (:class:`StoreCallTimeout` past it)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def __getattr__(self, method: str) -> Callable[..., Any]:
        return functools.partial(self._conn.call, method)


class _AsIs(Decision):
    """A decision to raise the exception as it is, with no note and no line (nothing was recovered or
    could be: the job's own error before any process group existed)."""


class _Unsafe(Decision):
    """A decision to stop because the function cannot be called again (raised as :class:`RecoveryError`)."""


class _Misplaced(_Unsafe):
    """A decision to stop because the recovery wraps the launcher, not the ranks (always raised as
    :class:`RecoveryError`, in the first attempt too)."""


_warned_group_before = False


def _warn_group_made_before() -> None:
    """Once per process: under torchrun, ``recover_in_place`` called inside a process group that exists
    already (the documented ``idist.Parallel`` form: ``p.run(recover_in_place(training), cfg)``) cannot
    replace a killed rank: the process torchrun started is the rank itself, and a keeper must fork before
    any group exists (a forked copy of a gloo context has none of its threads). Say the line to change."""
    global _warned_group_before
    if _warned_group_before:
        return
    _warned_group_before = True
    log(logging.WARNING, "recover_in_place was called inside a process group that exists already, so a killed rank "
        "(SIGKILL, the OOM killer, a segfault) cannot be replaced in place and ends the job (exceptions and hangs in "
        "Python still recover in place). To recover it too, wrap the function that makes the group instead: "
        "replace 'with idist.Parallel(backend=...) as p: p.run(recover_in_place(training, ...), cfg)' with "
        "'recover_in_place(main, ...)(cfg)' where main(cfg) runs 'with idist.Parallel(backend=...) as p: "
        "p.run(training, cfg)'; or call the wrapped function before init_process_group (docs/recovering.md, "
        "\"Launchers\")")


def _keeper_replaces(store: Any, rank: int, end_seen: bool) -> bool:
    """A keeper replaces lost rank ``rank``: its end was seen (by a peer on its host, or its liveness
    helper, which saw its keeper live on) and its keeper announced itself (:func:`keeper_key`). A key
    alone is no evidence: a rank whose host is gone or cut off left its key behind, announced when it
    started, and so did a keeper killed with its rank."""
    return end_seen and bool(store.check([keeper_key(rank)]))


def _rng_crc(rng: tuple) -> int:
    """A CRC-32 of recorded RNG states (CPU and, if any, CUDA): equal on ranks whose RNG is the same."""
    crc = 0
    for state in [rng[0], *(rng[1] or [])]:
        crc = zlib.crc32(state.numpy().tobytes(), crc)
    return crc


def _live_name_read_as_file(err: BaseException) -> str:
    """A hint when ``err`` is a file's absence under the name ``latest_checkpoint`` gave for live state."""
    if isinstance(err, OSError) and LIVE_NAME.split("{")[0] in str(err):
        return (f". It read the name latest_checkpoint gave for the live state as a file: load it with "
                f"load_checkpoint(path), Checkpoint.load_objects(to_load, path) or trainer.fit(ckpt_path=path), or set "
                f"{config.LIVE_STATE_ENV}=0 (resume from the newest checkpoint)")
    return ""


def _ranks_spawned_here(err: BaseException) -> bool:
    """``err`` is what ``torch.multiprocessing`` raises in the process that spawned the ranks when one
    failed (``idist.Parallel(nproc_per_node=...)``, Lightning ``ddp_spawn``)."""
    import torch.multiprocessing as mp

    return isinstance(err, (mp.ProcessRaisedException, mp.ProcessExitedException))


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
        TypeError, ValueError: a bad argument (named, with what it accepts), at the call: e.g.
            ``join_timeout="auto"`` or a duration outside 1 s to 1 day.
        ValueError: ``spares`` leaves no training rank (at the call, naming the launched world size).
        RecoveryError: ``spares`` outside torchrun, or after ``init_process_group``; a later attempt failed before it trained: ``fn`` cannot be called twice; or
            ``fn`` spawns the ranks (``idist.Parallel(nproc_per_node=...)``, Lightning ``ddp_spawn``):
            wrap the function each rank runs instead.
        The last attempt's exception, with a note naming each attempt's cause, when the job is not
        recovered in place.

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
    """What :func:`recover_in_place` returns: ``fn`` wrapped, as a picklable object rather than a
    closure, because launchers that spawn their ranks (``idist.Parallel(nproc_per_node=...)``,
    ``mp.spawn``) pickle the function they run in each rank. It pickles by the name it is bound to
    where it is a decorator (``@recover_in_place(...)``: the module's name *is* this object), and
    otherwise as ``fn`` (by its own name) with the settings (``p.run(recover_in_place(train), cfg)``)."""

    def __init__(self, fn: Callable[..., T], max_restarts: int, join_timeout: timedelta,
                 replace_dead: bool = True, spares: int = 0) -> None:
        functools.update_wrapper(self, fn)  # first: it copies fn's attributes, which must not replace these
        self.fn = fn
        self.max_restarts = max_restarts
        self.join_timeout = join_timeout
        self.replace_dead = replace_dead
        self.spares = spares

    def __call__(self, *args: Any, **kwargs: Any) -> T:
        return _Recovery(self.fn, self.max_restarts, self.join_timeout, self.replace_dead, self.spares)(*args, **kwargs)

    def __reduce__(self) -> str | tuple:
        if _bound_as(self) is self:
            return self.__qualname__
        return _InPlace, (self.fn, self.max_restarts, self.join_timeout, self.replace_dead, self.spares)

    def __repr__(self) -> str:
        return f"recover_in_place({self.fn!r}, max_restarts={self.max_restarts})"


def _bound_as(obj: Any) -> Any:
    """The object named ``obj.__module__`` + ``obj.__qualname__`` (``None``: no such name)."""
    target = sys.modules.get(getattr(obj, "__module__", None) or "")
    for part in (getattr(obj, "__qualname__", "") or "").split("."):
        target = getattr(target, part, None)  # None for a function defined in a function (<locals>)
        if target is None:
            return None
    return target
