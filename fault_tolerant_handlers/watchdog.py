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

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING

from ._log import log
from .errors import PeerFailedError
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

DEFAULT_INTERVAL = timedelta(seconds=0.1)
DEFAULT_EXIT_GRACE = timedelta(seconds=3)
DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=60)
#: How long a failure record may stay unconsumed by a sync point before the watchdog releases.
DEFAULT_RELEASE_GRACE = timedelta(seconds=0.3)
#: Extra time before a neighbour declares a silent rank, on top of ``hang_timeout``.
SILENT_MARGIN = timedelta(seconds=2)
#: Heartbeat period (ticks of the counter); the ring check runs at the same period.
HEARTBEAT_EVERY = timedelta(seconds=0.5)

_SIGNAL_NAMES = {int(s): s.name for s in signal.Signals}


def env_timedelta(name: str, default: timedelta | None) -> timedelta | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds, e.g. {name}=5")
    return timedelta(seconds=seconds)


def check_timedelta(name: str, value: object, *, allow_none: bool = False) -> timedelta | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, timedelta):
        hint = " or None" if allow_none else ""
        raise TypeError(f"{name} must be a datetime.timedelta{hint} (e.g. timedelta(seconds=5)), got {value!r}")
    if value.total_seconds() <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return value


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
        self._store = coord.store.clone()  # its own connection: never shares a socket with the main thread
        self._stop = threading.Event()
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
        self._thread = threading.Thread(target=self._run, name="fth-watchdog", daemon=True)

    # -- main-thread API ----------------------------------------------------------------------
    def start(self) -> Watchdog:
        self._thread.start()
        return self

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
    def _add(self, key: str, value: int) -> int:
        self.store_ops += 1
        return self._store.add(key, value)

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

    def _tick(self) -> None:
        now = time.monotonic()
        if self.peer_error is None:
            self._check_records(now)
        if self.peer_error is None:
            self._check_same_host_peers()
        if self.peer_error is None and now >= self._next_hb_check:
            self._next_hb_check = now + HEARTBEAT_EVERY.total_seconds()
            self._heartbeat(now)
        if self.peer_error is None and self.hang_timeout is not None and not self._local_failure:
            self._check_self_hang(now)
        self._escalate(now)

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
        if stalled < self.hang_timeout.total_seconds():
            return
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(main thread stack unavailable)"
        step = f" at step {self._step}" if self._step is not None else ""
        message = f"rank {self.rank} hung: its main thread made no progress for {stalled:.1f} s{step}"
        self._declare(self.rank, "RankHung", message, traceback=f"Main thread stack of rank {self.rank}:\n{stack}",
                      time_ms=int(self._last_beat_wall * 1000))
        self._local_failure = True
        err = PeerFailedError(self.rank, "RankHung", message, _cap_tail(stack, MAX_TRACEBACK_CHARS), "the watchdog")
        # Give the peers a moment to read the record, then end: the main thread cannot be trusted.
        time.sleep(min(1.0, self.exit_grace.total_seconds()))
        self._reported_exit(err, EXIT_HUNG)

    def _declare_lost(self, rank: int, pid: int, state: str) -> None:
        host = ""
        self._declare(self.coord.ranks[rank], "PeerLost", f"rank {self.coord.ranks[rank]} (pid {pid}{host}) lost: {state}")

    def _declare(self, rank: int, kind: str, message: str, traceback: str = "", time_ms: int | None = None) -> None:
        """Publish a record on behalf of ``rank`` (once per rank, whoever sees it first)."""
        record = FailureRecord(
            rank=rank,
            exc_type=kind,
            exc_message=message,
            traceback=traceback,
            section="the watchdog",
            seq=-1,
            time_ms=int(time.time() * 1000) if time_ms is None else time_ms,
            pid=self.coord.pids[self.coord.ranks.index(rank)] if rank in self.coord.ranks else 0,
            extra={"kind": kind, "by": self.rank},
        )
        first = True
        try:
            first = self._add(f"declared/{rank}", 1) == 1
            if first:
                index = self._add("n", 1)
                self._store.set(f"r/{index}", record.to_json())
                self._seen = max(self._seen, index)
        except Exception as err:  # noqa: BLE001 - the store may be what died
            log(logging.WARNING, "could not publish %s: %s", kind, err)
        log(logging.ERROR, "%s", message)
        if rank != self.rank:
            self._peer_failed(PeerFailedError.from_records([record]), time.monotonic())

    def _store_lost(self, err: Exception) -> None:
        if self.peer_error is not None:
            self._escalate(time.monotonic())
            return
        host_rank = 0
        pid = self.coord.pids[0] if self.coord.pids else 0
        state = process_state(pid) if self._same_host and any(r == 0 for r, _ in self._same_host) else None
        cause = state or f"the c10d store stopped answering ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
        message = f"rank {host_rank} (pid {pid}, hosts the c10d store) lost: {cause}"
        log(logging.ERROR, "%s", message)
        self._peer_failed(PeerFailedError(host_rank, "PeerLost", message, "", "the watchdog", pid=pid), time.monotonic())
        # Without the store there is nothing more to poll; finish the escalation here.
        while not self._acknowledged.is_set() and not self._stop.is_set():
            if self._escalate(time.monotonic()):
                return
            time.sleep(self.interval.total_seconds())

    def _peer_failed(self, err: PeerFailedError, now: float) -> None:
        if self.peer_error is not None:
            return
        self.peer_error = err
        self._failed_at = now
        log(logging.ERROR, "peer failure: %s", str(err).splitlines()[0], step=self._step)

    def _escalate(self, now: float) -> bool:
        """Release, then (if nobody takes the failure) exit. Returns True once exited."""
        if self.peer_error is None or self._local_failure or self._acknowledged.is_set():
            return False
        if not self._released:
            self._released = True
            what = release_process_groups(self.coord.store)
            log(logging.WARNING, "released blocked collectives: %s", what, step=self._step)
            return False
        if now - self._failed_at >= self.exit_grace.total_seconds():
            self._reported_exit(self.peer_error, EXIT_PEER_FAILED)
            return True
        return False

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
    if coord.watchdog is None:
        coord.watchdog = Watchdog(
            coord, interval=interval, hang_timeout=hang_timeout, exit_grace=exit_grace, heartbeat_timeout=heartbeat_timeout
        ).start()
    elif hang_timeout is not None and coord.watchdog.hang_timeout != hang_timeout:
        log(logging.WARNING, "watchdog already running with hang_timeout=%s; keeping it", coord.watchdog.hang_timeout)
    return coord.watchdog
