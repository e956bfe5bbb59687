"""The out-of-band watchdog: a daemon thread per process that watches the job through the c10d store
and the liveness of the peer processes, while the main thread may be stuck in a collective.

Every ``interval`` (default 0.1 s) it makes a constant number of store calls, whatever the world
size:

* ``add("n", 0)``: the failure-record counter. A new record from another rank that the main thread
  has not consumed at a sync point within ``release_grace`` means the job is failing: the watchdog
  keeps the :class:`PeerFailedError` for the adapters to raise, and **releases** this process's
  collectives (:mod:`fault_tolerant_handlers.release`) so that a main thread blocked in one fails
  at once;
* ``add("hb/<rank>", 1)`` and ``add("hb/<next rank>", 0)``: a heartbeat counter of its own and a
  look at the next rank's on a ring, so a silent rank is noticed by one neighbour, not by all.

Same-host peers are also checked by pid each interval (a system call, no store traffic): a rank
killed by a signal is declared lost at once, with the signal when the kernel still shows it.

With ``hang_timeout`` set, a rank whose main thread has made no progress (``beat()``) for that long
declares *itself* hung, with its main thread's Python stack taken from this thread, then ends.
If even its watchdog cannot answer, its ring neighbour declares it silent after ``hang_timeout``
plus :data:`SILENT_MARGIN`.

When the job is failing and the main thread has not taken the failure (``acknowledge()``) within
``exit_grace`` after the release, the watchdog does a **reported exit**: it prints the report to
stderr and the log, kills this process's child processes (DataLoader workers) and ends the process
with :data:`EXIT_PEER_FAILED` (or :data:`EXIT_HUNG` for the hung rank itself).

Environment overrides (each documented where it is read): ``FTH_WATCHDOG_INTERVAL_SEC``,
``FTH_HANG_TIMEOUT_SEC``, ``FTH_EXIT_GRACE_SEC``, ``FTH_HEARTBEAT_TIMEOUT_SEC``, ``FTH_RELEASE``.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING

from ._liveness import PidWatcher, WakeEvent
from ._log import log
from ._timeouts import check_timedelta, env_timedelta
from .errors import WATCHDOG_SECTION, PeerFailedError
from .record import MAX_TRACEBACK_CHARS, FailureRecord, _cap_tail
from .release import release_process_groups

if TYPE_CHECKING:
    from .coordinator import Coordinator

#: Exit code of a rank ended by the watchdog because another rank failed, was lost or hung.
EXIT_PEER_FAILED = 87
#: Exit code of the rank that declared itself hung.
EXIT_HUNG = 88

#: Poll interval of the watchdog, seconds. Default 0.1.
INTERVAL_ENV = "FTH_WATCHDOG_INTERVAL_SEC"
#: Opt-in hang timeout, seconds (no hang detection when unset).
HANG_TIMEOUT_ENV = "FTH_HANG_TIMEOUT_SEC"
#: How long a released rank's main thread has to take the failure before the reported exit. Default 3.
EXIT_GRACE_ENV = "FTH_EXIT_GRACE_SEC"
#: A peer on another host whose heartbeat has not moved for this long is declared lost. Default 60.
HEARTBEAT_TIMEOUT_ENV = "FTH_HEARTBEAT_TIMEOUT_SEC"

#: A store that does not answer for this long (and whose host's death cannot be seen) is declared lost.
STORE_LOST_ENV = "FTH_STORE_LOST_SEC"

DEFAULT_INTERVAL = timedelta(seconds=0.1)
DEFAULT_STORE_LOST_AFTER = timedelta(seconds=10)
DEFAULT_EXIT_GRACE = timedelta(seconds=3)
DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=60)
#: How long a failure record may stay unconsumed by a sync point before the watchdog releases.
DEFAULT_RELEASE_GRACE = timedelta(seconds=0.3)
#: Extra time before a neighbour declares a silent rank, on top of ``hang_timeout``.
SILENT_MARGIN = timedelta(seconds=2)
#: Heartbeat period (ticks of the counter); the ring check runs at the same period.
HEARTBEAT_EVERY = timedelta(seconds=0.5)

_SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}


def process_state(pid: int) -> str | None:
    """``None`` if ``pid`` runs; otherwise how it ended, as far as this node can see."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return "process is gone (exit status not visible from this process)"
    except OSError:
        try:
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return "process is gone"
        except PermissionError:
            return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] not in ("Z", "X"):
        return None
    try:
        status = int(fields[49])  # field 52 of /proc/<pid>/stat: the wait status
    except (IndexError, ValueError):
        return "process exited"
    if status & 0x7F:
        return f"killed by {_SIGNAL_NAMES.get(status & 0x7F, f'signal {status & 0x7F}')}"
    return f"exited with code {(status >> 8) & 0xFF}"


#: Where a main thread waits for its peers rather than being hung itself (innermost frames).
_WAITING_MARKERS = (
    f"torch{os.sep}distributed{os.sep}",
    f"torch{os.sep}nn{os.sep}parallel{os.sep}",
    f"torch{os.sep}autograd{os.sep}",
    f"torch{os.sep}_tensor.py",
    f"fault_tolerant_handlers{os.sep}coordinator.py",
    f"fault_tolerant_handlers{os.sep}sections.py",
    f"ignite{os.sep}distributed{os.sep}",
)


def _waiting_on_peers(frame) -> bool:
    """True when the innermost Python frames are a collective or a backward pass (DDP all_reduce)."""
    depth = 0
    while frame is not None and depth < 4:
        if any(marker in frame.f_code.co_filename for marker in _WAITING_MARKERS):
            return True
        frame = frame.f_back
        depth += 1
    return False


class Watchdog:
    """One per process and process group; start it with :func:`start_watchdog` or an adapter."""

    def __init__(
        self,
        coord: Coordinator,
        *,
        interval: timedelta | None = None,
        hang_timeout: timedelta | None = None,
        exit_grace: timedelta | None = None,
        heartbeat_timeout: timedelta | None = None,
        release_grace: timedelta = DEFAULT_RELEASE_GRACE,
    ) -> None:
        self.coord = coord
        self.interval = check_timedelta("interval", interval or env_timedelta(INTERVAL_ENV, DEFAULT_INTERVAL))
        self.hang_timeout = check_timedelta(
            "hang_timeout", hang_timeout or env_timedelta(HANG_TIMEOUT_ENV, None), allow_none=True
        )
        self.exit_grace = check_timedelta("exit_grace", exit_grace or env_timedelta(EXIT_GRACE_ENV, DEFAULT_EXIT_GRACE))
        self.heartbeat_timeout = check_timedelta(
            "heartbeat_timeout", heartbeat_timeout or env_timedelta(HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT)
        )
        self.release_grace = release_grace
        self.rank = coord.rank
        self.peer_error: PeerFailedError | None = None
        self.store_ops = 0
        # Its own connection, never shared with the main thread, with a short timeout: a store whose
        # host died while a child process still holds its socket open must not block this thread.
        self._store = coord.store.clone()
        self._store.set_timeout(timedelta(seconds=max(1.0, 5 * self.interval.total_seconds())))
        self.store_lost_after = check_timedelta(
            "store_lost_after", env_timedelta(STORE_LOST_ENV, DEFAULT_STORE_LOST_AFTER)
        )
        self._store_down_since: float | None = None
        self._liveness_store = coord.store.clone()  # the liveness thread's own connection
        self._stop = WakeEvent()  # its set() also wakes the liveness thread's poll()
        self._acknowledged = threading.Event()
        self._finishing = False
        self._local_failure = False
        self._last_beat = time.monotonic()
        self._last_beat_wall = time.time()
        self._step: int | None = None
        self._seen = self._add("n", 0)
        self._pending: dict[int, float] = {}  # record index -> when first seen
        self._failed_at: float | None = None
        self._released = False
        self._same_host = [
            (r, pid)
            for r, (pid, host) in enumerate(zip(coord.pids, coord.host_ids))
            if r != coord.group_rank and host == coord.host_ids[coord.group_rank]
        ]
        self._next = (coord.group_rank + 1) % coord.world_size
        self._next_hb = (-1, time.monotonic())
        self._next_hb_check = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fth-watchdog", daemon=True)
        # Same-host liveness has its own thread: a store call may block when the store's host
        # died while a child process still holds the socket; a pid check never does.
        self._liveness = threading.Thread(target=self._run_liveness, name="fth-liveness", daemon=True)

    # -- main-thread API ----------------------------------------------------------------------
    def start(self) -> Watchdog:
        _stop_at_exit(self)
        self._thread.start()
        if self._same_host:
            self._liveness.start()
        return self

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """A clean end (the job finished): stop watching; losing the store is no longer a failure."""
        self._finishing = True
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval.total_seconds() + 1)

    def beat(self, step: int | None = None) -> None:
        """The main thread made progress (one cheap assignment; adapters call it every iteration)."""
        self._last_beat = time.monotonic()
        self._last_beat_wall = time.time()
        self._step = step

    def acknowledge(self) -> None:
        """The main thread took the failure and is raising: no reported exit."""
        self._acknowledged.set()

    def local_failure(self) -> None:
        """This rank failed on its own (its record is published): it is not released or exited."""
        self._local_failure = True

    # -- thread ----------------------------------------------------------------------------------
    def _add(self, key: str, value: int, store=None) -> int:
        self.store_ops += 1
        return (store or self._store).add(key, value)

    def _run(self) -> None:
        period = self.interval.total_seconds()
        while not self._stop.wait(period):
            try:
                self._tick()
            except Exception as err:  # noqa: BLE001 - the store host is gone, or worse
                if self._finishing or self._stop.is_set():
                    return
                self._store_lost(err)
        log(logging.DEBUG, "watchdog stopped")

    def _run_liveness(self) -> None:
        # Sleeps in poll() on the peers' pidfds: wakes when a peer ends or the watchdog stops, not
        # every interval (pids without a pidfd are still checked every interval).
        watcher = PidWatcher([pid for _, pid in self._same_host], self._stop, self.interval.total_seconds())
        try:
            while not self._stop.is_set() and self.peer_error is None:
                if watcher.wait():
                    self._check_same_host_peers()
        finally:
            watcher.close()

    def _tick(self) -> None:
        now = time.monotonic()
        if self.peer_error is None:
            self._check_records(now)
        self._store_down_since = None  # the store answered
        if self.peer_error is None and now >= self._next_hb_check:
            self._next_hb_check = now + HEARTBEAT_EVERY.total_seconds()
            self._heartbeat(now)
        if self.peer_error is None and self.hang_timeout is not None and not self._local_failure:
            self._check_self_hang(now)

    def _check_records(self, now: float) -> None:
        count = self._add("n", 0)
        for index in range(max(self._seen + 1, count - 63), count + 1):
            self._pending.setdefault(index, now)
        self._seen = max(self._seen, count)
        consumed = self.coord.consumed_index
        due = [i for i, t in self._pending.items() if i > consumed and now - t >= self.release_grace.total_seconds()]
        for index in [i for i in self._pending if i <= consumed]:
            del self._pending[index]
        if not due:
            return
        records = []
        for index in due:
            del self._pending[index]
            record = self.coord.read_record(index, store=self._store)
            if record is not None and record.rank != self.rank:
                records.append(record)
        if records:
            self._peer_failed(PeerFailedError.from_records(records), now)

    def dead_peer_now(self) -> PeerFailedError | None:
        """For the main thread: a same-host peer that is gone, checked right now by pid.

        Touches neither the store nor any thread (the liveness thread publishes the record); a
        launcher may be about to signal this process, so the answer must come at once.
        """
        for rank, pid in self._same_host:
            state = process_state(pid)
            if state is not None:
                global_rank = self.coord.ranks[rank]
                message = f"rank {global_rank} (pid {pid} on {socket.gethostname()[:200]}) lost: {state}"
                return PeerFailedError(global_rank, "PeerLost", message, "", WATCHDOG_SECTION,
                                       section=WATCHDOG_SECTION, pid=pid)
        return None

    def _check_same_host_peers(self) -> None:
        for rank, pid in self._same_host:
            state = process_state(pid)
            if state is not None:
                self._declare_lost(rank, pid, state)
                return

    def _heartbeat(self, now: float) -> None:
        self._add(f"hb/{self.rank}", 1)
        if self.coord.world_size < 2:
            return
        nxt = self.coord.ranks[self._next]
        value = self._add(f"hb/{nxt}", 0)
        last_value, since = self._next_hb
        if value != last_value:
            self._next_hb = (value, now)
            return
        limit = self.heartbeat_timeout.total_seconds()
        if self.hang_timeout is not None:
            limit = min(limit, (self.hang_timeout + SILENT_MARGIN).total_seconds())
        if value > 0 and now - since > limit:
            pid = self.coord.pids[self._next]
            self._declare(
                nxt,
                "PeerSilent",
                f"rank {nxt} (pid {pid}) lost: no heartbeat for {now - since:.1f} s (its watchdog does not answer)",
            )

    def _check_self_hang(self, now: float) -> None:
        stalled = now - self._last_beat
        limit = self.hang_timeout.total_seconds()
        if stalled < limit:
            return
        frame = sys._current_frames().get(threading.main_thread().ident)
        if stalled < 2 * limit + SILENT_MARGIN.total_seconds() and _waiting_on_peers(frame):
            # Blocked in a collective: most likely waiting for the hung rank, which declares itself
            # (or, if its watchdog is frozen too, is declared silent by its neighbour before this).
            return
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(main thread stack unavailable)"
        step = f" at step {self._step}" if self._step is not None else ""
        message = f"rank {self.rank} hung: its main thread made no progress for {stalled:.1f} s{step}"
        self._declare(self.rank, "RankHung", message, traceback=f"Main thread stack of rank {self.rank}:\n{stack}",
                      time_ms=int(self._last_beat_wall * 1000))
        self._local_failure = True
        err = PeerFailedError(self.rank, "RankHung", message, _cap_tail(stack, MAX_TRACEBACK_CHARS), WATCHDOG_SECTION,
                              section=WATCHDOG_SECTION)
        # Give the peers a moment to read the record, then end: the main thread cannot be trusted.
        time.sleep(min(1.0, self.exit_grace.total_seconds()))
        self._reported_exit(err, EXIT_HUNG)

    def _declare_lost(self, rank: int, pid: int, state: str) -> None:
        global_rank = self.coord.ranks[rank]
        host = socket.gethostname()[:200]  # a same-host peer, by construction
        self._declare(global_rank, "PeerLost", f"rank {global_rank} (pid {pid} on {host}) lost: {state}",
                      store=self._liveness_store)

    def _declare(
        self, rank: int, kind: str, message: str, traceback: str = "", time_ms: int | None = None, store=None
    ) -> None:
        """Publish a record on behalf of ``rank`` (once per rank, whoever sees it first)."""
        record = FailureRecord(
            rank=rank,
            exc_type=kind,
            exc_message=message,
            traceback=traceback,
            section=WATCHDOG_SECTION,
            seq=-1,
            time_ms=int(time.time() * 1000) if time_ms is None else time_ms,
            pid=self.coord.pids[self.coord.ranks.index(rank)] if rank in self.coord.ranks else 0,
            host="",
            extra={"kind": kind, "by": self.rank},
        )
        log(logging.ERROR, "%s", message)
        if rank != self.rank:
            self._peer_failed(PeerFailedError.from_records([record]), time.monotonic())
        try:
            store = store or self._store
            if self._add(f"declared/{rank}", 1, store) == 1:
                index = self._add("n", 1, store)
                store.set(f"r/{index}", record.to_json())
                self._seen = max(self._seen, index)
        except Exception as err:  # noqa: BLE001 - the store may be what died
            log(logging.WARNING, "could not publish %s: %s", kind, str(err).splitlines()[0][:200])

    def _store_lost(self, err: Exception) -> None:
        """A store call failed. A dead store-host rank on this node is declared at once; otherwise
        the store must stay silent for ``store_lost_after`` before the job is declared failed."""
        now = time.monotonic()
        if self.peer_error is not None:
            return
        if self._store_down_since is None:
            self._store_down_since = now
            log(logging.WARNING, "the c10d store did not answer: %s", str(err).splitlines()[0][:200])
        if now - self._store_down_since < self.store_lost_after.total_seconds():
            return
        pid = self.coord.pids[0] if self.coord.pids else 0
        message = (
            f"rank 0 (pid {pid}, hosts the c10d store) lost: the store has not answered for "
            f"{now - self._store_down_since:.1f} s ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        )
        log(logging.ERROR, "%s", message)
        self._peer_failed(
            PeerFailedError(0, "PeerLost", message, "", WATCHDOG_SECTION, section=WATCHDOG_SECTION, pid=pid), now
        )

    def _peer_failed(self, err: PeerFailedError, now: float) -> None:
        with self._lock:
            if self.peer_error is not None:
                return
            self.peer_error = err
            self._failed_at = now
        log(logging.ERROR, "peer failure: %s", str(err).splitlines()[0], step=self._step)
        threading.Thread(target=self._escalate, name="fth-escalate", daemon=True).start()

    def _escalate(self) -> None:
        """Release this process's collectives, then, if the main thread does not take the failure
        within ``exit_grace``, end the process with a report. Touches no store: it must work when
        the store is what died."""
        if self._local_failure or self._acknowledged.is_set() or self._finishing:
            return
        what = release_process_groups(self.coord.store)
        log(logging.WARNING, "released blocked collectives: %s", what, step=self._step)
        if self._acknowledged.wait(self.exit_grace.total_seconds()):
            return
        if self._local_failure or self._finishing:
            return
        self._reported_exit(self.peer_error, EXIT_PEER_FAILED)

    def _reported_exit(self, err: BaseException, code: int) -> None:
        text = (
            f"[rank {self.rank}] fault-tolerant-handlers: ending this process (exit code {code}) because:\n{err}\n"
        )
        try:
            log(logging.CRITICAL, "ending this process with exit code %d: %s", code, str(err).splitlines()[0])
            sys.stderr.write(text)
            sys.stderr.flush()
            sys.stdout.flush()
            for handler in logging.getLogger().handlers + logging.getLogger("fault_tolerant_handlers").handlers:
                try:
                    handler.flush()
                except Exception:  # noqa: BLE001
                    pass
            for child in multiprocessing.active_children():  # DataLoader workers, among others
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except (ProcessLookupError, TypeError):
                    pass
        finally:
            os._exit(code)


_running: list[Watchdog] = []
_exit_hook_registered = False


def _stop_at_exit(watchdog: Watchdog) -> None:
    """Stop every watchdog before the interpreter finalizes: a daemon thread still inside a torch
    C++ call (a store operation) when Python finalizes is ended by a forced unwind through C++
    frames, which aborts the whole process (``terminate called without an active exception``)."""
    global _exit_hook_registered
    _running.append(watchdog)
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_stop_all)


def _stop_all() -> None:
    deadline = time.monotonic() + 3.0
    for watchdog in _running:
        watchdog._finishing = True
        watchdog._stop.set()
    for watchdog in _running:
        for thread in (watchdog._thread, watchdog._liveness):
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))


def start_watchdog(
    group=None,
    *,
    interval: timedelta | None = None,
    hang_timeout: timedelta | None = None,
    exit_grace: timedelta | None = None,
    heartbeat_timeout: timedelta | None = None,
) -> Watchdog | None:
    """Start (once per process group) and return the watchdog; ``None`` without distribution.

    Collective on first use for the group (it creates the side group): call it on every rank.
    """
    from .coordinator import get_coordinator

    coord = get_coordinator(group, caller="start_watchdog")
    if coord is None:
        return None
    if coord.watchdog is None or coord.watchdog.stopped:
        coord.watchdog = Watchdog(
            coord, interval=interval, hang_timeout=hang_timeout, exit_grace=exit_grace, heartbeat_timeout=heartbeat_timeout
        ).start()
    elif hang_timeout is not None and coord.watchdog.hang_timeout != hang_timeout:
        log(logging.WARNING, "watchdog already running with hang_timeout=%s; keeping it", coord.watchdog.hang_timeout)
    return coord.watchdog
