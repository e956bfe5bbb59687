"""Healthy jobs as the world grows: no stall at start, no false alarm, few store connections.

Each scenario is ``tests/soak_main.py`` (a real Ignite ``Engine`` under ``torchrun --standalone``, or
a real Lightning ``Trainer`` with ``ddp``), 2 epochs of 30 iterations, no fault, a 60 s process-group
timeout (a stall of a minute fails the run; a longer timeout once hid one). 4 ranks run in the
default suite, 8 and 16 ranks beside 2 CPU hogs in the long one.
"""

from __future__ import annotations

import statistics

import pytest

from launch import cpu_hogs, healthy_run

ITERATIONS = 60
#: The stock job's own TCP connections to the store per rank (torch 2.13: the default store's client).
TORCH_CONNS = 1


def _clean(run, world: int) -> None:
    assert run.finished(ITERATIONS) == world, run.output[-4000:]
    assert not run.declarations, "\n".join(run.declarations[:10])


@pytest.mark.timeout(240)
def test_a_store_slow_to_take_connections_does_not_hold_any_rank_at_start(tmp_path):
    """4 ranks; every store connection the library makes takes 5 s to connect (a store server
    busy with many ranks starting): no rank's first iteration waits for them (before, the main
    thread connected three of them in turn: 15 s), and once connected a rank holds two of the
    library's (its watchdog's and its liveness helper's), and nothing is declared."""
    run = healthy_run("ignite", 4, tmp_path, deadline=200,
                      env={"SOAK_SLOW_CONNECT": "5", "SOAK_STEP_SLEEP": "0.25"})
    _clean(run, 4)
    for rank, record in sorted(run.ranks.items()):
        assert record["first"] - record["run_at"] < 5.0, (rank, record["first"] - record["run_at"])
        assert record["store_conns"] - TORCH_CONNS == 2, (rank, record["store_conns"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("framework", ["ignite", "lightning"])
def test_a_slow_first_iteration_is_not_a_hang(framework, tmp_path):
    """4 ranks with ``hang_timeout`` 2 s; rank 1's first step takes 8 s (a compile, a cold cache),
    its peers wait for it in DDP's first all_reduce: nobody is declared hung (the start has its own
    deadline, ``FTH_START_TIMEOUT_SEC``), and every rank trains to the end."""
    run = healthy_run(framework, 4, tmp_path, deadline=200,
                      env={"SOAK_HANG_TIMEOUT": "2", "SOAK_SLOW_START": "1:8"})
    _clean(run, 4)
    assert run.ranks[1]["times"][0] - run.ranks[1]["run_at"] >= 8.0


@pytest.mark.timeout(240)
def test_a_hang_after_the_start_is_still_declared_within_hang_timeout(tmp_path):
    """The start's deadline does not blunt ``hang_timeout`` once the first iteration completed: the
    same job with rank 1 asleep for 30 s in its step 20 is named hung (``RankHung``) by its own
    watchdog within ``hang_timeout`` 2 s and the margin, and every rank ends."""
    run = healthy_run("ignite", 4, tmp_path, deadline=120,
                      env={"SOAK_HANG_TIMEOUT": "2", "SOAK_HANG_AT": "1:20:30"})
    assert any("RankHung" in line and "rank 1" in line for line in run.declarations), run.output[-4000:]
    assert run.finished(ITERATIONS) == 0
    hung = [line for line in run.output.splitlines() if "hung: its main thread made no progress" in line]
    assert hung and "before its first iteration completed" not in hung[0], hung[:3]


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [8, 16])
@pytest.mark.parametrize("framework", ["ignite", "lightning"])
def test_a_healthy_job_at_scale_beside_two_cpu_hogs_neither_stalls_nor_alarms(framework, world, tmp_path):
    """8 and 16 ranks on 2 busy cores, 2 runs: every rank finishes, nothing is declared, no rank
    finishes any iteration more than 5 s after the first rank that finished it.

    Lightning at 16 ranks runs without the hogs (its 16 ranks alone keep both cores busy): beside
    them the stock job cannot start either. Lightning's ``ddp`` starts ranks 1-15 after rank 0, which
    waits for them in its store for the process-group timeout (60 s) while they import Lightning:
    measured 2026-12-03, ``1/16 clients joined`` stock and ``3/16`` with the library."""
    hogs = 0 if (framework, world) == ("lightning", 16) else 2
    for i in range(2):
        with cpu_hogs(hogs):
            run = healthy_run(framework, world, tmp_path / str(i), deadline=400)
        _clean(run, world)
        assert run.max_lag is not None and run.max_lag < 5.0, run.max_lag


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("framework", ["ignite", "lightning"])
def test_a_healthy_job_recovering_in_place_at_8_ranks_recovers_nothing(framework, tmp_path):
    """8 ranks in ``recover_in_place`` with ``hang_timeout`` 5 s beside 2 CPU hogs, 2 runs: no rank
    declares itself hung at the slow start, none recovers, every rank finishes in attempt 0."""
    for i in range(2):
        with cpu_hogs(2):
            run = healthy_run(framework, 8, tmp_path / str(i), deadline=400,
                              env={"SOAK_HANG_TIMEOUT": "5", "SOAK_INPLACE": "2"})
        _clean(run, 8)
        assert [r.get("attempt") for r in run.ranks.values()] == [0] * 8
        assert "recovering in place" not in run.output
        assert statistics.median(r["first"] - run.launched for r in run.ranks.values()) < 60
