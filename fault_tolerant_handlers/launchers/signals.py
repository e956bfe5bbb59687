"""SIGTERM and SIGINT (``docs/launchers.md``): a signalled rank says so before the signal takes effect.

When a session starts, a handler goes **in front of** the one already there (never replacing it).
It reacts once: after a peer's failure the signal is a consequence (only the error file is
written); otherwise this rank publishes a declared ``RankSignalled`` record. Then the previous
handler runs. The reaction also runs from a thread (``fth-signals``) woken by ``signal.set_wakeup_fd``:
a main thread blocked in C runs no handler.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from . import reports
from ..core.errors import store_lost
from ..core.failure import Ended, FailureKind, FailureRecord, PeerFailedError
from ..core.config import (CAUSE_LINGER, MAIN_STUCK_WAIT, REACTION_WAIT, REPORT_WAIT, SAME_DELIVERY,  # timings: the
                           SIGNAL_EXIT_WAIT, SIGNAL_STORE_TIMEOUT, SIGNALLED_TOGETHER)  # table in core.config
from ..core.hooks import first_line, log
from ..core import procfs
from ..core.procfs import HANDLED_SIGNALS
from ..core.interrupts import cut_connections_to, release_process_groups, store_ports
from ..core.schema import Schema, StoreUnreachable

if TYPE_CHECKING:
    from ..core.session import Session

#: The signals handled (each only if not ignored when the session starts).
SIGNALS = tuple(signal.Signals[name] for name in HANDLED_SIGNALS)  # SIGTERM, SIGINT


class _Watch:
    def __init__(self, session: Session) -> None:
        self._session = weakref.ref(session)
        self.previous: dict[int, object] = {}
        self.reacting = threading.Lock()  # taken once, by the first reaction, and never released
        self.done = threading.Event()
        self.handled = threading.Event()  # the main thread entered a handler of this module's
        self.kind: str | None = None  # "cause", "consequence" or "failed", once reacted
        self.cause: PeerFailedError | None = None  # this rank's own signal, as a collective broken after it raises
        self._wsock: socket.socket | None = None  # the wakeup fd's socket, held while the process runs

    # -- install ------------------------------------------------------------------------------------
    def install(self) -> None:
        for signum in SIGNALS:
            prev = signal.getsignal(signum)
            if prev is signal.SIG_IGN:
                continue
            self.previous[signum] = prev
            signal.signal(signum, self._handler)
        if not self.previous:
            return
        if self.previous.get(signal.SIGTERM) is signal.SIG_DFL:
            atexit.register(reports.ignore_sigterm_if_failed)
        rsock, wsock = socket.socketpair()
        wsock.setblocking(False)
        try:
            old = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = None
        if old != -1:
            if old is not None:
                signal.set_wakeup_fd(old)  # someone else's (asyncio): keep it
            rsock.close()
            wsock.close()
            return
        self._wsock = wsock
        threading.Thread(target=self._wakeups, args=(rsock,), name="fth-signals", daemon=True).start()

    def _wakeups(self, rsock: socket.socket) -> None:
        while True:
            try:
                data = rsock.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self.previous:
                    main = procfs.main_position()  # where the main thread is as the signal arrives
                    self.react(signum)
                    self._unblock(signum, main)

    def _unblock(self, signum: int, main: tuple[int, int] | None) -> None:
        """A main thread that ran no bytecode for :data:`MAIN_STUCK_WAIT` (blocked in C) gets its collectives and
        store connections cut; not in the handler :data:`SIGNAL_EXIT_WAIT` later, it ends here (``128 + signum``)."""
        if self.handled.wait(MAIN_STUCK_WAIT) or main is None or procfs.main_position() != main:
            return
        session = self._session()
        name = signal.Signals(signum).name
        log(logging.WARNING, "%s: the main thread is blocked (in a collective or a store call): releasing this "
            "process's collectives and store connections so that the signal takes effect", name)
        try:
            store = session.pg_store if session is not None else None
            what = release_process_groups(store)
            cut = cut_connections_to(store_ports(store))
            log(logging.INFO, "released: %s; %d store connections closed", what, cut)
        except Exception as err:  # noqa: BLE001 - the process is being ended: never stand in the way
            log(logging.WARNING, "could not release the blocked main thread: %s", err)
        if self.handled.wait(SIGNAL_EXIT_WAIT):
            return
        if self.previous.get(signum) is signal.SIG_DFL and not self._framework_in_front(signum):
            if self.kind == "failed":
                self._exit_failed(signum)
            log(logging.CRITICAL, "%s: the main thread is still blocked after %.0f s; ending this process with exit "
                "code %d", name, MAIN_STUCK_WAIT + SIGNAL_EXIT_WAIT, 128 + signum)
            _flush()
            os._exit(128 + signum)

    # -- react --------------------------------------------------------------------------------------
    def _handler(self, signum, frame):
        self.handled.set()
        self.react(signum)
        self.done.wait(REACTION_WAIT)
        prev = self.previous.get(signum)
        if callable(prev):
            return prev(signum, frame)
        if self.kind == "failed" and prev is signal.SIG_DFL:
            # (a framework's handler in front of this one, Lightning's, has run: it calls this one last)
            self._exit_failed(signum)
        if self.kind == "cause" and self._framework_in_front(signum):
            # A handler put in front of this one later calls it (Lightning's, which chains the one
            # it found): what the signal does is that handler's to say (Lightning's stops the fit
            # at the next batch, through its exception path: checkpoints), not the default's.
            return None
        # SIG_DFL (or a handler set outside Python): end as the signal would have, once the peers
        # had the time to read the record (else a same-host peer sees only a process gone).
        if self.kind == "cause":
            time.sleep(CAUSE_LINGER)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return None

    def _exit_failed(self, signum: int) -> None:
        """This rank failed itself, then was signalled: exit code 1 at once (torchrun's Root Cause names its failure)."""
        cause = reports.own_failure
        what = f" ({cause.exc_type}: {first_line(cause.exc_message)})" \
            if cause is not None and cause.exc_message else ""
        with contextlib.suppress(Exception):
            sys.stderr.write(f"[rank {cause.rank if cause is not None else '?'}] fault-tolerant-handlers: "
                             f"{signal.Signals(signum).name} after this rank's own failure{what}: exiting with "
                             "code 1\n")
        _flush()
        os._exit(1)

    def _framework_in_front(self, signum: int) -> bool:  # a handler put in front of this one (Lightning's)
        return signal.getsignal(signum) != self._handler

    def react(self, signum: int) -> None:
        if not self.reacting.acquire(blocking=False):
            return
        received = time.time()
        try:
            self._react(signum, received)
        except Exception as err:  # noqa: BLE001 - never stand in the way of the signal
            log(logging.WARNING, "could not report signal %s: %s", signal.Signals(signum).name, err)
        finally:
            self.done.set()

    def _react(self, signum: int, received: float) -> None:
        session = self._session()
        if session is None:  # the session is gone (the interpreter's exit hooks): its failure is known
            if reports.own_failure is not None:
                self.kind = "failed"
            return
        name = signal.Signals(signum).name
        failure = session.failure  # read here; driven through its transitions only
        cause = failure.cause
        if failure.local or (cause is not None and cause.kind is FailureKind.RAISED and cause.rank == session.rank):
            # this rank failed itself (in the current incident, or as the attempt's first failure, which
            # an agreement delivered since): its own record and file say why
            self.kind = "failed"
            return
        # A failure being explained right now (a broken collective: torchrun's agent ends the
        # survivors when the store's host dies) is waited for, briefly: the report must come first.
        # Under mp.spawn, a SIGTERM after a same-host peer's exit waits (briefly) for its cause.
        peer = (session.failure_report(REPORT_WAIT)
                or reports.awaited_cause(session.same_host_probe, lambda: failure.peer_error,
                                         lambda: self._records(session))
                or session.same_host_probe.poll(time.monotonic()) or self._records(session))
        # a peer that received the same signal at the same moment (one delivery to every process:
        # Ctrl-C, scancel, a preemption): this rank's own signal, not a consequence
        window = SIGNALLED_TOGETHER if self._framework_in_front(signum) else SAME_DELIVERY
        same = (peer is not None and peer.kind is FailureKind.RANK_SIGNALLED and peer.ended is not None
                and peer.ended.signal_name == name and peer.failed_at is not None
                and abs(peer.failed_at - received) <= window)
        if peer is not None and not same:
            self.kind = "consequence"
            code = 128 + signum
            log(logging.CRITICAL, "ending this process with exit code %d: terminated by %s while the job fails: %s",
                code, name, first_line(peer, None))
            with contextlib.suppress(Exception):
                if not reports.printed(peer):  # else printed in full already
                    sys.stderr.write(f"[rank {session.rank}] fault-tolerant-handlers: {name} while the job fails:\n{peer}\n")
                    sys.stderr.flush()
            reports.write_survivor(session.table, peer)
            return
        message = f"rank {session.rank} (pid {os.getpid()} on {session.host}) received {name}"
        record = FailureRecord.declared(rank=session.rank, kind=FailureKind.RANK_SIGNALLED, message=message,
                                        by=session.rank, pid=os.getpid(), host=session.host,
                                        ended=Ended(signal=int(signum)))
        self.cause = PeerFailedError.from_records([record])
        self.kind = "cause"
        # A collective broken from now on is this signal's consequence; the peers' reaction is not a
        # failure to escalate here; the job fails: its exit does not wait on a store that may be leaving.
        failure.signalled(self.cause)
        log(logging.ERROR, "%s: telling the other ranks", message)
        reports.write_failed(record)  # this rank is the cause
        conn = session.connection("signal", SIGNAL_STORE_TIMEOUT)
        try:
            Schema(conn, session.schema.world_size).publish(record)
        finally:
            conn.close()
        if callable(self.previous.get(signum)):
            # The previous handler runs on (Lightning's broadcasts to the peers, which are leaving):
            # this rank's collectives fail at once instead of waiting for them.
            what = release_process_groups(session.pg_store)
            log(logging.INFO, "released this rank's collectives: %s", what)

    @staticmethod
    def _records(session: Session) -> PeerFailedError | None:
        conn = session.connection("signal-read", SIGNAL_STORE_TIMEOUT)
        try:
            schema = Schema(conn, session.schema.world_size)
            indices = [i for i in schema.new_indices(session.consumed, schema.count()) if i not in session.delivered]
            records = session.peer_records(schema, indices)
            return PeerFailedError.from_records(records) if records else None
        except StoreUnreachable as err:  # its port refuses, or does not answer, a connection
            return _store_host_lost(session, err)
        except Exception:  # noqa: BLE001 - the store is gone: nothing to learn from it
            return None
        finally:
            conn.close()


def _store_host_lost(session: Session, err: StoreUnreachable) -> PeerFailedError | None:
    """Seen from another host, a store that refuses or does not answer connections is its host gone; ``None``
    on the store's own host (the pid check says what happened)."""
    why = str(err).rsplit(": ", 1)[-1][:120]
    table, store_rank = session.table, session.store_rank
    if store_rank is None:
        return store_lost(":".join(map(str, session.store_address or ())), f"it no longer accepts connections ({why})")
    if table.host_ids[table.ranks.index(store_rank)] == table.host_ids[table.group_rank]:
        return None
    return PeerFailedError.from_records([table.lost_record(
        store_rank, f"its host, which holds the c10d store, no longer accepts connections ({why})")])


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


_watch: _Watch | None = None


def install(session: Session) -> None:
    """``SESSION_STARTED``: put the handlers in front of the current ones (once per process, from the main
    thread only)."""
    global _watch
    if threading.current_thread() is not threading.main_thread():
        return
    if _watch is not None:
        # The world's session speaks for this process (a new one after destroy + init replaces it).
        if session.group is None or _watch._session() is None:
            _watch._session = weakref.ref(session)
        return
    _watch = _Watch(session)
    _watch.install()
