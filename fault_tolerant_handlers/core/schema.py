"""The store schema: every key the library writes in the c10d store, defined once, below. A run's keys
live under ``fth/<run id>/`` (a random id rank 0 draws at setup: a restarted job never reads an earlier
attempt's); a recovery in place agrees under ``fth/recover/<torchrun restart>/`` (:func:`recovery_key`).

Every value is a record of the one codec (:class:`~.failure.Stored`) or a counter. The store is
unauthenticated: a counter that jumps backwards or too far is corruption (a warning naming the key), a
non-integer counter is repaired, a record that fails its checks is ignored. Every process talks to the
store through :class:`Connection`\\ s of its own, never the process group's client.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import random
import socket
import threading
import time
import weakref
from collections import deque
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from . import attempts, interrupts
from .hooks import first_line, log
from .failure import FailureRecord, sanitize

KEY_COUNT = "n"  # the failure-record counter (``add``); the watchdog polls it
#: The connect back-off's jitter: the library's own generator (never the user's ``random`` stream).
_jitter = random.Random(int.from_bytes(os.urandom(8), "little"))
#: At most this many records are taken from one move of the counter (newest kept).
MAX_NEW_RECORDS = 256
#: A counter move larger than this in one read is corruption: no job publishes that many at once.
MAX_COUNTER_STEP = 1 << 20
#: Records of its own a rank keeps in the store; publishing more deletes the oldest.
MAX_OWN_RECORDS = 8
_U64 = 1 << 64

RECOVER_ROOT = "fth/recover"


def recovery_key(*parts: object) -> str:
    """``fth/recover/<torchrun restart>/<parts...>``: a key of this torchrun attempt's recoveries in place."""
    return "/".join((RECOVER_ROOT, str(attempts.restart()), *map(str, parts)))


def agreement_key(gen: int, part: str, rank: int | None = None) -> str:
    """``<g>/cause/<rank>``: ``rank``'s view of attempt ``g``'s failure (``FailureRecord``); ``<g>/live/<rank>``:
    the live state it holds (``LiveReport``); ``<g>/arrived``, ``<g>/stop``: how many ranks reached the
    recovery, how many end the job (``add``); ``<g>/decision``: rank 0's ``Decision``."""
    return recovery_key(gen, part) if rank is None else recovery_key(gen, part, rank)


def logger_version_key(index: int) -> str:  # rank 0's first attempt's ``index``-th numbered logger (``LoggerVersion``)
    return recovery_key("logger", index)


def keeper_key(rank: int) -> str:  # ``rank`` has a keeper (its process is replaced in place)
    return recovery_key("keeper", rank)


def seat_key(rank: int) -> str:  # who holds training rank ``rank`` (``Seat``)
    return recovery_key("spares", "seat", rank)


def order_key(launched_rank: int) -> str:  # what launched rank ``launched_rank`` is told (``Order``)
    return recovery_key("spares", "order", launched_rank)


def taken_key() -> str:  # how many spares were taken (``add``)
    return recovery_key("spares", "taken")


def claim_key(gen: int, rank: int) -> str:  # the first survivor to ``add`` here finds a spare for lost ``rank``
    return recovery_key("spares", gen, "claim", rank)


def answer_key(gen: int, rank: int) -> str:  # which spare replaces lost ``rank`` (``Answer``)
    return recovery_key("spares", gen, "answer", rank)


def live_group_prefix(name: str) -> str:  # the gloo group ``name`` live state is sent over, at this attempt
    return f"{attempts.namespace()}/{name}/"


def record_key(index: int) -> str:  # failure record number ``index`` (bounded JSON, :mod:`.failure`)
    return f"r/{index}"


def heartbeat_key(rank: int) -> str:  # heartbeat counter of ``rank`` (``add``), read by its ring neighbour
    return f"hb/{rank}"


def declared_key(rank: int) -> str:  # counts declarations of ``rank`` lost/silent/hung: only the first publishes
    return f"declared/{rank}"


def section_key(rank: int) -> str:  # what ``rank`` was in when an agreement found the ranks out of step
    return f"sec/{rank}"


def left_key(rank: int) -> str:  # ``rank`` stopped its watchdog cleanly: its silence and its end are no failure
    return f"left/{rank}"


def witness_key(rank: int) -> str:  # where ``rank``'s liveness helper accepts its watchers (``detect.witness``)
    return f"wit/{rank}"


def _wrap(value: int) -> int:
    """``value`` as the signed 64-bit integer the store keeps."""
    value %= _U64
    return value - _U64 if value >= 1 << 63 else value


class ConnectInProgress(RuntimeError):
    """A call cannot connect now: its connection's previous connect is still under way, or the
    process is exiting after the job failed (:func:`stop_connecting`). Raised inside the worker."""


#: How many times its timeout a connect may take: :func:`probe_store_port`'s, then c10d's two tries.
CONNECT_TRIES = 1 + 2
#: How long past that a connect may take (thread scheduling on a loaded machine).
CONNECT_SLACK = 1.0
#: Connects under way in this process -> (when each must be over, ``time.monotonic()``; its thread).
_connects: dict[object, tuple[float, threading.Thread]] = {}
_connects_lock = threading.Lock()
#: Set at the exit of a failed job (:func:`stop_connecting`): the exit waits only for connects under way.
_no_new_connects = False


def _after_fork_in_child() -> None:  # the threads inside those connects did not come along
    global _connects_lock
    _connects_lock = threading.Lock()
    _connects.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def stop_connecting() -> None:
    """From now on, a connection without a client fails its calls at once instead of connecting."""
    global _no_new_connects
    _no_new_connects = True


class StoreUnreachable(ConnectionError):
    """The store's port refused a connection or did not answer one (before c10d's connect would retry it)."""


#: Errors of a plain TCP connect that are evidence the store is gone or cannot be reached.
_GONE_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTDOWN,
                errno.ETIMEDOUT}


def store_evidence(host: str, port: int, timeout: float) -> str | None:
    """Evidence that the store at ``host:port`` is gone, or ``None`` when its port answers one plain TCP
    connect (the kernel's work: a store that is merely slow completes it)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except socket.timeout:
        return f"no answer to a TCP connect to {host}:{port} within {timeout:.1f} s"
    except OSError as err:
        if err.errno in _GONE_ERRNOS:
            reason = "refused" if err.errno == errno.ECONNREFUSED else (err.strerror or str(err))
            return f"a TCP connect to {host}:{port}: {reason}"
        return None  # anything else (no file descriptor left, ...) says nothing about the store


def probe_store_port(host: str, port: int, timeout: timedelta) -> None:
    """One plain TCP connect before a c10d client is made: a refused port fails at once (c10d would retry it)."""
    try:
        socket.create_connection((host, port), timeout=timeout.total_seconds()).close()
    except OSError as err:
        raise StoreUnreachable(f"the store at {host}:{port} is unreachable: {err}") from None


#: Backoff of a periodic loop's connection after a failed connect: first and longest wait (seconds;
#: doubled at each failure, randomised by x0.5 .. x1.5).
BACKOFF_FIRST = 0.25
BACKOFF_MAX = 4.0


class StoreCallTimeout(TimeoutError):
    """A store call did not return within its connection's budget (its host gone, or the link cut)."""


class Connection:
    """One store connection of this process's own, re-made from ``factory`` after a failed call. A call
    runs on the connection's worker thread and is waited for ``timeout`` + :data:`CALL_SLACK` at most (or
    until ``deadline``, ``time.monotonic()``); the calls after one that overran fail at once
    (:class:`StoreCallTimeout`) until it returns.
    """

    CALL_SLACK = 0.5

    def __init__(self, factory: Callable[[], dist.Store], timeout: timedelta, name: str, *,
                 backoff: bool = False, connect_timeout: timedelta | None = None) -> None:
        self._factory = factory
        self._timeout = timeout
        self._connect_timeout = connect_timeout or timeout  # bounds the wait for a connect at exit
        self.name = name
        #: A periodic loop's connection: after a failed connect its calls fail at once until a
        #: randomised backoff has passed, so that many ranks do not retry their connects in step.
        self.backoff = backoff
        self._retry_at = 0.0
        self._delay = 0.0
        self._store: dist.Store | None = None
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self.calls = 0
        self.deadline: float | None = None
        self._generation = 0  # bumped when the client is dropped: a late connect is not kept
        self._connecting = False

    def store(self) -> dist.Store:
        """The connected client, connecting first (outside the lock, one connect at a time: a call
        meanwhile fails at once; the exit waits for a connect under way)."""
        with self._lock:
            if self._store is not None:
                return self._store
            if self._connecting:
                raise ConnectInProgress("the connect to the store before this call has not ended yet")
            if _no_new_connects:
                raise ConnectInProgress("the process is exiting after the job failed: no new connect")
            wait = self._retry_at - time.monotonic()
            if wait > 0:
                raise ConnectInProgress(f"backing off after a failed connect: the next one in {wait:.1f} s")
            self._connecting = True
            generation = self._generation
        key = object()
        with _connects_lock:
            _connects[key] = (time.monotonic() + CONNECT_TRIES * self._connect_timeout.total_seconds() + CONNECT_SLACK,
                              threading.current_thread())
        connected = False
        try:
            store = self._factory()
            store.set_timeout(self._timeout)
            connected = True
        finally:
            with self._lock:
                self._connecting = False
                if self.backoff:
                    self._delay = 0.0 if connected else min(BACKOFF_MAX, max(BACKOFF_FIRST, 2 * self._delay))
                    self._retry_at = time.monotonic() + self._delay * _jitter.uniform(0.5, 1.5)
            with _connects_lock:
                _connects.pop(key, None)
        with self._lock:
            if self._generation == generation and self._store is None:
                self._store = store
            return store

    def reconnect(self) -> None:
        with self._lock:
            self._store = None
            self._generation += 1

    def close(self) -> None:
        with self._lock:
            self._store = None
            self._generation += 1
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()

    @interrupts.SECTION
    def call(self, method: str, *args):
        """``store.<method>(*args)``, bounded, in a deferred section (:mod:`.interrupts`); a failure
        drops this connection (the next call makes a new one) and is raised."""
        self.calls += 1
        with self._lock:
            if self._store is None and self._connecting:
                raise StoreCallTimeout("the store did not answer: its connect is still in progress")
            worker = self._worker
            if worker is not None and worker.stuck and not worker._stopped:
                # the call before overran its budget and keeps this client: a new connection per rank
                # would add to the load of a store server that is only slow
                raise StoreCallTimeout("the store did not answer: the call before this one has not returned yet")
            if worker is None or worker.stuck:
                worker = self._worker = _Worker(f"fth-store-{self.name}")
        budget = self._timeout.total_seconds() + self.CALL_SLACK
        if self.deadline is not None:
            budget = max(0.05, min(budget, self.deadline - time.monotonic()))
        try:
            return worker.run(lambda: getattr(self.store(), method)(*args), budget)
        except StoreCallTimeout:  # the client is kept (see above): a store that is gone is told by evidence
            raise
        except ConnectInProgress as err:
            raise StoreCallTimeout(f"the store did not answer: {err}") from None
        except Exception:
            self.reconnect()
            raise


_stuck: "weakref.WeakSet[_Worker]" = weakref.WeakSet()
#: Every worker (weakly held): the ones inside a call are ``busy``.
_workers: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


class Bounded:
    """A store whose every call (``bounded.add(key, 1)``) is ``conn``'s :meth:`Connection.call`: on a
    thread of its own, waited for within the connection's deadline (:class:`StoreCallTimeout` past it)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def __getattr__(self, method: str) -> Callable:
        return functools.partial(self._conn.call, method)


def unblock_stuck_calls(keep_ports: set[int], wait: float = 1.0, *, busy_too: bool = False) -> int:
    """At exit: a worker blocked in a store call would abort the interpreter's finalization. Shut
    down this process's connections to the store's ports so that those reads return, then give the
    workers ``wait`` seconds (``busy_too``, the job failed: also the calls that have not overrun
    their budget yet). Returns how many were stuck."""
    workers = [w for w in set(_stuck) | ({w for w in list(_workers) if w.busy} if busy_too else set())
               if w._thread.is_alive()]
    # a connect cannot be cut short: its thread is waited for until its bound
    with _connects_lock:
        connects = [c for c in _connects.values() if c[1].is_alive() and c[1] is not threading.current_thread()]
    if not workers and not connects:
        return 0
    for worker in workers:
        worker.stuck = True  # no further call is given to it ...
        worker._stopped = True  # ... and it ends as soon as its call returns
    if workers:
        interrupts.cut_connections_to(keep_ports)
    deadline = time.monotonic() + wait
    for worker in workers:
        worker._thread.join(timeout=max(0.0, deadline - time.monotonic()))
    for end, thread in connects:
        thread.join(timeout=max(0.0, end - time.monotonic()))
    return len({w._thread for w in workers} | {t for _, t in connects})


class _Worker:
    """A thread that runs one store call at a time for a :class:`Connection`; the hand-over is two
    plain locks used as binary semaphores (``_go``: a job is there; ``_fin``: its result is)."""

    def __init__(self, name: str) -> None:
        self.stuck = False
        self.busy = False
        self._job: Callable[[], object] | None = None
        self._go = threading.Lock()
        self._go.acquire()
        self._fin = threading.Lock()
        self._fin.acquire()
        self._result: tuple[bool, object] = (True, None)
        self._stopped = False
        self._late = False  # the call under way overran its budget: nobody waits for its result
        self._state = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        _workers.add(self)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            if self._stopped:
                return
            try:
                result: tuple[bool, object] = (True, self._job())
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                result = (False, err)
            with self._state:
                self._result = result
                self.busy = False
                if self._late:  # its caller gave up waiting: nobody takes the result; ready again
                    self._late = False
                    self.stuck = False
                    _stuck.discard(self)
                else:
                    self._fin.release()
            if self._stopped:  # stopped at exit while in the call
                return

    def run(self, job: Callable[[], object], budget: float):
        self._job = job
        self.busy = True
        self._go.release()
        if not self._fin.acquire(timeout=budget):
            with self._state:
                if not self._fin.acquire(blocking=False):  # (it may have returned just now)
                    self._late = True
                    self.stuck = True
                    _stuck.add(self)
                    raise StoreCallTimeout(f"a store call did not return within {budget:.1f} s")
        ok, value = self._result
        if ok:
            return value
        raise value  # type: ignore[misc]

    def stop(self) -> None:
        self._stopped = True
        if not self.busy:
            with contextlib.suppress(RuntimeError):  # already released: the loop is about to look
                self._go.release()  # wakes the idle loop, which sees it stopped
        if threading.current_thread() is not self._thread and not self.stuck:
            self._thread.join(timeout=1.0)


class Schema:
    """Typed access to the keys of one run over one :class:`Connection`."""

    def __init__(self, conn: Connection, world_size: int) -> None:
        self.conn = conn
        self.world_size = world_size
        self._own: deque[int] = deque()
        self._known: dict[str, int] = {}

    # -- counters ----------------------------------------------------------------------------------
    @interrupts.SECTION
    def _counter(self, key: str, amount: int) -> int:
        """``add(key, amount)``; a key holding something that is not an integer is repaired."""
        try:
            value = int(self.conn.call("add", key, amount))
        except StoreCallTimeout:
            raise  # the store does not answer: nothing to repair
        except Exception as err:
            if not self._repair(key):
                raise
            log(logging.WARNING, "store key %s held a non-integer value (%s); reset to %d", key,
                sanitize(first_line(err, None) or type(err).__name__)[:120], self._known.get(key, 0))
            value = int(self.conn.call("add", key, amount))
        self._known[key] = value
        return value

    def _repair(self, key: str) -> bool:
        """True if ``key`` held a non-integer (then it is set back to the last value seen)."""
        try:
            raw = self.conn.call("get", key)
        except Exception:  # noqa: BLE001 - the store itself is unreachable: not a bad value
            return False
        try:
            int(bytes(raw[:32]).decode("ascii"))
            return False
        except (UnicodeDecodeError, ValueError):
            pass
        self.conn.call("set", key, str(self._known.get(key, 0)))
        return True

    def count(self) -> int:
        return self._counter(KEY_COUNT, 0)

    def beat(self, rank: int) -> int:
        return self._counter(heartbeat_key(rank), 1)

    def heartbeat_of(self, rank: int) -> int:
        return self._counter(heartbeat_key(rank), 0)

    def claim_declaration(self, rank: int) -> bool:
        """True for the first rank to declare ``rank`` lost/silent/hung (only it publishes)."""
        return self._counter(declared_key(rank), 1) == 1

    # -- records -----------------------------------------------------------------------------------
    @interrupts.SECTION
    def publish(self, record: FailureRecord) -> int:
        """Write ``record`` under a new index; returns the index. A deferred section: an index is
        never taken without its record written (:mod:`.interrupts`)."""
        index = self._counter(KEY_COUNT, 1)
        self.conn.call("set", record_key(index), record.to_json())
        self._own.append(index)
        while len(self._own) > MAX_OWN_RECORDS:
            old = self._own.popleft()
            with contextlib.suppress(Exception):  # bounded growth is a nicety; never mask the failure
                self.conn.call("delete_key", record_key(old))
        return index

    def read(self, index: int) -> FailureRecord | None:
        """Record ``index``, or ``None`` (absent, unreadable or invalid: never executed)."""
        key = record_key(index)
        try:
            if not self.conn.call("check", [key]):
                return None
            data = self.conn.call("get", key)
        except Exception as err:  # noqa: BLE001
            log(logging.WARNING, "could not read store key %s: %s", key, first_line(err) or err)
            return None
        record = FailureRecord.from_json(data, world_size=self.world_size, key=f"{KEY_COUNT}-indexed {key}")
        return record if record is None or record.rank is not None else None  # a published one names its rank

    def new_indices(self, last: int, count: int) -> list[int]:
        """The record indices after ``last`` up to ``count`` (wrap-aware). A move backwards or
        larger than :data:`MAX_COUNTER_STEP` is corruption: a warning, and no index."""
        step = (count - last) % _U64
        if step == 0:
            return []
        if step > MAX_COUNTER_STEP:
            log(logging.WARNING, "store key %s moved from %d to %d, which no job produces (corrupted or written "
                "by another program); carrying on from %d", KEY_COUNT, last, count, count)
            return []
        first = max(1, step - MAX_NEW_RECORDS + 1)
        return [_wrap(last + k) for k in range(first, step + 1)]

    # -- a rank that left cleanly: its silence and its end are not a failure ---------------------------
    def mark_left(self, rank: int) -> None:
        self.conn.call("set", left_key(rank), b"1")

    def clear_left(self, rank: int) -> None:
        self.conn.call("delete_key", left_key(rank))

    def has_left(self, rank: int) -> bool:
        return bool(self.conn.call("check", [left_key(rank)]))

    # -- the section of an out-of-step agreement ------------------------------------------------------
    def set_section(self, rank: int, text: str) -> None:
        self.conn.call("set", section_key(rank), text.encode("utf-8")[:400])

    def section_of(self, rank: int) -> str | None:
        key = section_key(rank)
        try:
            if not self.conn.call("check", [key]):
                return None
            return sanitize(bytes(self.conn.call("get", key)[:400]).decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001
            return None

    def remove_run_keys(self, rank: int, ranks, *, shared: bool) -> None:
        """Delete this rank's keys of the run and, with ``shared``, the keys every rank wrote to (the
        record counter, the records, the declarations). Call it once no rank reads them any more."""
        keys = [heartbeat_key(rank), section_key(rank), left_key(rank), witness_key(rank)]
        if shared:
            count = self.count()
            keys += [record_key(i) for i in range(1, count + 1)] + [declared_key(r) for r in ranks] + [KEY_COUNT]
        for key in keys:
            self.conn.call("delete_key", key)


# -- keys torch writes, which the library deletes (``launchers/compat_torchrun.py``) ----------------------
def gloo_address_key(rank: int, group: str | None = None) -> str:
    """The key under which gloo context 0 of a group published ``rank``'s address in torchrun's shared
    store (torch 2.13, private; checked at start against this rank's own): the default group's
    ``default_pg/0//cpu//0/<rank>``, group ``N``'s ``default_pg/0//N//cpu//0/<rank>``."""
    return f"default_pg/0//{'' if group is None else group + '//'}cpu//0/{rank}"
