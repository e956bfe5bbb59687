"""The evidence that a DataLoader worker is stuck at its start (``_Hardened._fth_stuck_at_start``), with a fake
clock and a fake ``/proc/<pid>/stat``: not started, asleep now, and no CPU time used over a whole start deadline.
Anything less (runnable, in a disk wait, stopped, CPU used, started, gone) is judged again, never declared.
The real runs: ``tests/distributed/test_dataloader.py`` (a worker blocked inside ``fork()``, beside CPU hogs)."""

from __future__ import annotations

import pytest

from fault_tolerant_handlers.data import compat_dataloader as cd

DEADLINE = 10.0


class Worker:
    def __init__(self, pid: int) -> None:
        self.pid, self.fth_started = pid, cd._SharedFlag()


class Iterator(cd._Hardened):
    """Only what the check reads: two workers, not started, 5 CPU ticks each at time 100."""

    def __init__(self) -> None:
        self._workers = [Worker(1001), Worker(1002)]
        self._fth_start_deadline = DEADLINE
        self._fth_unstarted = {0: (100.0, 5), 1: (100.0, 5)}


def stat(state: str, ticks: int) -> list[str]:
    fields = ["0"] * 50  # the fields after ``(comm)``
    fields[0], fields[11], fields[12] = state, str(ticks - 1), "1"
    return fields


@pytest.fixture
def proc(monkeypatch):
    table = {1001: stat("S", 5), 1002: stat("S", 5)}
    monkeypatch.setattr(cd._procfs, "stat_fields", lambda pid: table.get(pid))
    return table


def test_asleep_with_no_cpu_over_the_deadline_is_stuck_and_not_before(proc):
    it = Iterator()
    proc[1002] = stat("R", 5)
    assert it._fth_stuck_at_start(100.0 + DEADLINE - 0.01) is None
    assert it._fth_stuck_at_start(100.0 + DEADLINE) == 0


@pytest.mark.parametrize("state, ticks", [("R", 5), ("D", 5), ("T", 5), ("S", 6)],
                         ids=["runnable", "disk-wait", "stopped", "used-cpu"])
def test_a_worker_showing_progress_or_not_asleep_is_judged_again_over_a_whole_deadline(proc, state, ticks):
    it = Iterator()
    proc[1001], proc[1002] = stat(state, ticks), stat("R", 5)
    assert it._fth_stuck_at_start(110.0) is None
    assert it._fth_unstarted[0] == (110.0, ticks)  # the deadline starts again from here
    proc[1001] = stat("S", ticks)
    assert it._fth_stuck_at_start(110.0 + DEADLINE - 0.01) is None
    assert it._fth_stuck_at_start(110.0 + DEADLINE) == 0


def test_a_worker_that_marked_its_start_is_no_longer_watched(proc):
    it = Iterator()
    for worker in it._workers:
        worker.fth_started.set()
    assert it._fth_stuck_at_start(200.0) is None and it._fth_unstarted == {}


def test_a_worker_gone_is_left_to_the_death_check(proc):
    it = Iterator()
    del proc[1001]
    proc[1002] = stat("Z", 5)
    assert it._fth_stuck_at_start(200.0) is None
