"""A DataLoader whose workers can die: it starts new ones and resumes at the exact next batch
(docs/dataloader.md, "How": map-style batches not yet yielded are sent again; iterable datasets
resume from torchdata's snapshot, :mod:`.compat_torchdata`)."""

from __future__ import annotations

import collections
import logging
import multiprocessing
import signal
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset

from . import _resume
from . import compat_dataloader as _compat
from ..core.hooks import log
from .compat_dataloader import LoaderView, TorchWorkersIter, WorkerLost, construct, describe_exit, hardened_context

__all__ = ["DataLoaderRestartError", "RestartableDataLoader", "WorkerRestart", "make_restartable"]

_START_METHODS = ("fork", "spawn", "forkserver")
#: A pass resumed from ``load_state_dict`` and dropped after at most this many batches (a peek such
#: as ``next(iter(loader))``) leaves the restored position to the next ``iter()``.
PEEK_BATCHES = 1
_T_co = TypeVar("_T_co", covariant=True)


@dataclass
class WorkerRestart:
    """One restart of a loader's workers (``loader.restarts`` holds them in order).

    Attributes:
        epoch: the loader's pass (``iter()`` calls before it), not the training epoch: that is
            ``sampler_epoch``, what ``set_epoch`` was given (``None`` without ``set_epoch``).
        batch_index: the batch of the pass it resumed at (the first not yet yielded).
        worker_id, worker_pid, signal, exitcode, reason: the worker lost and how (``"SIGKILL"``,
            ``-9``, ``"killed by SIGKILL"``; a stall: exit code ``None``, ``"stalled for more than 5 s"``; a
            worker stuck at its start, killed: ``"stuck at its start: not in Python 10 s after ...; killed by SIGKILL"``).
        detected_at: ``time.time()`` when it was seen; ``restart_seconds``: from then to the new
            workers started; ``recovery_seconds``: to the next batch (``None`` until then).
        start_method: how the new workers were started (``"fork"``, ``"spawn"``, ...).
        also_lost: ``(worker_id, pid, reason)`` of other workers lost with it (one restart for all).
    """

    epoch: int
    batch_index: int
    worker_id: int | None
    worker_pid: int | None
    signal: str | None
    exitcode: int | None
    reason: str
    detected_at: float
    restart_seconds: float = 0.0
    recovery_seconds: float | None = None
    start_method: str = ""
    also_lost: tuple[tuple[int, int | None, str], ...] = ()
    sampler_epoch: int | None = None

    def describe(self) -> str:
        also = "".join(f", worker {w} (pid {p}) {why}" for w, p, why in self.also_lost)
        return (f"{where(self.epoch, self.batch_index, self.sampler_epoch)}: worker {self.worker_id} "
                f"(pid {self.worker_pid}) {self.reason}{also}")

    def torch_message(self, timeout: float) -> str:
        """The loss in the words torch's own DataLoader uses for it (code matching them still works)."""
        if self.exitcode is None:
            return f"DataLoader timed out after {timeout:g} seconds"
        if self.exitcode < 0:
            try:
                name = signal.strsignal(-self.exitcode) or self.signal
            except ValueError:
                name = self.signal
            return f"DataLoader worker (pid {self.worker_pid}) is killed by signal: {name}."
        return f"DataLoader worker (pid(s) {self.worker_pid}) exited unexpectedly with exit code {self.exitcode}."


def where(pass_index: int, batch: int, sampler_epoch: int | None) -> str:
    """A position in the loader's words: ``batch 8 of pass 5 (set_epoch(2))``."""
    told = f" (set_epoch({sampler_epoch}))" if sampler_epoch is not None else ""
    return f"batch {batch} of pass {pass_index + 1}{told}"


class DataLoaderRestartError(RuntimeError):
    """Raised when a worker is lost and the loader's ``max_restarts`` budget is already spent.

    Attributes:
        restarts: every restart made, then the loss that was not restarted.
        max_restarts: the budget.
    """

    def __init__(self, restarts: list[WorkerRestart] | str, max_restarts: int | None = None, timeout: float = 0) -> None:
        if isinstance(restarts, str):  # rebuilt from its message alone, as code that re-raises a type does
            super().__init__(restarts)
            self.restarts, self.max_restarts, self.timeout = [], max_restarts, timeout
            return
        self.restarts, self.max_restarts, self.timeout = list(restarts), max_restarts, timeout
        last = restarts[-1]
        lines = [f"DataLoader worker lost after {max_restarts} restart(s) (max_restarts={max_restarts}): {last.describe()}",
                 *(f"  restart {i + 1}: {r.describe()}" for i, r in enumerate(restarts[:-1])),
                 f"  not restarted: {last.describe()}", f"  as torch reports it: {last.torch_message(timeout)}"]
        super().__init__("\n".join(lines))

    def __reduce__(self):  # the constructor's arguments, not ``args``: picklable across processes
        return (type(self), (self.restarts, self.max_restarts, self.timeout))


def _check_arguments(max_restarts: object, start_method: object) -> None:
    is_int = isinstance(max_restarts, int) and not isinstance(max_restarts, bool)
    if not is_int or max_restarts < 0:
        raise (ValueError if is_int else TypeError)(
            f"RestartableDataLoader(max_restarts={max_restarts!r}): max_restarts must be an int >= 0 (0 disables "
            f"restarts), got {type(max_restarts).__name__}")
    if start_method is not None and start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"RestartableDataLoader(restart_start_method={start_method!r}): must be None (automatic) or "
                         f"one of {list(_START_METHODS)} available here: {multiprocessing.get_all_start_methods()}")


class RestartableDataLoader(DataLoader[_T_co]):
    """A ``DataLoader`` that restarts dead workers and resumes at the exact next batch.

    All arguments are identical to ``torch.utils.data.DataLoader``, plus:

    Args:
        max_restarts: how many times, over the loader's lifetime, workers may be restarted
            (``int >= 0``, default 3). One more loss raises :class:`DataLoaderRestartError`.
        restart_start_method: how restarted workers are started: ``"fork"``, ``"spawn"``,
            ``"forkserver"``, or ``None`` (default): an explicit ``multiprocessing_context``'s,
            else ``"fork"`` where available and CUDA is not initialized, else the default.

    ``restarts`` lists every :class:`WorkerRestart` in order; ``restart_count`` is its length.

    Examples:
        .. code-block:: python

            loader = RestartableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=4, max_restarts=5)
            for batch in loader:       # a worker SIGKILLed here is replaced; no batch lost or repeated
                train_step(batch)

    Raises:
        TypeError, ValueError: for a bad ``max_restarts`` / ``restart_start_method`` (and whatever
            ``DataLoader`` itself refuses).
        DataLoaderRestartError: from ``next()``, when the budget is spent.
    """

    def __init__(self, dataset, batch_size: int | None = 1, shuffle: bool | None = None, sampler=None,
                 batch_sampler=None, num_workers: int = 0, collate_fn=None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, max_restarts: int = 3,
                 restart_start_method: str | None = None) -> None:
        _compat.check()  # every private name of torch's it uses, named if this torch lacks one
        _check_arguments(max_restarts, restart_start_method)
        torch_args = dict(locals())  # DataLoader's arguments, as given
        for name in ("self", "__class__", "max_restarts", "restart_start_method"):
            torch_args.pop(name, None)
        if num_workers and isinstance(dataset, IterableDataset):
            from . import compat_torchdata  # noqa: F401 - torchdata's too, checked by its import
        super().__init__(**torch_args)
        self.max_restarts = max_restarts
        self.restart_start_method = restart_start_method
        self.restarts: list[WorkerRestart] = []
        self._fth_user_method = None if multiprocessing_context is None else self.multiprocessing_context.get_start_method()
        self._fth_epochs = 0
        self._fth_persistent = None  # the persistent workers' iterator (map-style)
        self._fth_stateful = None  # the torchdata loader (iterable datasets)
        self._fth_run = None  # weak reference to the epoch being iterated
        self._fth_pending = None  # resume: a snapshot from load_state_dict(), used by the next iter()
        self._fth_restored = None  # resume: that snapshot and the pass started from it (a peek gives it back)

    @property
    def restart_count(self) -> int:
        """How many times workers were restarted over the loader's lifetime."""
        return len(self.restarts)

    @property
    def worker_pids(self) -> list[int]:
        """The pids of the workers currently serving this loader (for diagnostics and tests)."""
        run = self._fth_run() if self._fth_run is not None else None
        it = getattr(run, "it", None)
        return [] if it is None or _compat.shut_down(it, True) else _compat.worker_pids(it)

    def state_dict(self) -> dict[str, Any]:
        """Where the current pass is, as torchdata's ``StatefulDataLoader`` gives it: the batches
        yielded and what decides the order (plain types, ``torch.load(..., weights_only=True)``)."""
        if self._fth_pending is not None:  # loaded and not iterated yet: the same snapshot
            return dict(self._fth_pending)
        run = self._fth_run() if self._fth_run is not None else None
        if run is None:  # no epoch in progress: the next iter() starts epoch `_fth_epochs`
            if isinstance(self.dataset, IterableDataset):
                return _resume.iterable_state(self._fth_epochs - 1, 0, True, None)
            return _resume.map_state(self, self._fth_epochs - 1, 0, True, None)
        restored = self._fth_restored
        if restored is not None and restored.taken and restored.run() is run:
            restored.saved = True  # its progress may be in a checkpoint now: a later iter() does not go back
        if isinstance(run, _IterableRun):
            return _resume.iterable_state(run.epoch, run.yielded, run.finished, run.state)
        finished = run.finished
        try:
            if not finished and run.yielded >= len(_compat.index_sampler(self)):
                # every batch taken, the end not yet seen: draw the sampler to its end, as next() would
                for _ in run.capture:
                    pass
                finished = True
        except TypeError:  # an unsized sampler
            pass
        return _resume.map_state(self, run.epoch, run.yielded, finished, run.capture)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a loader built the same way: on the next ``iter()``.

        Raises:
            TypeError, ValueError: a snapshot of another layout, version or kind of dataset.
        """
        kind = "iterable" if isinstance(self.dataset, IterableDataset) else "map"
        state = _resume.check_state(state_dict, kind)
        self._fth_epochs = state["epoch"] + (0 if _resume.resumes_mid_epoch(state) else 1)
        self._fth_pending = state
        self._fth_restored = None
        self._fth_run = None

    def __iter__(self) -> Iterator[Any]:
        pending, self._fth_pending = self._fth_pending, None
        restored, self._fth_restored = self._fth_restored, None
        if pending is None and restored is not None:
            pending = self._fth_peeked(restored)
        if pending is not None and not _resume.resumes_mid_epoch(pending):
            if pending["kind"] == "map":
                _resume.restore_generators(self, pending)  # the next epoch shuffles as it would have
            pending = None
        if self.num_workers == 0 and isinstance(self.dataset, IterableDataset):
            return super().__iter__()  # no worker and no position to keep: torch's own iterator
        epoch = self._fth_epochs
        self._fth_epochs += 1
        self._fth_run = None
        if self.num_workers == 0:  # no worker process: nothing to restart; the epoch is still tracked
            run = _SingleRun(self, epoch, pending)
        elif isinstance(self.dataset, IterableDataset):
            run = _IterableRun(self, epoch, pending)
        else:
            run = _MapRun(self, epoch, pending)
        self._fth_run = weakref.ref(run)  # an abandoned epoch's workers still go when it is dropped
        if pending is not None:
            self._fth_restored = run.restored = _Restored(pending, weakref.ref(run))
        return run

    def _fth_peeked(self, restored: "_Restored") -> dict[str, Any] | None:
        """The restored snapshot again when the pass resumed from it was dropped, unsaved, after at most
        ``PEEK_BATCHES`` batches (a peek); an ``IterableDataset``'s position is used up (a WARNING)."""
        snapshot, at, taken = restored.snapshot, restored.snapshot["batches_yielded"], restored.taken
        if restored.saved or restored.finished or taken > PEEK_BATCHES or restored.run() is not None:
            return None
        where_ = where(snapshot["epoch"], at, snapshot.get("sampler_epoch"))
        try:  # an unsized sampler's or an IterableDataset's position cannot be given back
            length = len(_compat.index_sampler(self)) if snapshot["kind"] == "map" else None
        except TypeError:
            length = None
        if length is not None:
            if at + taken >= length:
                return None  # its pass was over: the next iter() is a new one
            self._fth_epochs = snapshot["epoch"]
            log(logging.INFO, "RestartableDataLoader: the pass restored by load_state_dict at %s was dropped "
                "after %d batch(es) (a peek such as next(iter(loader))): this iter() resumes at batch %d "
                "again", where_, taken, at)
            return snapshot
        log(logging.WARNING, "RestartableDataLoader: the pass restored by load_state_dict at %s was dropped after "
            "%d batch(es) (a peek such as next(iter(loader))?): it used up the restored position, and this iter() "
            "starts a new pass at batch 0, not at batch %d. Peek before load_state_dict, or keep the iterator "
            "you peek with and train on it", where_, taken, at)
        return None

    def _fth_first_method(self) -> str:
        return self._fth_user_method or multiprocessing.get_start_method()

    def _fth_restart_method(self) -> str:
        if self.restart_start_method or self._fth_user_method:
            return self.restart_start_method or self._fth_user_method
        fork = "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized()
        return "fork" if fork else multiprocessing.get_start_method()


class _Feed:
    """The sampler iterator of one epoch, with the index batches sent but not yet yielded, keyed by
    their task index in the current torch iterator; ``rewind()`` puts them back in front, in order."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._again: collections.deque = collections.deque()
        self._sent: dict[int, Any] = {}  # send index -> index batch, in send order
        self._seq = 0

    def __iter__(self) -> "_Feed":
        return self

    def __next__(self) -> Any:
        item = self._again.popleft() if self._again else next(self._source)
        self._sent[self._seq] = item
        self._seq += 1
        return item

    def commit(self, n: int = 1) -> None:
        for _ in range(n):
            del self._sent[next(iter(self._sent))]

    def commit_tasks(self, tasks) -> None:
        """Commit the batches sent as these task indices (``in_order=False``: any of those in flight)."""
        for task in tasks:
            self._sent.pop(task, None)

    def rewind(self) -> None:
        self._again.extendleft(reversed(self._sent.values()))
        self._sent, self._seq = {}, 0


class _FeedSource:
    """Stands for the loader's index sampler inside torch's iterator: ``iter()`` gives the feed.
    Holds the index sampler, never the loader (no cycle through a persistent iterator)."""

    def __init__(self, loader: RestartableDataLoader, feed: Iterator[Any]) -> None:
        self.sampler = _compat.index_sampler(loader)
        self.feed = feed  # a persistent iterator's is replaced by each epoch's

    def __iter__(self) -> Iterator[Any]:
        return self.feed

    def __len__(self) -> int:
        return len(self.sampler)


@dataclass(eq=False)
class _Restored:
    """A snapshot given to ``load_state_dict`` and what the pass resumed from it did."""

    snapshot: dict[str, Any]
    run: weakref.ref  # the pass
    taken: int = 0  # batches the pass yielded
    finished: bool = False  # it reached the end of its data
    saved: bool = False  # state_dict() was taken after it moved: a checkpoint holds its progress


class _Run:
    """One pass (``iter()``) over a RestartableDataLoader."""

    restored: _Restored | None = None  # resumed from load_state_dict's snapshot

    def __init__(self, loader: RestartableDataLoader, epoch: int, pending: dict | None) -> None:
        self.loader = loader
        self.epoch = epoch  # the loader's pass (0 for its first iter()), not the training epoch
        self.yielded = pending["batches_yielded"] if pending is not None else 0
        self.finished = False

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        """What torch's iterator exposes (``_workers``, ...): the current one's, after a restart the new."""
        it = self.__dict__.get("it")
        if it is None or not name.startswith("_") or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(it, name)

    def _lost(self, lost: WorkerLost, it) -> None:
        """Kill what is left of ``it`` (unless ``construct`` did), record the restart (or raise), log it."""
        t0, loader, wid = time.monotonic(), self.loader, lost.worker_id
        if lost.pids is None and it is not None:
            lost.pids, lost.exited = it.abort(), it.fth_exited_before_abort
        pids = lost.pids or []
        pid, code = pids[wid] if wid is not None and wid < len(pids) else (None, None)
        if lost.kind == "stall":
            sig, reason, code = None, f"stalled for more than {loader.timeout:g} s", None
        else:
            sig, reason = describe_exit(code)
            reason = f"{lost}; {reason}" if lost.kind == "start" else reason
        also = tuple((w, pids[w][0], describe_exit(pids[w][1])[1]) for w in lost.exited if w != wid and w < len(pids))
        record = WorkerRestart(self.epoch, self.yielded, wid, pid, sig, code, reason, lost.detected_at, also_lost=also,
                               sampler_epoch=_resume.sampler_epoch(loader))
        if len(loader.restarts) >= loader.max_restarts:
            log(logging.ERROR, "DataLoader %s; restart budget spent (max_restarts=%d)", record.describe(), loader.max_restarts)
            raise DataLoaderRestartError(loader.restarts + [record], loader.max_restarts, loader.timeout)
        loader.restarts.append(record)
        record.start_method = loader._fth_restart_method()
        log(logging.WARNING, "DataLoader %s; restarting workers (%s, restart %d of %d), resuming at batch %d",
            record.describe(), record.start_method, len(loader.restarts), loader.max_restarts, self.yielded)
        self._restart_t0 = t0

    def _started(self) -> None:
        t0 = self.__dict__.get("_restart_t0")
        if t0 is not None:
            self.loader.restarts[-1].restart_seconds = time.monotonic() - t0
            self._restart_t0 = None

    def __next__(self) -> Any:
        while True:
            it = self.it
            mark = self._mark(it)
            try:
                data = next(it)
            except StopIteration:
                self.finished = True
                if self.restored is not None:
                    self.restored.finished = True
                raise
            except BaseException as exc:
                dead = None if isinstance(exc, WorkerLost) else getattr(it, "fth_dead_worker", lambda: None)()
                if isinstance(exc, WorkerLost) or dead is not None:  # dead: e.g. torch's "exited unexpectedly"
                    self._lost(exc if dead is None else WorkerLost("died", dead[0], dead[1]), it)
                    self._restart(it)
                    continue
                self._commit(it, mark, failed=exc)  # the dataset's own error: not retried
                raise
            self._commit(it, mark, failed=None)
            self.yielded += 1
            if self.restored is not None:
                self.restored.taken += 1
            last = self.loader.restarts[-1] if self.loader.restarts else None
            if last is not None and last.recovery_seconds is None:
                last.recovery_seconds = time.time() - last.detected_at
            return data

    def _mark(self, it) -> Any:
        return None


class _MapRun(_Run):
    def __init__(self, loader: RestartableDataLoader, epoch: int, pending: dict | None = None) -> None:
        super().__init__(loader, epoch, pending)
        self.resumed = pending is not None
        # the sampler is iterated once per epoch, as torch does (a resume draws its first batches here)
        self.capture = _resume.source(loader, pending)
        self.feed = _Feed(self.capture)
        self.source = _FeedSource(loader, self.feed)
        persistent = loader._fth_persistent if loader.persistent_workers else None
        if persistent is not None and _compat.shut_down(persistent, False):
            persistent = loader._fth_persistent = None  # shut down from outside: start afresh
        if persistent is not None:
            persistent.fth_source.feed = self.feed
            try:
                view = LoaderView(loader, persistent.fth_source, loader.multiprocessing_context, loader.generator)
                _compat.reset(persistent, view)
                self.it = persistent
                self.source = persistent.fth_source
            except WorkerLost as lost:
                loader._fth_persistent = None
                self._lost(lost, persistent)
                self._start(restart=True)
        else:
            self._start(restart=False)

    def _start(self, restart: bool) -> None:
        """Start workers: the first of the epoch like torch does, later ones from the feed."""
        loader = self.loader
        while True:
            if restart:
                self.feed.rewind()
                method = loader._fth_restart_method()
                generator = torch.Generator().manual_seed(1000003 * self.epoch + len(loader.restarts))
            else:
                method = loader._fth_first_method()
                # a resumed epoch: the loader's generator is already where the sampler left it
                generator = torch.Generator() if self.resumed else loader.generator
            view = LoaderView(loader, self.source, hardened_context(method), generator)
            try:
                it = construct(TorchWorkersIter, view)
            except WorkerLost as lost:  # a worker died while the iterator was being built
                self._lost(lost, None)
                restart = True
                continue
            it.fth_source = self.source
            self.it = it
            if loader.persistent_workers:
                loader._fth_persistent = it
            self._started()
            return

    def _mark(self, it) -> tuple:
        return _compat.received(it), None if self.loader.in_order else _compat.in_flight(it)

    def _commit(self, it, mark: tuple, failed: BaseException | None) -> None:
        """The batches received are no longer to send again (a failed one is consumed, as with torch)."""
        before, in_flight = mark
        if in_flight is not None:  # in_order=False: whichever came back
            done = in_flight - _compat.in_flight(it)
            self.feed.commit_tasks(done)
            self.yielded += len(done) if failed else 0
        elif failed:
            self.feed.commit(_compat.received(it) - before)
            self.yielded += _compat.received(it) - before
        else:
            self.feed.commit()

    def _restart(self, it) -> None:
        if self.loader._fth_persistent is it:
            self.loader._fth_persistent = None
        self._start(restart=True)


class _IterableRun(_Run):
    """An epoch over an ``IterableDataset``: torchdata snapshots, committed after every batch."""

    def __init__(self, loader: RestartableDataLoader, epoch: int, pending: dict | None = None) -> None:
        from .compat_torchdata import InnerStatefulLoader

        super().__init__(loader, epoch, pending)
        if loader._fth_stateful is None:
            same = ("dataset", "batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout",
                    "worker_init_fn", "generator", "prefetch_factor", "persistent_workers")
            loader._fth_stateful = InnerStatefulLoader(
                **{name: getattr(loader, name) for name in same}, snapshot_every_n_steps=1,
                multiprocessing_context=hardened_context(loader._fth_first_method()))
        self.sdl = loader._fth_stateful
        self.sdl.start_pass(loader, loader._fth_first_method())
        self.state = None
        if pending is not None and pending.get("torchdata") is not None:
            self.sdl.load_state_dict(pending["torchdata"])  # resume: torchdata restores the workers' position
        self._restart(None, restart=False)

    def _restart(self, it, restart: bool = True) -> None:
        while True:
            if restart:
                self.sdl.drop_iterator()
                self.sdl.multiprocessing_context = hardened_context(self.loader._fth_restart_method())
                if self.state is not None:
                    self.sdl.load_state_dict(self.state)
            try:
                self.it = iter(self.sdl)
                if self.state is None:
                    self.state = self.it.state_dict()
            except WorkerLost as lost:
                self._lost(lost, self.sdl.iterator())
                restart = True
                continue
            self._started()
            return

    def _commit(self, it, mark: None, failed: BaseException | None) -> None:
        self.state = it.state_dict()


class _SingleRun(_Run):
    """A map-style epoch without workers: torch's single-process iterator, fed from a tracked sampler."""

    def __init__(self, loader: RestartableDataLoader, epoch: int, pending: dict | None) -> None:
        super().__init__(loader, epoch, pending)
        self.capture = _resume.source(loader, pending)
        generator = torch.Generator() if pending is not None else loader.generator
        self.it = _compat.single_process_iter(LoaderView(loader, _FeedSource(loader, self.capture), None, generator))

    def _commit(self, it, mark: None, failed: BaseException | None) -> None:
        self.yielded += isinstance(failed, Exception)  # the dataset's own error: that batch is consumed, as with torch


def make_restartable(loader: DataLoader, max_restarts: int = 3, restart_start_method: str | None = None) -> RestartableDataLoader:
    """A :class:`RestartableDataLoader` with the same dataset, sampler (shared: ``set_epoch`` still
    applies) and settings as ``loader`` (e.g. ``idist.auto_dataloader``'s). Do not iterate both.

    Examples:
        .. code-block:: python

            loader = make_restartable(idist.auto_dataloader(dataset, batch_size=32, num_workers=2,
                                                            shuffle=True), max_restarts=5)
    """
    if isinstance(loader, RestartableDataLoader):
        return loader
    if not isinstance(loader, DataLoader):
        raise TypeError(f"make_restartable(loader=...): expected a torch.utils.data.DataLoader, got {type(loader).__name__}")
    same = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
            "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")
    common: dict[str, Any] = {name: getattr(loader, name) for name in same}
    common.update(max_restarts=max_restarts, restart_start_method=restart_start_method)
    if isinstance(loader.dataset, IterableDataset):
        return RestartableDataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **common)
    if loader.batch_size is None and loader.batch_sampler is not None:  # a custom batch sampler
        return RestartableDataLoader(loader.dataset, batch_size=1, batch_sampler=loader.batch_sampler, **common)
    return RestartableDataLoader(loader.dataset, batch_size=loader.batch_size, sampler=loader.sampler,
                                 drop_last=loader.drop_last, **common)


# Their public path (:mod:`fault_tolerant_handlers.dataloader`): what tracebacks and pickles name.
DataLoaderRestartError.__module__ = WorkerRestart.__module__ = "fault_tolerant_handlers.dataloader"
