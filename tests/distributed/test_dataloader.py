"""RestartableDataLoader in one process: real workers, real SIGKILL on real worker pids.

Every test that starts workers runs under a pytest timeout and kills every worker it started, by
pid, in a ``finally`` (``dl_stress.kill_children``). The 300+ kill campaign is
``bench/dataloader.py``; ``FTH_DL_STRESS_KILLS`` raises the kills per kind here.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zlib
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import dl_stress
from dl_stress import MapData, kill_children, make_loader
from fault_tolerant_handlers.data.loader import (
    DataLoaderRestartError,
    RestartableDataLoader,
    make_restartable,
)

KILLS = int(os.environ.get("FTH_DL_STRESS_KILLS", "14"))


@pytest.fixture(autouse=True)
def _reap():
    try:
        yield
    finally:
        kill_children()


def flat(loader, epochs=1):
    return dl_stress.epochs_of(loader, epochs)


# -- many random kills per epoch, every kind ------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", dl_stress.KINDS)
def test_random_kills_lose_and_repeat_nothing(kind):
    res = dl_stress.campaign(kind, kills=KILLS, epochs=3, seed=zlib.crc32(kind.encode()) % 1000)
    assert res.kills >= KILLS // 2, f"the killer fired only {res.kills} times"
    assert res.restarts >= res.kills // 3 and res.restarts >= 3, res
    assert res.lost == 0 and res.duplicated == 0, res
    assert res.order_ok, f"{kind}: an epoch differs from the uninterrupted one"
    assert res.detection_ms and max(res.detection_ms) < 1000, res.detection_ms


@pytest.mark.timeout(60)
def test_distributed_ranks_together_cover_the_dataset_once():
    per_rank = [dl_stress.campaign("distributed", kills=6, epochs=2, seed=r, rank=r) for r in (0, 1)]
    for r in per_rank:
        assert r.restarts >= 2 and r.order_ok and r.lost == 0 and r.duplicated == 0, r
    for epoch in range(2):
        both = per_rank[0].got[epoch] + per_rank[1].got[epoch]
        assert sorted(both) == list(range(400)), f"epoch {epoch}: ranks do not cover each sample once"
    assert per_rank[0].got[0] != per_rank[0].got[1], "set_epoch did not reshuffle"


# -- what is and is not a death -------------------------------------------------------------------


class Faulty(Dataset):
    """Index ``at`` misbehaves once (a marker file remembers it did): raise, exit or hang."""

    def __init__(self, n, at, how, marker):
        self.n, self.at, self.how, self.marker = n, at, how, str(marker)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at and self.how == "raise":
            raise ValueError(f"bad sample {i}")
        if i == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            if self.how == "exit":
                os._exit(3)
            if self.how == "hang":
                time.sleep(600)
        return i


@pytest.mark.timeout(30)
def test_dataset_error_propagates_with_worker_traceback_and_is_not_retried(tmp_path):
    loader = RestartableDataLoader(Faulty(40, 13, "raise", tmp_path / "m"), batch_size=4, num_workers=2)
    seen = []
    with pytest.raises(ValueError) as info:
        for batch in loader:
            seen.extend(batch.tolist())
    assert "bad sample 13" in str(info.value)
    assert "Caught ValueError in DataLoader worker process" in str(info.value)
    assert 'raise ValueError(f"bad sample {i}")' in str(info.value)  # the worker's traceback
    assert seen == list(range(12)) and loader.restart_count == 0


@pytest.mark.timeout(30)
def test_worker_exit_is_restarted_exactly(tmp_path):
    loader = RestartableDataLoader(Faulty(80, 50, "exit", tmp_path / "m"), batch_size=4, num_workers=2,
                                   shuffle=True, generator=torch.Generator().manual_seed(1))
    ref = DataLoader(MapData(80, 0), batch_size=4, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(1))
    assert flat(loader) == flat(ref)
    assert loader.restart_count == 1
    rec = loader.restarts[0]
    assert rec.exitcode == 3 and rec.signal is None and rec.reason == "exited with code 3"
    assert rec.start_method == "fork" and rec.recovery_seconds is not None


@pytest.mark.timeout(30)
def test_stall_past_timeout_is_restarted(tmp_path):
    loader = RestartableDataLoader(Faulty(40, 21, "hang", tmp_path / "m"), batch_size=4, num_workers=2, timeout=1.0)
    t0 = time.monotonic()
    assert flat(loader) == [list(range(40))]
    assert time.monotonic() - t0 < 10
    assert loader.restart_count == 1
    rec = loader.restarts[0]
    assert rec.reason.startswith("stalled for more than 1") and rec.batch_index == 5, rec


# -- a worker stuck at its start (CPython 3.11.7's fork, gh-112275) ---------------------------------

START_PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "dl_worker_start_main.py"


def _run_program(args: list[str], seconds: float, stuck: str, **env: str) -> tuple[dict, str]:
    """``python args`` in a session of its own whose every process is SIGKILLed at the end (a stuck worker
    outlives a program killed); its last line of output as JSON, and its stderr. ``stuck``: what a run
    past ``seconds`` means."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args}: no end within {seconds:g} s ({stuck})\n{err[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _run_start_program(mode: str) -> tuple[dict, str]:
    """``programs/dl_worker_start_main.py <mode>`` at a 1 s start deadline."""
    return _run_program([str(START_PROGRAM), mode], 45, "a worker stuck at its start was waited for",
                        FTH_WORKER_START_SEC="1")


@pytest.mark.timeout(60)
def test_a_worker_stuck_at_its_start_is_killed_and_restarted():
    res, err = _run_start_program("stuck")
    assert res["forks"] >= 3, res  # the stuck worker, its pass's other one, the restart's: the hook fired
    assert res["got"] == res["reference"], "the batches differ from the run without the stuck worker"
    [restart] = res["restarts"]
    assert restart["worker_id"] == 0 and restart["epoch"] == 0 and restart["batch_index"] == 0, restart
    assert restart["reason"].startswith("stuck at its start: not in Python 1 s after it was started"), restart
    assert restart["reason"].endswith("killed by SIGKILL") and restart["signal"] == "SIGKILL", restart
    assert res["pid_left"] == [], "the stuck worker is still a process"
    assert f"worker 0 (pid {restart['worker_pid']}) stuck at its start" in err  # the WARNING names it
    assert res["seconds"] < 20, res["seconds"]


@pytest.mark.timeout(60)
def test_a_worker_busy_before_its_start_is_not_declared():
    res, err = _run_start_program("busy")  # 3 s of CPU before its first Python line, at a 1 s deadline
    assert res["forks"] >= 2 and res["got"] == res["reference"], res
    assert res["restarts"] == [] and "stuck at its start" not in err, res["restarts"]
    assert res["seconds"] > 3, res["seconds"]  # it was waited for


def _slow_init(worker_id: int) -> None:
    time.sleep(1.5)  # asleep, no CPU, longer than the deadline: started all the same


@pytest.mark.timeout(90)
def test_no_healthy_worker_is_declared_stuck_beside_cpu_hogs(monkeypatch):
    """4 workers per pass, 3 passes, each forked beside 4 processes spinning on 2 cores, at the shortest
    start deadline (1 s), with a ``worker_init_fn`` that sleeps past it: no worker is declared."""
    monkeypatch.setenv("FTH_WORKER_START_SEC", "1")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        time.sleep(0.5)
        loader = RestartableDataLoader(MapData(160), batch_size=4, num_workers=4, shuffle=True,
                                       generator=torch.Generator().manual_seed(3), worker_init_fn=_slow_init)
        ref = DataLoader(MapData(160, 0), batch_size=4, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(3))
        assert flat(loader, 3) == flat(ref, 3)
        assert loader.restart_count == 0, [r.describe() for r in loader.restarts]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.timeout(30)
def test_budget_spent_raises_listing_every_restart():
    loader = RestartableDataLoader(MapData(200), batch_size=4, num_workers=2, max_restarts=1)
    killed = []
    with pytest.raises(DataLoaderRestartError) as info:
        for k, _ in enumerate(loader):
            if k in (3, 10):
                pid = loader.worker_pids[0]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    err = info.value
    assert len(killed) == 2 and [r.worker_pid for r in err.restarts] == killed
    assert err.max_restarts == 1 and len(loader.restarts) == 1
    msg = str(err)
    assert "max_restarts=1" in msg
    for r in err.restarts:  # each restart named with its batch, worker pid and signal
        assert f"batch {r.batch_index} of pass 1: worker {r.worker_id} (pid {r.worker_pid}) killed by SIGKILL" in msg, msg
    # the loss is seen at the first batch that needs the dead worker: after the kill, before the next
    assert 4 <= err.restarts[0].batch_index <= 10 and err.restarts[1].batch_index >= 11, msg


@pytest.mark.timeout(30)
def test_zero_budget_raises_at_first_death():
    loader = RestartableDataLoader(MapData(80), batch_size=4, num_workers=2, max_restarts=0)
    with pytest.raises(DataLoaderRestartError, match=r"not restarted: batch \d+ of pass 1: worker 1 \(pid \d+\) killed by SIGKILL") as info:
        for k, _ in enumerate(loader):
            if k == 2:
                os.kill(loader.worker_pids[1], signal.SIGKILL)
    assert info.value.restarts[0].batch_index >= 3 and loader.restart_count == 0


# -- a death while the main process is inside the training step -----------------------------------


def _kill_during_step(loader):
    """Kill a worker while the main process is in its "step"; return the step's outcome and data."""
    got, outcome = [], None
    try:
        for k, batch in enumerate(loader):
            got.extend(batch.tolist())
            if k == 3:
                os.kill(loader_pids(loader)[0], signal.SIGKILL)
                try:  # the step: torch's SIGCHLD handler, if armed, raises here
                    time.sleep(0.3)
                except RuntimeError as exc:
                    outcome = exc
                    break
    finally:
        kill_children()
    return outcome, got


def loader_pids(loader):
    if isinstance(loader, RestartableDataLoader):
        return loader.worker_pids
    return [w.pid for w in loader._iterator._workers] if loader._iterator else []


@pytest.mark.timeout(30)
def test_death_inside_the_step_does_not_fail_the_step():
    stock = DataLoader(MapData(80), batch_size=4, num_workers=2, persistent_workers=True)
    outcome, _ = _kill_during_step(stock)
    assert isinstance(outcome, RuntimeError) and "DataLoader worker" in str(outcome), outcome  # the fault fired
    ours = RestartableDataLoader(MapData(80), batch_size=4, num_workers=2)
    outcome, got = _kill_during_step(ours)
    assert outcome is None and got == list(range(80)) and ours.restart_count == 1


# -- the pump waits on events: it does not turn while nothing happens -------------------------------


def _first_batch_and_pump(loader):
    """``(iterator, its pump thread)`` after the first batch."""
    before = set(threading.enumerate())
    it = iter(loader)
    next(it)
    pumps = [t for t in threading.enumerate() if t.name == "fth-dataloader-pump" and t not in before]
    assert len(pumps) == 1, f"expected one new pump thread, found {len(pumps)}"
    return it, pumps[0]


def _wakeups(tid: int) -> int:
    """How many times thread ``tid`` was switched out (each blocking wait it returns from is one)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])


def _tensor_batches(n=64 * 40):
    """Batches of two tensors, as a training's: each one reaches the main process as file descriptors."""
    return torch.utils.data.TensorDataset(torch.randn(n, 64), torch.randn(n, 1))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("timeout", [0, 30.0])
def test_pump_sleeps_while_the_training_holds_every_batch(timeout):
    """The training is in a long step; every prefetched batch has arrived: the pump must not run
    at all (it used to wake every 0.2 s to look at its stop flag, ~7 times over this wait)."""
    loader = RestartableDataLoader(_tensor_batches(), batch_size=64, num_workers=2, persistent_workers=True,
                                   timeout=timeout)
    it, pump = _first_batch_and_pump(loader)
    tid = pump.native_id
    time.sleep(0.5)  # the 2 x prefetch_factor batches in flight arrive
    before = _wakeups(tid)
    time.sleep(1.5)  # the step
    woken = _wakeups(tid) - before
    assert woken <= 2, f"the idle pump woke {woken} times in 1.5 s"
    assert len(list(it)) == len(loader) - 1  # and it still delivers every batch


@pytest.mark.timeout(60)
def test_stopped_pumps_leave_no_thread_and_no_descriptor():
    """Ten iterators made and dropped: each one's pump ends with it and closes its stop pipe."""
    gc.collect()  # earlier tests' iterators
    others = set(threading.enumerate())
    loader = RestartableDataLoader(_tensor_batches(64 * 4), batch_size=64, num_workers=2)
    list(loader)  # torch's and multiprocessing's own lazily opened descriptors

    def settled():
        end = time.monotonic() + 5
        while time.monotonic() < end and pumps_alive():
            time.sleep(0.05)
        gc.collect()
        return pumps_alive(), len(os.listdir("/proc/self/fd"))

    def pumps_alive():
        return [t for t in threading.enumerate() if t.name == "fth-dataloader-pump" and t not in others]

    pumps, fds = settled()
    assert pumps == []
    for _ in range(10):
        list(loader)
    pumps, after = settled()
    # none left open by the pumps; one of the process's own may have closed meanwhile (CI: 17 -> 16)
    assert pumps == [] and after <= fds, (pumps, after, fds)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persistent", [True, False])
def test_the_workers_of_an_iterator_collected_in_a_cycle_are_killed_not_waited_for(persistent):
    """A loader in a reference cycle, its pass dropped mid-way (a failed attempt's, collected by a
    recovery in place's ``gc.collect()``): the collection finalizes the workers' index queues before
    the iterator's ``__del__``, so torch's "exit" never reaches them: it waited 5 s for each (then
    SIGTERMed those still running). They are killed at once (SIGKILL), and none is left running."""
    loader = RestartableDataLoader(MapData(80, delay=0), batch_size=4, num_workers=2, persistent_workers=persistent)
    run = loader.run = iter(loader)
    next(run)
    workers = list(run.it._workers)
    del loader, run
    gc.collect()
    assert [w.exitcode for w in workers] == [-signal.SIGKILL] * 2


# -- API ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, "3", True, 1.5, None])
def test_bad_max_restarts_is_named(bad):
    with pytest.raises((TypeError, ValueError), match=r"max_restarts=.*must be an int >= 0"):
        RestartableDataLoader(MapData(8), max_restarts=bad)


def test_bad_start_method():
    with pytest.raises(ValueError, match=r"restart_start_method='thread'.*\['fork', 'spawn', 'forkserver'\]"):
        RestartableDataLoader(MapData(8), restart_start_method="thread")
    with pytest.raises(TypeError, match="make_restartable"):
        make_restartable([1, 2])


def test_no_workers_is_a_plain_dataloader():
    loader = RestartableDataLoader(MapData(10, 0), batch_size=5)
    assert isinstance(loader, DataLoader) and flat(loader) == [list(range(10))] and loader.restart_count == 0


@pytest.mark.timeout(60)
def test_lightning_sampler_injection_keeps_the_class_and_budget():
    from lightning.pytorch.utilities.data import _update_dataloader

    loader = RestartableDataLoader(MapData(40, 0), batch_size=4, shuffle=True, num_workers=2, max_restarts=7)
    sampler = DistributedSampler(MapData(40, 0), num_replicas=2, rank=1, shuffle=False)
    new = _update_dataloader(loader, sampler)
    assert type(new) is RestartableDataLoader and new.max_restarts == 7 and new.sampler is sampler
    assert flat(new) == [list(range(1, 40, 2))]


@pytest.mark.timeout(30)
def test_make_restartable_shares_the_sampler():
    sampler = DistributedSampler(MapData(80), num_replicas=2, rank=0, shuffle=True, seed=5)
    stock = DataLoader(MapData(80), batch_size=4, sampler=sampler, num_workers=2)
    loader = make_restartable(stock, max_restarts=2)
    assert isinstance(loader, RestartableDataLoader) and loader.sampler is sampler and loader.max_restarts == 2
    sampler.set_epoch(1)
    ref_sampler = DistributedSampler(MapData(80), num_replicas=2, rank=0, shuffle=True, seed=5)
    ref_sampler.set_epoch(1)
    want = list(ref_sampler)
    got = []
    for k, batch in enumerate(loader):
        got.extend(batch.tolist())
        if k == 2:
            os.kill(loader.worker_pids[0], signal.SIGKILL)
    assert got == want and loader.restart_count == 1
    assert make_restartable(loader) is loader


@pytest.mark.timeout(30)
def test_no_collation_and_restart_records():
    res = dl_stress.campaign("no-collation", kills=4, epochs=1, n=120)
    assert res.kills >= 2 and res.restarts >= 1 and res.order_ok and res.lost == res.duplicated == 0, res
    counts = collections.Counter(res.got[0])
    assert set(counts.values()) == {1}


# -- a process group in a reference cycle when the workers are forked ---------------------------------

GC_GROUP_PROGRAM = Path(__file__).resolve().parents[1] / "programs" / "dl_gc_group_main.py"


@pytest.mark.timeout(60)
def test_a_process_group_left_in_a_cycle_does_not_hang_a_forked_worker():
    """A destroyed gloo group held only by a reference cycle when the workers are forked: a collection
    in a worker (forced by its ``worker_init_fn``) ran the group's destructor there, which waits for gloo
    threads the child does not have, holding the GIL; the loader waited for its first batch for good
    (first seen as a unit test hanging after a DDP test, only in the default suite's order)."""
    res, _ = _run_program([str(GC_GROUP_PROGRAM)], 40, "a worker hung in the collector")
    assert res["got"] == list(range(32)) and res["restarts"] == [], res
