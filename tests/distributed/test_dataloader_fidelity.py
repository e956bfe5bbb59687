"""RestartableDataLoader as a drop-in torch DataLoader: what torch's own loader does, ours does too.

One test (or a few) per point where a drop-in could differ: workers freed when the loader is
dropped, a picklable error, ``RestartableDataLoader[T]``, the open-files advice, the length warning
of iterable datasets, ``in_order=False``, and the intended differences (a stall or a crash is
restarted before the error) with the error still worded as torch words it. Real workers, real
signals; every worker started is killed by pid in a ``finally`` (``dl_stress.kill_children``).
``bench/dataloader_conformance.py`` runs torch's and torchdata's own test files against the loader.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import typing
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from dl_stress import MapData, kill_children
from fault_tolerant_handlers.data.loader import DataLoaderRestartError, RestartableDataLoader, WorkerRestart

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _reap():
    try:
        yield
    finally:
        kill_children()


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, within: float) -> list[int]:
    end = time.monotonic() + within
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if _alive(p)]


class Stream(IterableDataset):
    """``n`` items sharded over the workers; ``len()`` says ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(wid, self.n, nw))


class Everywhere(IterableDataset):
    """Every worker yields all ``n`` items (not sharded), while ``len()`` says ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(range(self.n))


#: When each worker process was forked (``KillOnce(serial=True)`` tells generations apart). Not its
#: first item: under load a worker of the same generation may serve its first item only after its
#: sibling's kill, and would pass for a newer one (two deaths, one restart).
_FIRST_ITEM: dict[int, float] = {}
os.register_at_fork(after_in_child=lambda: _FIRST_ITEM.__setitem__(os.getpid(), time.time()))


class KillOnce(Dataset):
    """Index in ``kill_at`` SIGKILLs (or ``how``) its worker the first time; index ``slow`` sleeps.

    ``serial``: kill ``k`` fires only in a worker that started after kill ``k - 1`` had fired; an
    older worker that gets it waits to be replaced (its generation is aborted when the earlier
    death is seen). Without it, a fast loader (``in_order=False`` keeps yielding from the live
    workers) can reach the next kill before the earlier death is seen: two deaths, one restart.
    """

    def __init__(self, n: int, kill_at, marker_dir, slow: int | None = None, how: str = "kill",
                 slow_sec: float = 0.6, serial: bool = False) -> None:
        self.n, self.kill_at, self.dir, self.slow, self.how = n, tuple(kill_at), str(marker_dir), slow, how
        self.slow_sec, self.serial = slow_sec, serial

    def __len__(self) -> int:
        return self.n

    def _wait_for_a_newer_worker(self, k: int) -> None:
        if not self.serial or k == 0:
            return
        started = _FIRST_ITEM[os.getpid()]  # at its fork (or, started otherwise, its first item)
        previous = os.path.join(self.dir, f"k{self.kill_at[k - 1]}")
        deadline = time.monotonic() + 30.0
        while not (os.path.exists(previous) and os.stat(previous).st_mtime < started):
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {os.getpid()} was not replaced after kill {k - 1}")
            time.sleep(0.01)  # an older worker: the restart for kill k - 1 ends it here

    def __getitem__(self, i: int) -> int:
        _FIRST_ITEM.setdefault(os.getpid(), time.time())
        if i in self.kill_at:
            marker = os.path.join(self.dir, f"k{i}")
            if not os.path.exists(marker):
                self._wait_for_a_newer_worker(self.kill_at.index(i))
                open(marker, "w").close()
                if self.how == "segv":
                    ctypes.string_at(0)
                os.kill(os.getpid(), signal.SIGKILL)
        if i == self.slow:
            time.sleep(self.slow_sec)
        return i


class SlowFirst(Dataset):
    """Each fresh copy (each new worker) sleeps ``sleep`` seconds on its first item."""

    def __init__(self, n: int, sleep: float) -> None:
        self.n, self.sleep, self.slept = n, sleep, False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not self.slept:
            self.slept = True
            time.sleep(self.sleep)
        return i


def _silence_stderr(_worker_id):
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


# -- 1. no reference cycle: dropping a loader with persistent workers ends them at once -----------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_persistent_loader_is_freed_by_refcount_and_its_workers_exit(kind):
    dataset = MapData(40, 0) if kind == "map" else Stream(40)
    gc.collect()
    gc.disable()  # what refcounting alone frees; the cyclic GC would also stall 5 s per worker
    try:
        loader = RestartableDataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True)
        for _ in range(2):
            it = iter(loader)
            next(it)
            pids = loader.worker_pids
        assert len(pids) == 2
        del it
        ref = weakref.ref(loader)
        del loader
        assert ref() is None, "the loader is kept alive by a reference cycle"
        assert _wait_gone(pids, within=10.0) == [], "persistent workers outlived their loader"
    finally:
        gc.enable()


# -- 2. DataLoaderRestartError crosses a process boundary -------------------------------------------


@pytest.mark.timeout(60)
def test_restart_error_pickles_with_its_restarts(tmp_path):
    loader = RestartableDataLoader(KillOnce(40, [9], tmp_path), batch_size=2, num_workers=2, max_restarts=0)
    with pytest.raises(DataLoaderRestartError) as info:
        list(loader)
    err = info.value
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is DataLoaderRestartError and str(back) == str(err)
    assert back.max_restarts == 0 and back.restarts == err.restarts
    assert back.restarts[-1].signal == "SIGKILL" and back.restarts[-1].batch_index >= 0
    made = DataLoaderRestartError([WorkerRestart(1, 2, 0, 42, None, None, "stalled for more than 1 s", 0.0)], 3, 1.0)
    assert str(pickle.loads(pickle.dumps(made))) == str(made)
    # torch's tests rebuild an exception from its type and message: type(err)(str(err))
    assert str(type(err)(str(err))) == str(err)


# -- 3. generic like DataLoader[T_co] -------------------------------------------------------------


def test_subscriptable_like_dataloader():
    alias = RestartableDataLoader[int]
    assert typing.get_origin(alias) is RestartableDataLoader and typing.get_args(alias) == (int,)

    def make(is_train: bool) -> RestartableDataLoader[list[torch.Tensor]]:  # torch's test_typing
        return RestartableDataLoader([torch.zeros(1)], batch_size=1)

    assert isinstance(make(True), DataLoader)


# -- 4. "Too many open files" keeps torch's advice ---------------------------------------------------


FD_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from torch.utils.data import IterableDataset
    from fault_tolerant_handlers.data.loader import RestartableDataLoader

    class Tensors(IterableDataset):
        def __iter__(self):
            for _ in range(200):
                yield torch.randn(2, 2)

    keep = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
    try:
        for t in RestartableDataLoader(Tensors(), multiprocessing_context="fork", num_workers=1,
                                       persistent_workers=sys.argv[1] == "1"):
            keep.append(t)  # each kept batch holds a file descriptor
    except RuntimeError as e:
        print("RAISED", repr(str(e)))
    else:
        print("NO ERROR", len(keep))
    """
)


@pytest.mark.timeout(240)  # a fresh interpreter importing torch: slow on a loaded machine
@pytest.mark.parametrize("persistent", [False, True])
def test_too_many_open_files_names_ulimit_and_sharing_strategy(persistent):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", FD_SCRIPT, "1" if persistent else "0"], env=env,
                         capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RAISED" in out.stdout, out.stdout
    assert "ulimit -n" in out.stdout and "set_sharing_strategy" in out.stdout, out.stdout


# -- 5. the length warning of an iterable dataset that yields more than its len() -----------------


def _count_length_warnings(cls, dataset) -> tuple[int, int]:
    loader = cls(dataset, batch_size=None, num_workers=2)
    assert len(loader) == 10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(loader)
    return len(got), sum("samples have been fetched" in str(w.message) for w in caught)


@pytest.mark.timeout(60)
def test_iterable_length_warning_as_stock():
    stock = _count_length_warnings(DataLoader, Everywhere(10))
    ours = _count_length_warnings(RestartableDataLoader, Everywhere(10))
    assert stock == (20, 10)
    assert ours == stock


# -- 6. in_order=False: batches as they come, each exactly once, also across restarts --------------


@pytest.mark.timeout(60)
def test_in_order_false_yields_out_of_order(tmp_path):
    # index 0 sleeps 2 s: time for the other worker to start and serve its indices on a loaded machine
    loader = RestartableDataLoader(KillOnce(10, [], tmp_path, slow=0, slow_sec=2.0), batch_size=None,
                                   num_workers=2, prefetch_factor=2, in_order=False)
    got = list(loader)
    assert sorted(got) == list(range(10))
    assert got != list(range(10)), "index 0 is slow: the other worker's batches should come first"
    assert got[-2:] == [0, 2], got  # worker 0's queue, held up behind index 0 (torch's own expectation)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("persistent", [False, True])
def test_in_order_false_restart_loses_and_repeats_nothing(tmp_path, persistent):
    n = 120
    common = dict(batch_size=2, shuffle=True, persistent_workers=persistent)
    ref = DataLoader(MapData(n, 0), num_workers=1, generator=torch.Generator().manual_seed(3), **common)
    expected = [[b.tolist() for b in ref] for _ in range(2)]  # the batches of each epoch, in sampler order
    # three kills 20 batches apart in epoch 0's order, each in a worker started after the one before
    kill_at = [expected[0][k][0] for k in (10, 30, 50)]
    loader = RestartableDataLoader(KillOnce(n, kill_at, tmp_path, slow=40, serial=True), num_workers=3, in_order=False,
                                   generator=torch.Generator().manual_seed(3), max_restarts=5, **common)
    got = [[b.tolist() for b in loader] for _ in range(2)]
    for epoch in range(2):
        assert sorted(got[epoch]) == sorted(expected[epoch]), f"epoch {epoch}: a batch lost or repeated"
    assert got != expected, "index 40 is slow: its batch should have come late"
    assert loader.restart_count == len(kill_at), loader.restarts  # every kill fired, in epoch 0
    assert all(r.epoch == 0 and r.signal == "SIGKILL" for r in loader.restarts)
    assert sorted(os.listdir(tmp_path)) == sorted(f"k{i}" for i in kill_at)


@pytest.mark.timeout(60)
def test_two_workers_killed_together_are_one_restart_naming_both():
    n = 40
    expected = [list(range(i, i + 2)) for i in range(0, n, 2)]
    loader = RestartableDataLoader(MapData(n, 0), batch_size=2, num_workers=3, max_restarts=1)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    victims = loader.worker_pids[:2]
    for pid in victims:  # as the OOM killer does: both dead before the loader looks again
        os.kill(pid, signal.SIGKILL)
    assert _wait_gone(victims, within=10) == []  # zombies (the last threads may still be exiting)
    got += [b.tolist() for b in it]
    assert got == expected, "a batch lost or repeated"
    assert loader.restart_count == 1, loader.restarts  # one restart replaced both (max_restarts=1 held)
    (restart,) = loader.restarts
    named = [(restart.worker_pid, restart.reason)] + [(pid, why) for _, pid, why in restart.also_lost]
    assert sorted(named) == sorted((p, "killed by SIGKILL") for p in victims), restart
    assert all(f"(pid {p}) killed by SIGKILL" in restart.describe() for p in victims), restart.describe()


@pytest.mark.timeout(60)
def test_in_order_false_iterable_is_accepted_and_exact(tmp_path):
    loader = RestartableDataLoader(Stream(30), batch_size=3, num_workers=2, in_order=False)
    got = sorted(i for b in loader for i in b.tolist())
    assert got == list(range(30))


# -- 7. intended differences, explicit; torch's wording and iterator attributes kept ----------------


@pytest.mark.timeout(60)
def test_stall_is_restarted_then_raised_in_torch_words():
    loader = RestartableDataLoader(SlowFirst(10, 3.0), batch_size=2, num_workers=2, timeout=1, max_restarts=1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after \d+ seconds") as info:
        next(iter(loader))
    assert isinstance(info.value, DataLoaderRestartError)
    assert loader.restart_count == 1 and loader.restarts[0].reason == "stalled for more than 1 s"
    assert 1.5 < time.monotonic() - t0 < 20  # one timeout, a restart, a second timeout


@pytest.mark.timeout(60)
def test_segfault_is_restarted_then_raised_in_torch_words(tmp_path):
    dataset = KillOnce(20, [3, 11], tmp_path, how="segv")
    loader = RestartableDataLoader(dataset, batch_size=2, num_workers=2, max_restarts=1,
                                   worker_init_fn=_silence_stderr)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: ") as info:
        list(loader)
    assert isinstance(info.value, DataLoaderRestartError)
    assert loader.restart_count == 1 and loader.restarts[0].signal == "SIGSEGV"
    assert "Segmentation fault" in str(info.value)


@pytest.mark.timeout(60)
def test_iterator_exposes_torch_iterator_attributes(tmp_path):
    loader = RestartableDataLoader(KillOnce(40, [21], tmp_path), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    first = [w.pid for w in it._workers]
    assert sorted(first) == sorted(loader.worker_pids) and len(first) == 2
    assert it._num_workers == 2 and callable(it._shutdown_workers)
    rest = list(it)
    assert len(rest) == 19 and loader.restart_count == 1
    workers = it._workers  # the restarted ones
    assert {w.pid for w in workers}.isdisjoint(first)
    del it
    assert _wait_gone([w.pid for w in workers], within=10.0) == []
    with pytest.raises(AttributeError):
        iter(loader).no_such_attribute  # noqa: B018


# -- the iterable path's inner loader on its own: torchdata's StatefulDataLoader, same words ------


class SlowStream(IterableDataset):
    def __iter__(self):
        time.sleep(3.0)
        yield from range(4)


@pytest.mark.timeout(60)
def test_inner_stateful_loader_is_generic_and_raises_torch_errors():
    from fault_tolerant_handlers.data.compat_torchdata import InnerStatefulLoader

    assert typing.get_origin(InnerStatefulLoader[int]) is InnerStatefulLoader  # torchdata's test_typing
    loader = InnerStatefulLoader(SlowStream(), batch_size=2, num_workers=1, timeout=1)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 1 seconds") as info:
        next(iter(loader))
    assert str(type(info.value)(str(info.value))) == str(info.value)  # rebuilt as torch's tests do
