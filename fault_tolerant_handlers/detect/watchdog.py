"""The out-of-band watchdog (``docs/detection.md``): daemon threads that poll small probes while the
main thread may be stuck in a collective, and escalate what they find. The store loop
(``fth-watchdog``) polls the records, self-hang and store-loss probes every ``interval``; the
liveness helper (:mod:`.liveness`) beats; the pid loop (``fth-pids``) sleeps on same-host peers'
pidfds. A finding about another rank releases this process's collectives, then, if the main thread
has not taken the failure within ``exit_grace``, ends it with :data:`EXIT_PEER_FAILED`; a rank that
finds itself hung ends with :data:`EXIT_HUNG`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Callable, Container

import torch.distributed as dist

from . import autohang
from ..core import attempts, config, hooks, inject, interrupts
from ..core.errors import EXIT_HUNG, EXIT_PEER_FAILED, HangInterrupted, store_lost
from ..core.failure import MAX_TRACEBACK_CHARS, FailureKind, FailureRecord, Incident, PeerFailedError, cap_tail
from ..core.session import Session, get_session
from .writes import writing_checkpoint, writing_now  # noqa: F401 - writing_checkpoint: public here
from ..core.hooks import first_line, log
from ..core.procfs import PeerPidProbe, main_thread_frame, thread_ticks
from .autohang import SelfHangProbe
from .liveness import LivenessProcess, kill_all as kill_all_liveness
from ..core.schema import Schema, stop_connecting, unblock_stuck_calls
from ..core.config import (BLOCKED_BEYOND_RELEASE, HEARTBEAT_EVERY, INTERRUPT_RESEND, INTERRUPT_WAIT, LIVENESS_STORE_TIMEOUT,  # timings:
                           MAX_CHECK_HOLD, RELEASE_GRACE, SILENT_MARGIN, STORE_CHECK_EVERY,  # the table in
                           STORE_EVIDENCE_TIMEOUT, STORE_WARN_EVERY)  # core.config


#: Where a main thread waits for a collective: torch.distributed's calls, and the autograd engine (DDP's
#: all-reduce, waited for at the end of the backward).
_COLLECTIVE_WAITS = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}torch{os.sep}autograd{os.sep}")


class BlockedMainProbe:
    """After a release: is the main thread blocked where only its group's timeout ends the call? Yes
    once, for ``within`` seconds, it waited in a collective (its innermost frame in torch.distributed or
    the autograd engine), ran no bytecode and used no CPU, outside a deferred section, while every
    connection the release cut was closed and no NCCL group exists (:func:`interrupts.release_spent`):
    a gloo send queued on a connection that closed waits for the group's timeout, and nothing is left to cut."""

    def __init__(self, within: float, tid: int | None = None) -> None:
        self.within, self.tid = within, threading.main_thread().native_id if tid is None else tid
        self._seen: tuple | None = None
        self._since = 0.0

    def poll(self, now: float) -> bool:
        frame = main_thread_frame()
        seen = (None if frame is None else (id(frame), frame.f_lasti), thread_ticks(self.tid))
        if (None in seen or seen != self._seen
                or not any(part in frame.f_code.co_filename for part in _COLLECTIVE_WAITS)
                or interrupts.deferred_until() is not None or not interrupts.release_spent()):
            self._seen, self._since = seen, now
            return False
        return now - self._since >= self.within


# -- the store loop's probes: each ``poll(now) -> PeerFailedError | None``, driven by a fake clock in tests --
class RecordsProbe:
    """Failure records of other ranks that no sync point took (``delivered()``) within ``grace``
    seconds; at once for a record declaring a rank lost or silent (no agreement can take it without it),
    and for any record first seen while ``at_once()`` (no sync point is worth waiting for)."""

    def __init__(self, schema: Schema, rank: int, grace: float, delivered: Callable[[], Container[int]],
                 start: int = 0, stale: Callable[[FailureRecord], bool] = lambda record: False,
                 at_once: Callable[[], bool] = lambda: False) -> None:
        self.schema, self.rank, self.grace, self.delivered = schema, rank, grace, delivered
        self.stale = stale  # late news of a failure already agreed on: not a new failure
        self.at_once = at_once
        self.seen = start
        self.pending: dict[int, float] = {}  # index -> first seen

    def poll(self, now: float) -> PeerFailedError | None:
        count = self.schema.count()
        new = self.schema.new_indices(self.seen, count)
        at_once = bool(new) and self.at_once()
        for index in new:
            record = self.schema.read(index)
            gone = record is not None and record.kind in (FailureKind.PEER_LOST, FailureKind.PEER_SILENT)
            self.pending.setdefault(index, now - self.grace if gone or at_once else now)
        self.seen = count
        delivered = self.delivered()
        for index in [i for i in self.pending if i in delivered]:
            del self.pending[index]
        due = [i for i, t in self.pending.items() if now - t >= self.grace]
        records = []
        for index in due:
            del self.pending[index]
            record = self.schema.read(index)
            if record is not None and record.rank != self.rank and not self.stale(record):
                records.append(record)
        return PeerFailedError.from_records(records) if records else None


class StoreLossProbe:
    """The store did not answer: its host is declared lost (``StoreLost`` when no rank is on it) only
    when a silence started by failed calls (:meth:`failed`) lasted ``lost_after`` **and** every check
    of ``evidence()`` in it (a TCP connect: a string when refused or unreachable), at least two, found
    evidence; a port that answers is a slow store, and the next check waits twice as long (up to
    :data:`MAX_CHECK_HOLD`: each costs c10d's server a reverse DNS lookup). ``hosted_here``: never."""

    def __init__(self, lost_after: float, *, by: int, store_rank: int | None = 0, store_pid: int = 0,
                 evidence: Callable[[], str | None] = lambda: None, check_every: float = 0.5,
                 hosted_here: bool = False, store_at: str = "") -> None:
        self.lost_after, self.by, self.store_rank, self.store_pid = lost_after, by, store_rank, store_pid
        self.evidence, self.check_every, self.hosted_here = evidence, check_every, hosted_here
        self.store_at = store_at  # host:port, named when no rank runs on the store's host
        self.down_since: float | None = None
        self.last_error = ""
        self.found: str | None = None  # the newest evidence of the silence under way
        self.checks = 0  # checks of the silence under way, every one of them with evidence
        self.next_check = 0.0
        self.hold = check_every  # the wait before a check after the port answered the last one

    def failed(self, now: float, err: BaseException) -> bool:
        """A failed call; True when it is the first of a silence."""
        self.last_error = f"{type(err).__name__}: {first_line(err)}"
        if self.down_since is None:
            self.down_since = now
            self.checks, self.found, self.next_check = 0, None, max(now, self.next_check)
            return True
        return False

    def answered(self) -> None:
        """A call was answered: the store is back, the next silence is checked at once."""
        self.down_since, self.checks, self.found = None, 0, None
        self.next_check, self.hold = 0.0, self.check_every

    def declare_at(self) -> float | None:
        """When the silence under way becomes a loss if the evidence holds (monotonic), or ``None``."""
        if self.down_since is None or self.hosted_here:
            return None
        return self.down_since + self.lost_after

    def poll(self, now: float) -> PeerFailedError | None:
        if self.down_since is None or self.hosted_here:
            return None
        if now >= self.next_check:
            self.next_check = now + self.check_every
            found = self.evidence()
            if found is None:
                # The port answers: the store is slow, not gone. A new silence starts with the next
                # failed call, so that the time already spent is never counted as evidence; its
                # first check waits (the store's server pays for each check it accepts).
                self.down_since, self.checks, self.found = None, 0, None
                self.next_check = now + self.hold
                self.hold = min(MAX_CHECK_HOLD, 2 * self.hold)
                return None
            self.found = found
            self.checks += 1
        if self.found is None or self.checks < 2 or now - self.down_since < self.lost_after:
            return None
        silence = f"the store has not answered for {now - self.down_since:.1f} s ({self.last_error}) and {self.found}"
        if self.store_rank is None:  # a store on a host of its own: no rank is to blame
            return store_lost(self.store_at, silence)
        message = f"rank {self.store_rank} (pid {self.store_pid}, hosts the c10d store) lost: {silence}"
        record = FailureRecord.declared(rank=self.store_rank, kind=FailureKind.PEER_LOST, message=message, by=self.by,
                                        pid=self.store_pid)
        return PeerFailedError(record=record)


class WakeEvent(threading.Event):
    """A ``threading.Event`` whose ``set()`` also wakes a thread sleeping in ``poll()`` on :meth:`fileno`."""

    def __init__(self) -> None:
        super().__init__()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

    def fileno(self) -> int:
        return self._read_fd

    def set(self) -> None:
        super().set()
        with contextlib.suppress(OSError):  # already readable (or closed at teardown): nothing to wake
            os.write(self._write_fd, b"x")

    def __del__(self) -> None:
        for fd in (getattr(self, "_read_fd", None), getattr(self, "_write_fd", None)):
            with contextlib.suppress(OSError, TypeError):
                os.close(fd)


class PidWatcher:
    """Sleep until one of ``pids`` (same host) ends or ``wake`` is set. A pidfd becomes readable when
    its process exits; pids without one (gone already, or no pidfds here) are checked every ``fallback`` s."""

    def __init__(self, pids: list[int], wake: WakeEvent, fallback: float) -> None:
        self.wake, self.fallback, self._checked_once = wake, fallback, False
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self.polled: list[int] = []  # pids without a pidfd: checked every ``fallback`` seconds
        self._poll = select.poll()
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                self.polled.append(pid)
                continue
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)
        self._poll.register(wake.fileno(), select.POLLIN)
        self._pidfd_only = not self.polled

    def wait(self) -> bool:
        """Block until a watched pid ended (True: also first, and every ``fallback`` s with pids that have
        no pidfd) or ``wake`` was set (False)."""
        if not self._checked_once:
            self._checked_once = True
            return True
        if self.wake.is_set():
            return False
        ready = self._poll.poll(None if self._pidfd_only else max(0, int(self.fallback * 1000)))
        ended = [fd for fd, _ in ready if fd in self._fds]
        for fd in ended:  # it stays readable: from now on that pid is checked every ``fallback``
            self._poll.unregister(fd)
            self.polled.append(self._fds.pop(fd))
            os.close(fd)
            self._pidfd_only = False
        return bool(ended) or (bool(self.polled) and not self.wake.is_set())

    def close(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}


class Watchdog:
    """One per process and process group; a :class:`~..core.session.Session` starts it by reference count."""

    def __init__(self, session: Session, *, hang_timeout: timedelta | str | None = None) -> None:
        cfg = session.config
        self.session, self.rank, self.interval = session, session.rank, cfg.interval
        self.hang_timeout = config.check_hang_timeout(hang_timeout)
        self.exit_grace, self.write_grace = cfg.exit_grace, cfg.write_grace
        self.unobserved = autohang.Unobserved()  # what the hang probes leave out of a piece's time
        self._progress: tuple[float, float, int | None] = (time.monotonic(), time.time(), None)
        #: The first iteration completed: ``hang_timeout`` applies from then on, ``FTH_START_TIMEOUT_SEC`` before.
        self.warm = False
        self._first_step: int | None = None
        self._quiet_since: tuple | None = None  # the progress when this rank learned the job failed
        self._failed_seen = (session.failure.delivered, session.failure.moves)
        self._stop = WakeEvent()  # its set() also wakes the liveness loop's poll()
        self._finishing, self._store_warned_at = False, -STORE_WARN_EVERY
        store_timeout = timedelta(seconds=max(1.0, 5 * self.interval.total_seconds()))
        # Connected by the loops that use them, never by the main thread (a slow connect at start
        # would hold up its first collective); the pid loop's connects on its first declaration.
        self._conn = session.connection("watchdog", store_timeout, backoff=True)
        self._schema = Schema(self._conn, session.schema.world_size)
        self._liveness_conn = session.connection("liveness", LIVENESS_STORE_TIMEOUT, backoff=True)
        self._liveness_schema = Schema(self._liveness_conn, session.schema.world_size)
        self._answered = False  # the store loop's first call returned: a failed connect before is no news
        limit = cfg.heartbeat_timeout
        if isinstance(self.hang_timeout, timedelta):
            limit = min(limit, self.hang_timeout + SILENT_MARGIN)
        # Under recover_in_place a record is due at once unless the main thread is in an agreement: a
        # raise anywhere else (a step's collectives, the peer will not join them) cost every raise the
        # whole grace, and the recovery tears the groups down whichever way the record is taken.
        self.records = RecordsProbe(self._schema, self.rank, RELEASE_GRACE.total_seconds(),
                                    lambda: session.delivered, start=session.consumed, stale=session.stale,
                                    at_once=lambda: attempts.recovering() and not session.agreeing)
        self.liveness = LivenessProcess(session, period=HEARTBEAT_EVERY.total_seconds(), limit=limit.total_seconds(),
                                        unacked_after=cfg.unacked_after.total_seconds())
        self.self_hang = self.auto_hang = None  # auto_hang: the learned deadline of hang_timeout="auto"
        if self.hang_timeout == config.AUTO:
            self.self_hang = self.auto_hang = autohang.from_config(self.rank, os.getpid(), main_thread_frame,
                                                                   host=session.host, unobserved=self.unobserved)
        elif self.hang_timeout is not None:
            self.self_hang = SelfHangProbe(self.rank, os.getpid(), self.hang_timeout.total_seconds(),
                                           margin=SILENT_MARGIN.total_seconds(), progress=lambda: self._progress,
                                           frame=main_thread_frame, host=session.host,
                                           start_timeout=cfg.start_timeout.total_seconds(), warm=lambda: self.warm,
                                           unobserved=self.unobserved)
        store_rank = session.store_rank
        self.store_loss = StoreLossProbe(cfg.store_lost_after.total_seconds(), by=self.rank, store_rank=store_rank,
                                         store_pid=session.table.pid_of(store_rank) if store_rank is not None
                                         else 0, hosted_here=session.hosts_store,
                                         store_at=":".join(map(str, session.store_address or ())),
                                         evidence=lambda: session.store_evidence(STORE_EVIDENCE_TIMEOUT),
                                         check_every=max(STORE_CHECK_EVERY, self.interval.total_seconds()))
        peers = session.table.same_host_peers()
        self.peer_pids = (PeerPidProbe(peers, by=self.rank, host=session.host,
                                       after_failure=lambda: session.failure.delivered,
                                       left=self._liveness_schema.has_left) if peers else None)
        self._thread = threading.Thread(target=self._run_store_loop, name="fth-watchdog", daemon=True)
        self._liveness = threading.Thread(target=self._run_liveness_loop, name="fth-pids", daemon=True)

    # -- main-thread API ------------------------------------------------------------------------------
    def start(self) -> Watchdog:
        global _exit_hook_registered
        if not _exit_hook_registered:  # registered after torch's own exit hooks: runs before them
            _exit_hook_registered = True
            atexit.register(_stop_all)
        _running.add(self)
        self.liveness.start()
        self._thread.start()
        if self.peer_pids is not None:
            self._liveness.start()
        return self

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def store_ops(self) -> int:  # for bench/overhead.py, bench/watchdog_scale.py
        return self._conn.calls + self._liveness_conn.calls

    def stop(self, join_timeout: float | None = None, *, keep_liveness: bool = False) -> None:
        """A clean end; ``keep_liveness``: the liveness helper goes on until its owner stops it."""
        self._finishing = True
        self._stop.set()
        timeout = join_timeout if join_timeout is not None else 2 * self.interval.total_seconds() + 2
        threads = (self._thread, self._liveness)
        for thread in threads:
            if thread.is_alive() and threading.current_thread() is not thread:
                thread.join(timeout=timeout)
        if not any(thread.is_alive() for thread in threads):
            self._conn.close()
            self._liveness_conn.close()
        if not keep_liveness:
            self.liveness.stop()
        _running.discard(self)

    def beat(self, step: int | None = None, *, completed: bool = False, named: int | None = None) -> None:
        """The main thread made progress; ``completed``: an iteration completed (so did one whose step
        differs from the first beaten); ``named``: the step a report names, where it is not ``step``."""
        self._progress = (time.monotonic() - self.unobserved.seconds, time.time(), step if named is None else named)
        if not self.warm and step is not None:
            if self._first_step is None:
                self._first_step = step
            completed = completed or step != self._first_step
        if completed:
            self.warm = True

    # -- loops --------------------------------------------------------------------------------------
    def _run_store_loop(self) -> None:
        period = self.interval.total_seconds()
        while True:
            waited_from = time.monotonic()
            if self._stop.wait(period):
                break
            now = time.monotonic()
            self.unobserved.waited(now - waited_from, period)
            try:
                if self.session.failure.peer_error is None:
                    self._found(self.records.poll(now), None)  # records read: published already
                self.store_loss.answered()
                self._conn.deadline = None
                self._answered = True
            except Exception as err:  # noqa: BLE001 - the store host is gone, or worse
                if self._finishing or self._stop.is_set():
                    return
                if self.store_loss.failed(now, err):
                    if not self._answered:  # still connecting at start (many ranks, a busy host): no warning
                        log(logging.DEBUG, "the c10d store has not answered yet: %s", self.store_loss.last_error)
                    elif now >= self._store_warned_at + STORE_WARN_EVERY:  # a slow store: once in a while
                        self._store_warned_at = now
                        log(logging.WARNING, "the c10d store did not answer: %s", self.store_loss.last_error)
                    self._conn.deadline = self.store_loss.declare_at()
            if self.session.failure.peer_error is None:
                # the time after the calls: a call that timed out took most of a period's budget
                self._found(self.store_loss.poll(time.monotonic()), None)
            if self.self_hang is not None and self._judges_hangs():
                self._found(self.self_hang.poll(now), self._schema)
        log(logging.DEBUG, "watchdog stopped")

    def _judges_hangs(self) -> bool:
        """Not from the moment this rank knows the job failed until its next beat (handling a failure is no hang)."""
        failure = self.session.failure
        seen = (failure.delivered, failure.moves)
        failed_now = seen != self._failed_seen
        self._failed_seen = seen
        if failure.peer_error is not None or failure.local or failed_now:
            self._quiet_since = self._progress
        return self._progress is not self._quiet_since

    def _run_liveness_loop(self) -> None:
        watcher = PidWatcher([pid for _, pid in self.peer_pids.peers], self._stop, self.interval.total_seconds())
        try:
            while True:
                ended = watcher.wait()
                if self._stop.is_set() or self.session.failure.peer_error is not None:
                    break
                if ended:
                    self._found(self.peer_pids.poll(time.monotonic()), self._liveness_schema)
        finally:
            watcher.close()

    # -- findings ------------------------------------------------------------------------------------
    def _found(self, err: PeerFailedError | None, schema: Schema | None) -> None:
        """What a probe found; a record it declared is published in ``schema`` (``None``: not at all)."""
        if err is None or self._finishing:
            return
        if (self.session.failure.delivered and err.kind in (FailureKind.PEER_SILENT, FailureKind.PEER_LOST,
                                                            FailureKind.STORE_LOST)
                and not (err.ended is not None and err.ended.killed)):
            # The job already failed here: peers ending (and their heartbeats stopping) is expected.
            log(logging.INFO, "after the failure: %s", first_line(err, None))
            return
        log(logging.ERROR, "%s", first_line(err, None), step=self._progress[2])
        if err.kind is FailureKind.RANK_HUNG and err.failed_rank == self.rank:  # this rank is hung: it ends
            self.session.failure.failed_here(err.record, told=False)  # the main thread is interrupted
            hooks.emit(hooks.RANK_FAILED, err.record)  # the launchers: torchrun's error file
            self._declare(err, schema)
            # Recovering in place: interrupt the main thread where it hangs (in Python it leaves at
            # once); if it does not reach the recovery in time (stuck in C), end as without recovery.
            interrupt = hooks.provider(hooks.INTERRUPT)  # recovering in place: the recovery's
            left = None if interrupt is None else interrupt(HangInterrupted(first_line(err, None)))
            if left is not None and self._interrupted(left):
                log(logging.WARNING, "the hung main thread was interrupted: recovering in place")
                return
            # Give the peers a moment to read the record, then end: the main thread cannot be trusted.
            time.sleep(min(1.0, self.exit_grace.total_seconds()))
            self._reported_exit(err, EXIT_HUNG)
            return
        # Escalate first: publishing may block when the store is what died.
        incident = self.session.take_peer_failure(err)
        if incident is not None:
            threading.Thread(target=self._escalate, args=(incident,), name="fth-escalate", daemon=True).start()
        self._declare(err, schema)
        hooks.emit(hooks.JOB_FAILED, self.session)  # the launchers: torchrun's attempt keys, once declared

    @staticmethod
    def _interrupted(left: threading.Event) -> bool:
        """Whether the interrupted main thread reached the recovery (``left``) within INTERRUPT_WAIT (past a
        deferred section's bound), the interrupt sent again every INTERRUPT_RESEND meanwhile."""
        deadline = time.monotonic() + INTERRUPT_WAIT
        while True:
            now = time.monotonic()
            held = interrupts.deferred_until()
            if held is not None:
                deadline = max(deadline, held + INTERRUPT_WAIT)
            if left.wait(max(0.0, min(INTERRUPT_RESEND, deadline - now))):
                return True
            if time.monotonic() >= deadline:
                return False
            interrupts.interrupt(None)  # sent again, while still pending

    def _declare(self, err: PeerFailedError, schema: Schema | None) -> None:
        if err.origin != "declared" or schema is None:
            return
        try:
            if schema.claim_declaration(err.failed_rank):
                schema.publish(err.record)
        except Exception as problem:  # noqa: BLE001 - the store may be what died
            log(logging.WARNING, "could not publish %s: %s", err.exc_type, first_line(problem))

    def _escalate(self, incident: Incident) -> None:
        """Release this process's collectives; a main thread that does not take the failure within
        ``exit_grace`` (and a checkpoint write), or is found blocked where only its group's timeout ends
        the call (:class:`BlockedMainProbe`), ends with a report. No store call: it may be what died."""
        if incident.local or incident.acknowledged.is_set() or self._finishing:
            return
        what = self.session.release_collectives()
        log(logging.WARNING, "released blocked collectives: %s", what, step=self._progress[2])
        blocked = self._taken_or_blocked(incident)
        if blocked is None:
            return
        if blocked:
            self._reported_exit(incident.peer_error, EXIT_PEER_FAILED, stuck=main_thread_frame(), blocked=True)
        deadline, wrote = time.monotonic() + self.write_grace.total_seconds(), False
        while writing_now(main_thread_frame()) and time.monotonic() < deadline:
            if not wrote:
                log(logging.WARNING, "waiting for the checkpoint being written before ending this process")
                wrote = True
            if incident.acknowledged.wait(0.05):
                return
        if wrote and incident.acknowledged.wait(self.exit_grace.total_seconds()):
            return  # the write finished and the main thread took the failure at its next step
        if incident.local or self._finishing or incident.acknowledged.is_set():
            return
        self._reported_exit(incident.peer_error, EXIT_PEER_FAILED, stuck=main_thread_frame())

    def _taken_or_blocked(self, incident: Incident) -> bool | None:
        """Wait up to ``exit_grace`` for the main thread to take the failure: ``None`` once it has,
        ``True`` as soon as it is blocked where only its group's timeout ends the call, ``False`` after."""
        probe = BlockedMainProbe(BLOCKED_BEYOND_RELEASE.total_seconds())
        deadline = time.monotonic() + self.exit_grace.total_seconds()
        while True:
            now = time.monotonic()
            if incident.acknowledged.wait(max(0.0, min(0.1, deadline - now))):
                return None
            now = time.monotonic()
            if now >= deadline:
                return False
            if probe.poll(now) and not writing_now(main_thread_frame()):
                return None if incident.acknowledged.is_set() or incident.local or self._finishing else True

    def _reported_exit(self, err: BaseException, code: int, stuck=None, blocked: bool = False) -> None:
        """End the process with ``code`` and a report; ``stuck``: the frame of a main thread that did not
        take it (``blocked``: found blocked where only its group's timeout ends the call, before the grace)."""
        text = f"[rank {self.rank}] fault-tolerant-handlers: ending this process (exit code {code}) because:\n{err}\n"
        if stuck is not None:
            stack = cap_tail("".join(traceback.format_stack(stuck)), MAX_TRACEBACK_CHARS)
            if blocked:
                text += (f"[rank {self.rank}] its main thread is blocked in a call that only its group's timeout "
                         f"ends: it ran nothing for {BLOCKED_BEYOND_RELEASE.total_seconds():g} s after its collectives "
                         f"were released and every released connection is closed (gloo leaves a send queued on a "
                         f"closed connection waiting); it was at:\n{stack}")
            else:
                text += (f"[rank {self.rank}] its main thread did not take the failure within "
                         f"{self.exit_grace.total_seconds():g} s (FTH_EXIT_GRACE_SEC) after its collectives were "
                         f"released; it was at:\n{stack}")
        try:
            # the launchers: torchrun's error file of a survivor, mp.spawn's (the parent raises this report)
            hooks.emit(hooks.EXITING, self.session.table, err, code)
            log(logging.CRITICAL, "ending this process with exit code %d: %s", code, first_line(err, None))
            sys.stderr.write(text)
            for stream in [sys.stderr, sys.stdout] + logging.getLogger().handlers + hooks.logger.handlers:
                with contextlib.suppress(Exception):
                    stream.flush()
            for child in multiprocessing.active_children():  # DataLoader workers, among others
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(child.pid, signal.SIGKILL)
            kill_all_liveness()
        finally:
            os._exit(code)


#: Running watchdogs (weakly held: a stopped one is dropped, with its connections).
_running: weakref.WeakSet[Watchdog] = weakref.WeakSet()
_exit_hook_registered = False


def _stop_all() -> None:
    """Stop every watchdog before the interpreter finalizes (a daemon thread in a torch C++ call then aborts it)."""
    deadline = time.monotonic() + 2.0
    watchdogs = list(_running)
    for watchdog in watchdogs:
        watchdog._finishing = True
        watchdog._stop.set()
    # no uncaught exception (printed: sys.last_value set): the script ran to its end; this rank is not lost
    if getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None:
        for watchdog in watchdogs:
            watchdog.session.leave()  # (not when its job failed)
    failed = [w.session for w in watchdogs if w.session.failure.failing]
    if failed:
        # The job failed, perhaps because the store's host is gone: a watchdog waiting in a store
        # call would hold the exit up to its budget. Cut those calls short instead.
        stop_connecting()  # the store may be gone: no call may start a connect the exit would wait for
        unblock_stuck_calls(set().union(*(s.keep_ports for s in failed)), wait=0.5, busy_too=True)
    for watchdog in watchdogs:
        watchdog.stop(join_timeout=max(0.0, deadline - time.monotonic()))


def start_watchdog(group=None, *, hang_timeout: timedelta | float | str | dict | None = None) -> Watchdog | None:
    """Start (once per process group, collectively: on every rank) and return the watchdog for a loop of
    your own; ``None`` without distribution. With ``hang_timeout`` call ``beat(step)`` once per step;
    with ``"auto"``, ``auto_hang.mark("step", time.monotonic(), step)`` where each piece of work begins.

    Examples:
        .. code-block:: python

            wd = start_watchdog(hang_timeout=300)   # on every rank, once the process group is up
            for step, batch in enumerate(loader):
                if wd is not None:
                    wd.beat(step)
                train_step(batch)
    """
    hang_timeout = config.check_hang_timeout(hang_timeout, what="start_watchdog(hang_timeout=...)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"start_watchdog(group={group!r}): expected None (the default group) or a "
                        f"torch.distributed.ProcessGroup (e.g. dist.new_group(ranks))")
    session = get_session(group, caller="start_watchdog")
    inject.plain_injector()  # FTH_INJECT in a loop of your own: named at exit if nothing could fire it
    if session is None:
        return None
    return session.start_watchdog(hang_timeout)
