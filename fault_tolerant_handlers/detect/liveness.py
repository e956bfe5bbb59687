"""Liveness that does not depend on the GIL: a helper process per rank (``fth-liveness``), forked when
the watchdog starts, so that a main thread holding the GIL in a long C call, or busy cores, never make
a healthy rank look lost. It beats ``hb/<rank>`` unless its rank is stopped (a frozen rank is
noticed), says how its rank ended when a signal killed it (:func:`rank_ended`), and runs the
:class:`~.probes.HeartbeatProbe` on its ring successor (every rank of the successor's host when it is
another host): a rank is declared lost on evidence of its silence, never of a slow answer. It never
runs the rank's exit hooks (``os._exit``).
"""

from __future__ import annotations

# The helper is forked while other threads of the rank run (the watchdog's connects among them): a
# module that one of them was importing at that moment stays locked in the helper for ever, and
# the helper's first import of it blocks. Its store connect resolves the store's host name, which
# imports the idna codec on first use: imported here, at the library's import, before any thread.
import encodings.idna  # noqa: F401
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
from ..core.config import HELPER_STORE_TIMEOUT, RANK_EXIT_WAIT, ZOMBIE_HOLD  # timings: the table in core.config
from ..core.hooks import log
from ..core.procfs import RankTable
from ..core.failure import FailureRecord
from ..core.schema import Schema
from . import witness
from .probes import HeartbeatProbe

if TYPE_CHECKING:
    from ..core.session import Session


def _stopped(pid: int) -> bool:
    fields = _procfs.stat_fields(pid)
    return bool(fields) and fields[_procfs.STATE] in ("T", "t")


def _running(pid: int) -> bool:
    """``pid`` (a rank on this host) runs: neither gone, a zombie, nor stopped (SIGSTOP)."""
    fields = _procfs.stat_fields(pid)
    return _procfs.is_running(fields) and fields[_procfs.STATE] not in ("T", "t")


def _run(table: RankTable, schema: Schema, parent: int, stop_fd: int, period: float, limit: float,
         address: str = "", unacked_after: float = math.inf) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write("fth-liveness")
    except OSError:
        pass
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
    declared = [False] * len(probes)
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
                _poll(probes[0], schema, declared, 0)  # the beat, and the first watched rank
            # The other watched ranks (a host's, after its first) within the period, from a turning
            # start: however slow the store, this rank's own beat is never held up by more than
            # one of their reads, and each of them is read in turn.
            for i in others:
                if time.monotonic() - beat_at > period:
                    break
                with calls:
                    _poll(probes[i], schema, declared, i)
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
    """Blocks until the rank stops its watchdog (closes the pipe) or ends (its pidfd: the pipe may
    also be held by a DataLoader worker forked after this helper), then ends the helper."""
    watched = [stop_fd]
    try:
        watched.append(os.pidfd_open(parent))
    except OSError:  # no pidfds here: the pipe (or the loop's parent check)
        pass
    select.select(watched, [], [])
    woken.set()
    try:
        rank_ended(table.rank, parent, table.host, tell)
    finally:
        os._exit(0)


def rank_ended(rank: int, pid: int, host: str, tell: Callable[[FailureRecord], None] | None = None) -> None:
    """The rank closed the helper's pipe or ended: if it died, say how where its launcher reads it (a
    killed rank writes nothing itself) and, for a signal it could not report or a keeper gone too, tell
    its peers (``tell``: a ``PeerLost`` record; on another host they would see only a silence)."""
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
            try:
                tell(record)
            except Exception:  # noqa: BLE001 - the store may be gone with the rank (its host held it)
                pass
    hooks.emit(hooks.RANK_ENDED, pid, rank, host)  # the launchers: under mp.spawn, its error file and the zombie held


def _poll(probe: HeartbeatProbe, schema: Schema, declared: list[bool], i: int = 0) -> None:
    """One look at a watched rank (and the beat); declares it once when it is silent (``declared[i]``)."""
    try:
        silent = probe.poll(time.monotonic())
        if silent is not None and not declared[i]:
            declared[i] = True
            if schema.claim_declaration(silent.failed_rank):
                schema.publish(silent.record)
    except Exception:  # noqa: BLE001 - the store is unreachable: the rank's watchdog judges that
        probe.next_at = time.monotonic() + probe.period  # tried again a period later


class LivenessProcess:
    """The helper process of one rank; ``start()`` forks it, ``stop()`` ends it."""

    def __init__(self, session: Session, *, period: float, limit: float, unacked_after: float = math.inf) -> None:
        self.session = session
        self.period = period
        self.limit = limit
        self.unacked_after = unacked_after
        self.pid: int | None = None
        self._stop_w: int | None = None

    def start(self) -> LivenessProcess:
        # Connected by the helper after the fork, never by the rank (a slow connect would hold up its
        # first collective); a peer judges a heartbeat only once it has beaten: a late first beat is fine.
        conn = self.session.connection("helper", HELPER_STORE_TIMEOUT, backoff=True)
        schema = Schema(conn, self.session.schema.world_size)
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        try:
            pid = os.fork()
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
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def kill_all() -> None:
    for pid in list(_children):
        kill(pid)
    _children.clear()
