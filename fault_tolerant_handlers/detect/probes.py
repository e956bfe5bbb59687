"""The watchdog's probes: small, independent checks, each with ``poll(now) -> PeerFailedError | None``
(what this rank's main thread must raise; a record the probe declares is its ``record``). Each takes
the time from its caller (a unit test drives it with a fake clock), reaches the job only through what
it is given (a :class:`~..core.schema.Schema`, a pid table, callables) and starts no thread or process.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Callable, Container

from ..core import procfs
from ..core.procfs import PeerPidProbe  # noqa: F401 - the core's own probe, re-exported
from ..core.config import (HEARTBEAT_TIMEOUT_ENV, LEFT_CHECK_EVERY, MAX_CHECK_HOLD, SILENCE_POLL, SUSPECT_SILENCE,
                           WITNESS_EVERY)
from ..core.errors import PeerFailedError
from ..core.failure import MAX_TRACEBACK_CHARS, FailureKind, FailureRecord, cap_tail
from ..core.hooks import first_line, log
from ..core.schema import Schema

if TYPE_CHECKING:
    from .witness import Link


class RecordsProbe:
    """Failure records of other ranks that no sync point took (``delivered()``) within ``grace``
    seconds; at once for a record declaring a rank lost or silent (no agreement can take it without it)."""

    def __init__(self, schema: Schema, rank: int, grace: float, delivered: Callable[[], Container[int]],
                 start: int = 0, stale: Callable[[FailureRecord], bool] = lambda record: False) -> None:
        self.schema = schema
        self.rank = rank
        self.grace = grace
        self.delivered = delivered
        self.stale = stale  # late news of a failure already agreed on: not a new failure
        self.seen = start
        self.pending: dict[int, float] = {}  # index -> first seen

    def poll(self, now: float) -> PeerFailedError | None:
        count = self.schema.count()
        for index in self.schema.new_indices(self.seen, count):
            record = self.schema.read(index)
            gone = record is not None and record.kind in (FailureKind.PEER_LOST, FailureKind.PEER_SILENT)
            self.pending.setdefault(index, now - self.grace if gone else now)
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
        if records:
            return PeerFailedError.from_records(records)
        return None


class HeartbeatProbe:
    """Its own heartbeat (``beats``), and one watched rank's: a watched rank whose counter stands still
    for ``limit`` seconds of **observed** time (once it has beaten at all) is declared silent.

    Observed time is the time between two polls that both got their answers, at most
    :data:`OBSERVED_GAP` periods apart: while this rank's own calls fail or are slow, the watched
    rank's beats may be slow for the same reason. A watched rank that stopped its watchdog cleanly
    (``left/<rank>``) is neither warned about nor declared. On another host, ``link`` (a
    :class:`~.witness.Link` to its helper) is a second witness: a rank still for :data:`SUSPECT_SILENCE`
    whose host acknowledged nothing for ``unacked_after`` seconds is declared then."""

    def __init__(self, schema: Schema, rank: int, successor: int | None, successor_pid: int, *, period: float,
                 limit: float, host: str = "", running: Callable[[], bool] | None = None, beats: bool = True,
                 link: Link | None = None, unacked_after: float = math.inf) -> None:
        self.link = link
        self.unacked_after = unacked_after
        self.send_at = 0.0  # the next byte on the link
        self.host = host
        self.beats = beats  # this probe beats this rank's own heartbeat (one probe of a helper's does)
        #: For a successor on this host: True while its process runs (not stopped, not gone). Its
        #: silence is then no evidence (its beats are only late); its death is the pid probe's.
        self.running = running
        self.schema = schema
        self.rank = rank
        self.successor = successor
        self.successor_pid = successor_pid
        self.period = period
        self.limit = limit
        self.next_at = 0.0  # the next read of the watched rank's counter
        self.beat_at = 0.0  # the next beat of this rank's own (``beats``)
        self.value = -1  # the successor's counter as last read
        self.stood = False  # the last read found it where the read before had
        self.silent = 0.0  # observed time it has stood still
        self.answered_at: float | None = None  # the last poll that got its answers
        self.warned = False  # this silence passed NEAR_MISS of the limit (logged once)
        self.left = False  # the watched rank left cleanly (its counter has not moved since)
        self.left_checked_at: float | None = None

    def due(self) -> float:
        due = min(self.next_at, self.beat_at) if self.beats else self.next_at
        return min(due, self.send_at) if self.link is not None else due

    def poll(self, now: float) -> PeerFailedError | None:
        if self.beats and now >= self.beat_at:
            # on its cadence, whatever the reads in between (a beat more than a period late starts anew)
            self.beat_at = self.beat_at + self.period if now - self.beat_at < self.period else now + self.period
            self.schema.beat(self.rank)
        if self.link is not None and now >= self.send_at:
            self.send_at = now + WITNESS_EVERY.total_seconds()
            self.link.send(now)  # its host's kernel acknowledges it, whatever its processes do
        if now < self.next_at:
            return None
        self.next_at = now + self.period
        if self.successor is None:
            return None
        value = self.schema.heartbeat_of(self.successor)
        previous, self.answered_at = self.answered_at, now
        stood, self.stood = self.stood, value == self.value
        if value != self.value:
            if self.warned:
                log(logging.INFO, "rank %d's heartbeat moves again after %.1f s of observed silence",
                    self.successor, self.silent)
            self.value, self.silent, self.warned, self.left, self.left_checked_at = value, 0.0, False, False, None
            if self.link is not None and value > 0:
                self.link.ready(now)  # connected ahead of a silence (its address is published before its first beat)
            if self.running is None:
                # On another host: the next read lands just before the next beat is due, then every
                # SILENCE_POLL until it moves, so a silence counts from within SILENCE_POLL of the last beat.
                self.next_at = now + (self.period - SILENCE_POLL if stood else SILENCE_POLL)
            return None
        if value > 0 and not self.left and self.running is None:  # standing still: read again soon,
            self.next_at = now + SILENCE_POLL  # and declared within SILENCE_POLL past the limit
        if previous is not None and now - previous <= OBSERVED_GAP * self.period:
            self.silent += now - previous
        if value <= 0 or self.left or self.silent < min(NEAR_MISS * self.limit, SUSPECT_SILENCE) or self._has_left(now):
            return None  # not beaten yet, still too briefly to judge, or it finished first
        if self.running is not None and self.running():
            return None  # on this host and running: its beats are only late
        on = f" on {self.host}" if self.host else ""
        unacked = self.link.unacked_for(now) if self.link is not None else 0.0
        if self.silent >= SUSPECT_SILENCE and unacked >= self.unacked_after:
            return self._declare(f"no heartbeat for {self.silent:.1f} s, and its host acknowledged nothing sent to it "
                                 f"for {unacked:.1f} s (its host or link is down)")
        if self.silent < NEAR_MISS * self.limit:
            return None
        if not self.warned:
            # the margin an operator should see: a live rank this close to the limit is a loaded
            # machine or a lossy link, and a lower FTH_HEARTBEAT_TIMEOUT_SEC would be a false alarm
            self.warned = True
            log(logging.WARNING, "rank %d's heartbeat (pid %d%s) has stood still for %.1f s of observed time; "
                "it is declared at %g s (%s)%s", self.successor, self.successor_pid, on, self.silent, self.limit,
                HEARTBEAT_TIMEOUT_ENV, f"; its host acknowledged nothing for {unacked:.1f} s" if unacked else "")
        if self.silent > self.limit:
            return self._declare(f"no heartbeat for {self.silent:.1f} s (its host or link is down, or its process is "
                                 "gone or frozen)")
        return None

    def _declare(self, why: str) -> PeerFailedError:
        on = f" on {self.host}" if self.host else ""
        message = f"rank {self.successor} (pid {self.successor_pid}{on}) lost: {why}"
        return PeerFailedError(record=FailureRecord.declared(
            rank=self.successor, kind=FailureKind.PEER_SILENT, message=message, by=self.rank,
            pid=self.successor_pid, host=self.host))

    def _has_left(self, now: float) -> bool:
        """The watched rank stopped its watchdog cleanly (asked at most every :data:`LEFT_CHECK_EVERY`)."""
        if self.left_checked_at is not None and now - self.left_checked_at < LEFT_CHECK_EVERY:
            return False
        self.left_checked_at = now
        self.left = self.schema.has_left(self.successor)
        if self.left:
            log(logging.DEBUG, "rank %d stopped watching cleanly: its silence is not a failure", self.successor)
        return self.left


#: :class:`HeartbeatProbe`: a silence this fraction of the limit long is logged (a warning, once),
#: so that a margin grown thin shows before it becomes a false alarm.
NEAR_MISS = 0.5


#: :class:`HeartbeatProbe`: two answered polls at most this many periods apart observe the time
#: between them; a longer gap (its own calls failed or were slow) is not counted as silence.
OBSERVED_GAP = 3


#: Where a main thread waits for its peers rather than being hung itself (innermost frames).
WAITING_MARKERS = (
    f"torch{os.sep}distributed{os.sep}",
    f"torch{os.sep}nn{os.sep}parallel{os.sep}",
    f"torch{os.sep}autograd{os.sep}",
    f"torch{os.sep}_tensor.py",
    f"fault_tolerant_handlers{os.sep}core{os.sep}session.py",
    f"fault_tolerant_handlers{os.sep}core{os.sep}sections.py",
    f"ignite{os.sep}distributed{os.sep}",
)


def waiting_on_peers(frame) -> bool:
    """True when the innermost Python frames are a collective or a backward pass (DDP all_reduce)."""
    depth = 0
    while frame is not None and depth < 4:
        if any(marker in frame.f_code.co_filename for marker in WAITING_MARKERS):
            return True
        frame = frame.f_back
        depth += 1
    return False


class SelfHangProbe:
    """This rank's main thread made no progress (``progress()``: monotonic time, wall time and step of
    the last beat) for ``hang_timeout``, and is not merely waiting in a collective (then the hung rank
    is the peer, which declares itself): ``RankHung`` with the main thread's stack.

    Time seen waiting is not held against it; a wait of ``2 x hang_timeout + margin`` is declared all
    the same (no rank declared itself: one stuck in C holding the GIL). Until ``warm()`` (the first
    iteration completed) the deadline is ``start_timeout``: a slow start is not a hang."""

    def __init__(self, rank: int, pid: int, hang_timeout: float, *, margin: float,
                 progress: Callable[[], tuple[float, float, int | None]], frame: Callable[[], object],
                 host: str = "", start_timeout: float | None = None, warm: Callable[[], bool] = lambda: True) -> None:
        self.rank = rank
        self.pid = pid
        self.host = host
        self.hang_timeout = hang_timeout
        self.start_timeout = hang_timeout if start_timeout is None else start_timeout
        self.warm = warm
        self.margin = margin
        self.progress = progress
        self.frame = frame
        self._waited: tuple[tuple, float] | None = None  # (the progress then, when) last seen waiting on peers

    def poll(self, now: float) -> PeerFailedError | None:
        progress = self.progress()
        last, last_wall, step = progress
        warm = self.warm()
        limit = self.hang_timeout if warm else self.start_timeout
        stalled = now - last
        frame = self.frame()
        if waiting_on_peers(frame):
            self._waited = (progress, now)
            if stalled < 2 * limit + self.margin:
                return None
        elif now - (self._waited[1] if self._waited is not None and self._waited[0] is progress else last) < limit:
            return None
        at = f" at step {step}" if step is not None else ""
        before = "" if warm else " before its first iteration completed (the start's deadline)"
        return hung_error(self.rank, self.pid, self.host, frame, f"its main thread made no progress for "
                            f"{stalled:.1f} s{at}{before}", int(last_wall * 1000), step)


def hung_error(rank: int, pid: int, host: str, frame, what: str, time_ms: int, step: int | None) -> PeerFailedError:
    """This rank declares itself hung (``rank 1 (pid 42 on node-b) hung: {what}``), with its stack from ``frame``."""
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(main thread stack unavailable)\n"
    who = f"rank {rank} (pid {pid} on {host})" if host else f"rank {rank}"
    record = FailureRecord.declared(
        rank=rank, kind=FailureKind.RANK_HUNG, message=f"{who} hung: {what}", by=rank, pid=pid, host=host,
        traceback=f"Main thread stack of rank {rank}:\n{cap_tail(stack, MAX_TRACEBACK_CHARS - 40)}",
        time_ms=time_ms, step=step)
    return PeerFailedError(record=record)


def main_thread_frame():
    return procfs.main_thread_frame()


class StoreLossProbe:
    """The store did not answer: its host is declared lost only on **evidence** that the store is
    gone, never because its answers are slow.

    Failed store calls start a silence (:meth:`failed`); during it, ``evidence()`` (a plain TCP
    connect to the store's port: a string when refused or unreachable, ``None`` when it answered) is
    asked at most every ``check_every`` seconds. The rank hosting the store is declared lost when the
    silence has lasted ``lost_after`` seconds **and** every check in it, at least two, found evidence
    (no rank on the store's host: ``StoreLost``). A port that answers ends the evidence: a slow store
    is not a lost one. A process that hosts the store (``hosted_here``) never declares it lost.

    Each check is a connection c10d's server accepts, with a reverse DNS lookup in its only thread,
    so after a port that answered the next check waits twice as long, up to :data:`MAX_CHECK_HOLD`.
    """

    def __init__(self, lost_after: float, *, by: int, store_rank: int | None = 0, store_pid: int = 0,
                 evidence: Callable[[], str | None] = lambda: None, check_every: float = 0.5,
                 hosted_here: bool = False, store_at: str = "") -> None:
        self.lost_after = lost_after
        self.by = by
        self.store_rank = store_rank
        self.store_pid = store_pid
        self.evidence = evidence
        self.check_every = check_every
        self.hosted_here = hosted_here
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
            at = f" at {self.store_at}" if self.store_at else ""
            return PeerFailedError(None, FailureKind.STORE_LOST.value, f"the c10d store{at}, on a host of no rank's, "
                                   f"is lost: {silence}", origin="declared", kind=FailureKind.STORE_LOST)
        message = f"rank {self.store_rank} (pid {self.store_pid}, hosts the c10d store) lost: {silence}"
        record = FailureRecord.declared(rank=self.store_rank, kind=FailureKind.PEER_LOST, message=message, by=self.by,
                                        pid=self.store_pid)
        return PeerFailedError(record=record)
