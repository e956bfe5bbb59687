"""Every use of torch's private DataLoader API (checked against torch 2.13.0 by :func:`check` when a
``RestartableDataLoader`` is made, naming what a torch lacks), and torch's multiprocessing iterator
hardened from the outside so that a worker's death, stall or stuck start is raised as :class:`WorkerLost` from
``next()`` and never hangs or kills the main process (docs/dataloader.md, "How")."""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing
import os
import queue
import select
import signal
import tempfile
import threading
import time
from multiprocessing import context as _mpc
from multiprocessing.connection import wait as _mp_wait
from multiprocessing.reduction import ForkingPickler as _ForkingPickler
from typing import Any

import torch
from torch.utils.data import DataLoader, _utils, dataloader

from ..core import procfs as _procfs
from ..core.compat_torch import lacking
from ..core.config import WORKER_POLL, WORKER_REAP, settings
from ..core.failure import Ended
from ..core.hooks import log

CHECKED_AGAINST = "2.13.0"
#: What is used: a module's or class's name, or (``"Class.method"``) an attribute that method sets.
_REQUIRED = (
    ("DataLoader", "_index_sampler"),  # the batch indices of an epoch (a property)
    ("DataLoader.__init__", "_IterableDataset_len_called"),
    ("DataLoader.__init__", "_iterator"),  # a persistent iterator (torchdata's loader too)
    ("dataloader", "_SingleProcessDataLoaderIter"),
    ("dataloader", "_MultiProcessingDataLoaderIter"),
    *(("_MultiProcessingDataLoaderIter.__init__", n)
      for n in ("_workers", "_worker_result_queue", "_worker_pids_set", "_shutdown", "_data_queue",
                "_index_queues")),
    ("_BaseDataLoaderIter.__init__", "_pin_memory"),
    ("_BaseDataLoaderIter.__init__", "_timeout"),
    *(("_MultiProcessingDataLoaderIter._reset", n) for n in ("_rcvd_idx", "_task_info", "_workers_status")),
    *(("_MultiProcessingDataLoaderIter", n) for n in ("_reset", "_try_get_data", "_get_data", "_shutdown_workers")),
    ("signal_handling", "_remove_worker_pids"),
)


def check() -> None:
    """Raise ``RuntimeError`` naming every private DataLoader name this torch lacks."""
    objects = {"DataLoader": DataLoader, "dataloader": dataloader, "signal_handling": _utils.signal_handling,
               **{name: getattr(dataloader, name, None) for name in ("_BaseDataLoaderIter", "_MultiProcessingDataLoaderIter")}}
    if missing := lacking(_REQUIRED, objects):
        raise RuntimeError(f"RestartableDataLoader needs torch's {', '.join(missing)}, which torch {torch.__version__} "
                           f"does not have (checked against torch {CHECKED_AGAINST})")


# -- what the loader reads of torch's loader and iterators -------------------------------------------------
def index_sampler(loader: Any) -> Any:
    """The loader's batch indices of an epoch (its batch sampler, or its sampler without batching)."""
    return loader._index_sampler


def received(it: Any) -> int:
    """How many batches torch's multi-process iterator has handed out in order."""
    return it._rcvd_idx


def in_flight(it: Any) -> set[int]:
    """The batch indices torch's multi-process iterator has sent to workers and not handed out."""
    return set(it._task_info)


def shut_down(it: Any, default: bool) -> bool:
    """torch's iterator was shut down (``default``: it was never started)."""
    return it.__dict__.get("_shutdown", default)


def worker_pids(it: Any) -> list[int]:
    """The pids of the running workers of torch's iterator."""
    return [w.pid for w in it.__dict__.get("_workers", ()) if w.pid is not None and w.exitcode is None]


def len_called(loader: Any) -> Any:
    """Whether ``len(loader)`` was asked (torch's "samples have been fetched" warning of an IterableDataset)."""
    return loader._IterableDataset_len_called


class LoaderView:
    """What torch's iterator reads from its loader, with the index sampler, the multiprocessing
    context and the generator replaced (lent for one call)."""

    def __init__(self, loader: Any, index_sampler: Any, ctx: Any, generator: Any) -> None:
        self._loader = loader
        self._index_sampler = index_sampler
        self.multiprocessing_context = ctx
        self.generator = generator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def single_process_iter(view: LoaderView) -> Any:
    """torch's iterator of a loader without workers."""
    return dataloader._SingleProcessDataLoaderIter(view)


def reset(it: Any, view: LoaderView) -> None:
    """A persistent iterator's next epoch, from ``view``'s index sampler."""
    it._reset(view, first_iter=False)


# -- the hardened iterator ---------------------------------------------------------------------------------
FD_MARGIN = 10  # files _fd_limit_reached opens
FD_LIMIT_MESSAGE = (
    "Too many open files. Communication with the workers is no longer possible. Please increase the "
    "limit using `ulimit -n` in the shell or change the sharing strategy by calling "
    "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code"
)


def _fd_limit_reached() -> bool:
    """Whether this process is within ``FD_MARGIN`` descriptors of its open-files limit (as torch tells)."""
    try:
        with contextlib.ExitStack() as stack:
            for _ in range(FD_MARGIN):
                stack.enter_context(tempfile.TemporaryFile())
    except OSError as exc:
        return exc.errno == errno.EMFILE
    return False


class _SharedFlag:
    """``multiprocessing.Event`` without the lock, which a killed worker could leave held."""

    def __init__(self) -> None:
        self._value = multiprocessing.RawValue("b", 0)

    def is_set(self) -> bool:
        return bool(self._value.value)

    def set(self) -> None:
        self._value.value = 1


class _MarksStart:
    """A worker process that sets ``fth_started`` first thing in ``run()`` (right after multiprocessing's
    bootstrap, before torch's worker loop): one without it has not reached Python code of its own
    (see ``_Hardened._fth_stuck_at_start``). A forked one first freezes what it inherited
    (:func:`.procfs.child_starts`): a process group left in a reference cycle (a DDP of an earlier
    attempt, a test's group) would be destroyed by its first collection, whose gloo destructor waits
    for threads the child does not have, holding the GIL: the worker hung before its first batch."""

    fth_collects: bool | None = None  #: a forked worker: the parent's collector was enabled at the fork

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fth_started = _SharedFlag()

    def run(self) -> None:
        if self.fth_collects is not None:
            _procfs.child_starts(self.fth_collects)
        self.fth_started.set()
        super().run()


# module-level: a spawned worker's process object is pickled by reference to its class
class _ForkProcess(_MarksStart, _mpc.ForkProcess):
    def start(self) -> None:
        with _procfs.collector_held() as self.fth_collects:  # the child: held off until run()
            super().start()


class _SpawnProcess(_MarksStart, _mpc.SpawnProcess):
    pass


class _ForkServerProcess(_MarksStart, _mpc.ForkServerProcess):
    pass


def _hardened(base: type, process: type) -> type:
    """The multiprocessing context class ``base`` whose ``Event()`` is a :class:`_SharedFlag` and whose
    processes mark their start."""
    return type("_" + base.__name__, (base,), {"Event": lambda self: _SharedFlag(), "Process": process,
                                                "__module__": __name__})


_CONTEXTS = {"fork": _hardened(_mpc.ForkContext, _ForkProcess), "spawn": _hardened(_mpc.SpawnContext, _SpawnProcess),
             "forkserver": _hardened(_mpc.ForkServerContext, _ForkServerProcess)}


def hardened_context(method: str) -> _mpc.BaseContext:
    """A multiprocessing context for ``method`` whose ``Event()`` is lock-free and whose processes mark
    their start. torch's worker loop seeds
    ``numpy.random``, which numpy 2 imports lazily; an import in a worker forked while another thread
    imported can fail (a restart for nothing): imported here first."""
    if _utils.HAS_NUMPY:
        import numpy.random  # noqa: F401
    return _CONTEXTS[method]()


class WorkerLost(RuntimeError):
    """A worker of the current iterator died or stalled (raised from ``next()``, in torch's words)."""

    def __init__(self, kind: str, worker_id: int | None = None, detected_at: float | None = None, message: str = "") -> None:
        if detected_at is None:  # rebuilt from its message alone, as code that re-raises a type does
            message, detected_at = kind, time.time()
            kind = "stall" if "timed out" in message else "died"
        super().__init__(message or f"DataLoader worker {worker_id} {'stalled' if kind == 'stall' else 'exited unexpectedly'}")
        self.kind = kind  # "died", "stall" or "start" (stuck before its first Python line)
        self.worker_id = worker_id
        self.detected_at = detected_at  # time.time() when it was first seen
        self.pids: list | None = None  # [(pid, exitcode)] when the iterator was already aborted
        self.exited: list[int] = []  # with pids: the worker ids that had exited before


_WAKE = object()  # put in the main thread's queue by the pump to wake it at once


class _StopPipe:
    """The pump's stop signal: ``set()`` writes a byte (a forked child may hold the write end: no EOF)
    and closes the write end; the pump closes the read end."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._r

    def set(self) -> None:
        with self._lock:
            w, self._w = self._w, None
        if w is None:
            return
        try:
            os.write(w, b"\0")
        except OSError:  # the pump has already ended and closed its end
            pass
        finally:
            os.close(w)


def _pump(reader, sentinels: dict, out: queue.SimpleQueue, stop: _StopPipe, exits: list) -> None:
    """Move results, unpickled (else the exception), from the workers' pipe (``reader``; ``None``: only
    watch) to ``out``; note each worker exit in ``exits`` and wake the main thread, which decides."""
    sentinels = dict(sentinels)
    reader_fd = reader.fileno() if reader is not None else None
    poller = select.poll()  # registered once: a batch costs one poll() and the pipe reads
    for fd in (stop.fileno(), *sentinels, *([reader_fd] if reader is not None else [])):
        poller.register(fd, select.POLLIN)
    try:
        while sentinels or reader is not None:
            ready = {fd for fd, _ in poller.poll()}
            if stop.fileno() in ready:
                return
            for fd in ready & sentinels.keys():
                poller.unregister(fd)
                exits.append((sentinels.pop(fd), time.time()))
                out.put(_WAKE)
            if reader_fd in ready:
                data = reader.recv_bytes()
                try:
                    data = _ForkingPickler.loads(data)
                except Exception as exc:  # noqa: BLE001 - e.g. a tensor whose sender just died
                    data = exc
                out.put(data)
    except (OSError, ValueError, EOFError):  # queues closed under us at shutdown
        return
    finally:
        os.close(stop.fileno())


class _Hardened:
    """Mix-in over torch's / torchdata's multiprocessing iterator."""

    def _fth_setup(self) -> None:
        if self.__dict__.get("_fth_ready"):
            return
        self._fth_ready = True
        if self._worker_pids_set:  # before anything else: no SIGCHLD error in user code
            _utils.signal_handling._remove_worker_pids(id(self))
            self._worker_pids_set = False
        self._fth_death: list = []
        self._fth_sentinels = {w.sentinel: i for i, w in enumerate(self._workers)}
        self._fth_start_deadline = settings().worker_start_timeout.total_seconds()
        # worker id -> (since, its CPU ticks then) while it has not marked its start
        self._fth_unstarted = {i: (time.monotonic(), _procfs.cpu_ticks(_procfs.stat_fields(w.pid)))
                               for i, w in enumerate(self._workers) if hasattr(w, "fth_started") and not w.fth_started.is_set()}
        read = not self._pin_memory  # with pinning, torch's pin thread reads the pipe
        self._fth_source = queue.SimpleQueue() if read else self._data_queue
        self._fth_stop = _StopPipe()
        threading.Thread(target=_pump, name="fth-dataloader-pump", daemon=True, args=(
            self._worker_result_queue._reader if read else None, dict(self._fth_sentinels),
            self._fth_source if read else queue.SimpleQueue(), self._fth_stop, self._fth_death)).start()

    def _reset(self, loader, first_iter=False, *args, **kwargs):
        self._fth_setup()
        return super()._reset(loader, first_iter, *args, **kwargs)

    def fth_dead_worker(self) -> tuple[int, float] | None:
        """``(worker_id, time seen)`` of a worker that exited while torch still had it active, or ``None``."""
        if not self.__dict__.get("_fth_ready"):
            return None
        status = self.__dict__.get("_workers_status")
        seen = {wid for wid, _ in self._fth_death}
        for s in _mp_wait(list(self._fth_sentinels), timeout=0):  # exits the pump has not noted yet
            if self._fth_sentinels[s] not in seen:
                self._fth_death.append((self._fth_sentinels[s], time.time()))
        return next(((wid, t) for wid, t in list(self._fth_death) if status is None or status[wid]), None)

    def _fth_check(self) -> None:
        dead = self.fth_dead_worker()
        if dead is not None:
            pid = self._workers[dead[0]].pid
            raise WorkerLost("died", dead[0], dead[1], f"DataLoader worker (pid(s) {pid}) exited unexpectedly")
        stuck = self._fth_stuck_at_start(time.monotonic())
        if stuck is not None:
            raise WorkerLost("start", stuck, time.time(), (
                f"stuck at its start: not in Python {self._fth_start_deadline:g} s after it was started, asleep "
                "and no CPU time used over that time (e.g. a fork that hung in the child, CPython gh-112275)"))

    def _fth_stuck_at_start(self, now: float) -> int | None:
        """The id of a worker stuck before its first Python line, on evidence: it has not marked its start,
        and over a whole start deadline its CPU time did not change and it is asleep now. One that used CPU
        or is runnable (busy, or waiting for a CPU on a loaded host) is judged again over the next."""
        for wid, (since, ticks) in list(self._fth_unstarted.items()):
            worker = self._workers[wid]
            if worker.fth_started.is_set():
                del self._fth_unstarted[wid]
                continue
            if now - since < self._fth_start_deadline:
                continue
            fields = _procfs.stat_fields(worker.pid)
            if not _procfs.is_running(fields):
                continue  # exited: a death, told by its sentinel
            asleep, used = fields[_procfs.STATE] == "S", _procfs.cpu_ticks(fields)
            if asleep and used == ticks and not worker.fth_started.is_set():  # read after the stat: no race
                return wid
            self._fth_unstarted[wid] = (now, used)
        return None

    def _try_get_data(self, timeout=_utils.MP_STATUS_CHECK_INTERVAL):
        self._fth_setup()
        end = time.monotonic() + timeout
        while True:
            self._fth_check()
            remaining = end - time.monotonic()
            if remaining <= 0:
                return (False, None)
            try:
                item = self._fth_source.get(timeout=min(remaining, WORKER_POLL))
            except queue.Empty:
                continue
            if item is _WAKE:
                continue
            if isinstance(item, BaseException):
                self._fth_unreadable(item)
            return (True, item)

    def _fth_unreadable(self, exc: BaseException) -> None:
        """A result that cannot be unpickled: ``WorkerLost`` if a worker's exit shows within
        ``WORKER_REAP``, else the error (torch's advice when the open files ran out)."""
        end_wait = time.monotonic() + WORKER_REAP
        while time.monotonic() < end_wait:
            self._fth_check()
            _mp_wait(list(self._fth_sentinels), timeout=WORKER_POLL)
        if _fd_limit_reached():
            raise RuntimeError(FD_LIMIT_MESSAGE) from exc
        raise exc

    def _get_data(self):
        if self._timeout > 0:
            ok, data = self._try_get_data(self._timeout)
            if ok:
                return data
            info = self._task_info.get(self._rcvd_idx)
            raise WorkerLost("stall", info[0] if info else None, time.time(),
                             f"DataLoader timed out after {self._timeout} seconds")
        while True:
            ok, data = self._try_get_data(3600.0)
            if ok:
                return data

    def _shutdown_workers(self):
        stop = self.__dict__.get("_fth_stop")
        if stop is not None:
            stop.set()
        if not self.__dict__.get("_shutdown", True) and any(map(_closed_by_collection, self.__dict__.get("_index_queues", ()))):
            self.abort()  # the workers would never read torch's "exit" (its join: 5 s each, then SIGTERM)
            return None
        return super()._shutdown_workers()

    def abort(self) -> list[tuple[int, int | None]]:
        """SIGKILL every worker by pid, reap them, shut down; ``[(pid, exitcode)]``. Never waits on anything
        a worker shares (safe on a half-built iterator)."""
        stop = self.__dict__.get("_fth_stop")
        if stop is not None:
            stop.set()
        workers = list(self.__dict__.get("_workers", ()))
        self.fth_exited_before_abort = [wid for wid, w in enumerate(workers) if w.pid is not None and _exited(w)]
        for w in workers:
            if w.pid is not None and w.exitcode is None:
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for w in workers:
            w.join(timeout=WORKER_REAP)
        if self.__dict__.get("_worker_pids_set"):
            _utils.signal_handling._remove_worker_pids(id(self))
            self._worker_pids_set = False
        if "_shutdown" in self.__dict__ and "_workers_status" in self.__dict__:
            try:
                super()._shutdown_workers()
            except Exception:  # noqa: BLE001 - the workers are gone; nothing left to save
                self._shutdown = True
        else:
            self.__dict__["_shutdown"] = True
        return [(w.pid, w.exitcode) for w in workers]


class TorchWorkersIter(_Hardened, getattr(dataloader, "_MultiProcessingDataLoaderIter", object)):  # check() names it
    """torch's multiprocessing iterator, hardened (map-style datasets)."""


def construct(cls, loader, *args):
    """``cls(loader, *args)``; if that raises, the workers it had started are killed first."""
    it = cls.__new__(cls)
    try:
        it.__init__(loader, *args)
    except BaseException as exc:
        dead = it.fth_dead_worker() if "_workers" in it.__dict__ else None
        pids = it.abort()
        lost = exc if isinstance(exc, WorkerLost) else None if dead is None else WorkerLost("died", *dead)
        if lost is None:
            raise
        lost.pids, lost.exited = pids, it.fth_exited_before_abort
        if lost is exc:
            raise
        raise lost from exc
    return it


def _closed_by_collection(q: Any) -> bool:
    """A worker's index queue was finalized without ``close()``: a garbage collection took the iterator
    with its queues (a persistent one in a cycle: the failed attempt's, at a recovery's collection), and
    ran the queues' finalizers first (weakref callbacks before ``__del__``). Its feeder thread ends:
    nothing put in it now reaches the worker."""
    close = q.__dict__.get("_close")  # multiprocessing's private Finalize once its feeder started (checked on 3.11)
    return close is not None and not close.still_active()


def _exited(worker) -> bool:
    """The worker has exited or is exiting (:func:`~..core.procfs.exiting`: not yet waitable)."""
    if worker.exitcode is not None:
        return True
    fields = _procfs.stat_fields(worker.pid)
    return not _procfs.is_running(fields) or _procfs.exiting(fields)


def describe_exit(exitcode: int | None) -> tuple[str | None, str]:
    """``("SIGKILL", "killed by SIGKILL")`` or ``(None, "exited with code 1")``."""
    if exitcode is None:
        return None, "did not exit"
    ended = Ended(signal=-exitcode) if exitcode < 0 else Ended(exit_code=exitcode)
    return ended.signal_name, ended.describe()


def reap_workers(state: Any) -> None:
    """``COLLECTED``: DataLoader workers (torch's or this package's) still running once the failed
    attempt's loaders are collected: joined, then killed."""
    killed, deadline = 0, time.monotonic() + WORKER_REAP
    for child in multiprocessing.active_children():
        target = getattr(child, "_target", None)
        if not (getattr(target, "__module__", "") or "").startswith(("torch.utils.data", __name__.rsplit(".", 1)[0])):
            continue
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join(1.0)
            killed += 1
    if killed:
        log(logging.WARNING, "killed %d DataLoader worker(s) of the failed attempt that were still running", killed)
