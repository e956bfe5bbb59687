"""Liveness that does not depend on the GIL (``docs/detection.md``): a helper process per rank
(``fth-liveness``), forked when the watchdog starts, beats ``hb/<rank>`` unless its rank is stopped,
says how its rank ended when a signal killed it (:func:`rank_ended`), and runs the
:class:`HeartbeatProbe` on its ring successor (every rank of the successor's host when it is another
host). It never runs the rank's exit hooks (``os._exit``).
"""

from __future__ import annotations

# The helper is forked while other threads of the rank run: a module one of them was importing then
# stays locked in the helper. Its store connect imports the idna codec on first use: imported here.
import encodings.idna  # noqa: F401
import contextlib
import dataclasses
import logging
import math
import os
import select
import signal
import threading
import time
from typing import TYPE_CHECKING, Callable

from ..core import hooks, procfs as _procfs
from ..core.config import (HEARTBEAT_TIMEOUT_ENV, HELPER_STORE_TIMEOUT, LEFT_CHECK_EVERY, OBSERVED_GAP,  # timings:
                           RANK_EXIT_WAIT, SILENCE_POLL, SUSPECT_SILENCE, WITNESS_EVERY, ZOMBIE_HOLD)  # the table in core.config
from ..core.hooks import log
from ..core.procfs import RankTable
from ..core.failure import FailureKind, FailureRecord, PeerFailedError
from ..core.schema import Schema
from . import witness

if TYPE_CHECKING:
    from ..core.session import Session


class HeartbeatProbe:
    """Its own heartbeat (``beats``), and one watched rank's: a counter that stands still for ``limit``
    seconds of **observed** time (between two answered polls at most :data:`~..core.config.OBSERVED_GAP` periods
    apart: a slow store is no silence), once it has beaten, is declared silent; a rank that left
    cleanly (``left/<rank>``) never is. On another host, ``link`` (:class:`~.witness.Link`) is a second
    witness: still for :data:`SUSPECT_SILENCE` while its host acknowledged nothing for ``unacked_after``."""

    def __init__(self, schema: Schema, rank: int, successor: int | None, successor_pid: int, *, period: float,
                 limit: float, host: str = "", running: Callable[[], bool] | None = None, beats: bool = True,
                 link: witness.Link | None = None, unacked_after: float = math.inf) -> None:
        self.schema, self.rank, self.successor, self.successor_pid = schema, rank, successor, successor_pid
        self.period, self.limit, self.host, self.link, self.unacked_after = period, limit, host, link, unacked_after
        self.beats = beats  # this probe beats this rank's own heartbeat (one probe of a helper's does)
        #: For a successor on this host: True while its process runs (not stopped, not gone). Its
        #: silence is then no evidence (its beats are only late); its death is the pid probe's.
        self.running = running
        self.send_at = 0.0  # the next byte on the link
        self.next_at = 0.0  # the next read of the watched rank's counter
        self.beat_at = 0.0  # the next beat of this rank's own (``beats``)
        self.value = -1  # the successor's counter as last read
        self.stood = False  # the last read found it where the read before had
        self.silent = 0.0  # observed time it has stood still
        self.answered_at: float | None = None  # the last poll that got its answers
        self.warned = False  # this silence passed NEAR_MISS of the limit (logged once)
        self.left = False  # the watched rank left cleanly (its counter has not moved since)
        self.left_checked_at: float | None = None
        self.declared = False  # its silence was declared (once)

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

    def look(self) -> None:
        """One poll (and the beat): a silent rank is declared once; a store that does not answer is the
        rank's watchdog's to judge, and the poll is tried again a period later."""
        try:
            silent = self.poll(time.monotonic())
            if silent is not None and not self.declared:
                self.declared = True
                if self.schema.claim_declaration(silent.failed_rank):
                    self.schema.publish(silent.record)
        except Exception:  # noqa: BLE001 - the store is unreachable
            self.next_at = time.monotonic() + self.period

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


#: A silence this fraction of the limit long is logged (once): a margin grown thin shows before a false alarm.
NEAR_MISS = 0.5


def _stopped(pid: int) -> bool:  # SIGSTOP
    fields = _procfs.stat_fields(pid)
    return bool(fields) and fields[_procfs.STATE] in ("T", "t")


def _running(pid: int) -> bool:  # neither gone, a zombie, nor stopped
    fields = _procfs.stat_fields(pid)
    return _procfs.is_running(fields) and fields[_procfs.STATE] not in ("T", "t")


def _run(table: RankTable, schema: Schema, parent: int, stop_fd: int, period: float, limit: float,
         address: str = "", unacked_after: float = math.inf) -> None:
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write("fth-liveness")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the rank; its end ends this process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # The rank's end is watched by a thread of its own, blocked on nothing else: the beat below can
    # be inside a store call for its budget, and a killed rank's exit status is readable only until
    # its launcher reaps it (torchrun's agent looks every 0.1 s).
    woken = threading.Event()
    calls = threading.Lock()  # one store call at a time on the helper's one connection

    def tell(record: FailureRecord) -> None:  # the rank's peers, on every host, learn it within a poll
        with calls:
            # a keeper seen gone is news a peer's declaration of the same death (a same-host pid
            # check) does not carry: published whoever declared first
            if schema.claim_declaration(record.rank) or (record.ended is not None and record.ended.keeper_gone):
                schema.publish(record)

    ends = threading.Thread(target=_on_rank_end, args=(table, parent, stop_fd, woken, tell), name="fth-rank-end",
                            daemon=True)
    ends.start()
    probes = []
    for watched in table.watched() or [None]:  # the first probe beats this rank's heartbeat
        pid = table.pid_of(watched) if watched is not None else 0
        same_host = watched is not None and table.host_ids[table.ranks.index(watched)] == table.host_ids[table.group_rank]
        link = witness.Link(schema, watched) if watched is not None and not same_host else None
        probes.append(HeartbeatProbe(schema, table.rank, watched, pid, period=period, limit=limit,
                                     host=table.host_of(watched) if watched is not None else "",
                                     running=(lambda pid=pid: _running(pid)) if same_host else None, beats=not probes,
                                     link=link, unacked_after=unacked_after))
    listener = None
    if address and len(set(table.host_ids)) > 1:  # watched from another host
        try:
            listener = witness.Listener(address)
        except OSError as err:
            log(logging.WARNING, "no witness listener at %s (%s): a peer on another host judges this rank's "
                "silence by the heartbeat limit alone", address, err)
    # A first beat as soon as the store answers, whatever the rank's state: a rank frozen (SIGSTOP)
    # from its start is then seen by its neighbour, which judges only a heartbeat that began. Where
    # its watchers connect is published before it.
    while os.getppid() == parent:
        try:
            with calls:
                if listener is not None:
                    listener.publish(schema, table.rank)
                schema.beat(table.rank)
            break
        except Exception:  # noqa: BLE001 - connecting (backing off), or a busy store: try again
            time.sleep(period)
    others = list(range(1, len(probes)))
    while os.getppid() == parent:
        if not _stopped(parent):  # frozen: its neighbour must see it, so no beat
            beat_at = time.monotonic()
            with calls:
                probes[0].look()  # the beat, and the first watched rank
            # The other watched ranks (a host's, after its first) within the period, from a turning
            # start: however slow the store, this rank's own beat is never held up by more than
            # one of their reads, and each of them is read in turn.
            for i in others:
                if time.monotonic() - beat_at > period:
                    break
                with calls:
                    probes[i].look()
            others = others[1:] + others[:1]
            if listener is not None:
                listener.drain()
            # until the next beat or read is due: every period, or more often during a silence
            time.sleep(min(period, max(0.01, min(p.due() for p in probes) - time.monotonic())))
        else:
            time.sleep(period)
    # The rank is gone (this process was re-parented). The thread says how, unless it was not woken:
    # without pidfds, a DataLoader worker forked after this helper still holds the pipe.
    if woken.wait(0.1):
        ends.join(RANK_EXIT_WAIT + 2 * HELPER_STORE_TIMEOUT.total_seconds() + ZOMBIE_HOLD + 1.0)
    else:
        rank_ended(table.rank, parent, table.host, tell)


def _on_rank_end(table: RankTable, parent: int, stop_fd: int, woken: threading.Event,
                 tell: Callable[[FailureRecord], None] | None = None) -> None:
    """Until the rank closes the pipe or ends (its pidfd: a DataLoader worker may hold the pipe); then it ends."""
    watched = [stop_fd]
    with contextlib.suppress(OSError):  # no pidfds here: the pipe (or the loop's parent check)
        watched.append(os.pidfd_open(parent))
    select.select(watched, [], [])
    woken.set()
    try:
        rank_ended(table.rank, parent, table.host, tell)
    finally:
        os._exit(0)


def rank_ended(rank: int, pid: int, host: str, tell: Callable[[FailureRecord], None] | None = None) -> None:
    """The rank closed the helper's pipe or ended: if a signal it could not report killed it (or its
    keeper is gone too), say so to its launcher and its peers (``tell``: a ``PeerLost`` record)."""
    how = _procfs.ended(pid, RANK_EXIT_WAIT)  # None: the rank runs (it stopped its watchdog)
    if how is None:
        return
    keeper_pid = hooks.provider(hooks.KEEPER_PID)  # a keeper's child: the process that would replace it
    keeper = None if keeper_pid is None else keeper_pid()
    if keeper is not None and _procfs.ended(keeper, RANK_EXIT_WAIT) is not None:
        # its keeper died first (the child dies with it): it left its key behind, announced when the
        # rank started, and its peers would wait for a replacement that never comes
        how = dataclasses.replace(how, keeper_gone=True)
    if _procfs.unreported(how) or how.keeper_gone:
        record = FailureRecord.lost(rank=rank, pid=pid, host=host, why=how, by=rank)
        hooks.emit(hooks.RANK_KILLED, record)  # the launchers: torchrun's error file, first (the agent reaps soon)
        if tell is not None:
            with contextlib.suppress(Exception):  # the store may be gone with the rank (its host held it)
                tell(record)
    hooks.emit(hooks.RANK_ENDED, pid, rank, host)  # the launchers: under mp.spawn, its error file and the zombie held


class LivenessProcess:
    """The helper process of one rank; ``start()`` forks it, ``stop()`` ends it."""

    def __init__(self, session: Session, *, period: float, limit: float, unacked_after: float = math.inf) -> None:
        self.session, self.period, self.limit, self.unacked_after = session, period, limit, unacked_after
        self.pid: int | None = None
        self._stop_w: int | None = None

    def start(self) -> LivenessProcess:
        # Connected by the helper after the fork (a slow connect would hold up the rank's first collective)
        conn = self.session.connection("helper", HELPER_STORE_TIMEOUT, backoff=True)
        schema = Schema(conn, self.session.schema.world_size)
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        try:
            pid = _procfs.fork()  # its collector never runs a destructor of the rank's (a group's hangs)
        except OSError as err:
            os.close(read_fd)
            os.close(write_fd)
            log(logging.WARNING, "could not start the liveness process: %s", err)
            return self
        if pid == 0:  # the helper
            code = 0
            try:
                os.close(write_fd)
                _run(self.session.table, schema, parent, read_fd, self.period, self.limit, self.session.address,
                     self.unacked_after)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        os.close(read_fd)
        self.pid, self._stop_w = pid, write_fd
        _children.add(pid)
        return self

    def stop(self) -> None:
        if self._stop_w is not None:
            os.close(self._stop_w)
            self._stop_w = None
        if self.pid is not None:
            # It leaves its select() at once, but may be in a store call; once the job failed (the
            # store's host may be gone) it has nothing left to do: no wait.
            deadline = time.monotonic() + (0.0 if self.session.failure.failing else 0.5)
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                time.sleep(0.02)
            else:
                kill(self.pid)
            _children.discard(self.pid)
            self.pid = None


_children: set[int] = set()


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def kill_all() -> None:
    for pid in list(_children):
        kill(pid)
    _children.clear()
