"""``bench/detection.py``'s pure parts: the table's cells and rows, the cell environments, judging a
rank's report, and counting a job's leaked processes on a real short-lived process tree. The matrix
itself is a benchmark (minutes), never run here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import ROOT

BENCH = ROOT / "bench" / "detection.py"

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_detection", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_detection"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_detection", None)


def test_cells_format_as_table_rows(bench):
    RunResult = bench.RunResult
    stock = RunResult(seconds=21.34, cause_ranks=1, speaking_ranks=2, leaked=2)
    ours = RunResult(seconds=0.4567, cause_ranks=2, speaking_ranks=2)
    hung = RunResult(timed_out=True, deadline_after_fault=61.6, cause_ranks=0, speaking_ranks=1, leaked=3)
    healed = RunResult(seconds=0.123, recovered=True)
    ignite, lightning = bench.LAUNCHERS[0], bench.LAUNCHERS[2]
    raise_, hang, oec = (next(s for s in bench.SCENARIOS if s.key == k) for k in ("raise", "hang", "oec"))
    cells = [bench.Cell(ignite, raise_, stock, ours), bench.Cell(lightning, hang, hung, healed),
             bench.Cell(ignite, oec, None, None)]
    assert bench.table_rows(cells) == [
        ["Ignite torchrun", "raise in step", "21.3", "0.46", "no (1/2)", "yes (2/2)", "2", "0"],
        ["Lightning ddp", "hang", ">62 (killed)", "0.12 recovered", "no (0/1)", "(recovered)",
         "3 alive at deadline", "0"],
        ["Ignite torchrun", "raise with OnExceptionCheckpoint", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a"],
    ]
    table = bench.markdown_table(cells, pg_timeout=20).splitlines()
    assert "stock s (pg timeout 20 s)" in table[0]
    assert table[1] == "|---|---|---|---|---|---|---|---|"
    assert len(table) == 2 + len(cells) and all(line.count("|") == 9 for line in table)
    assert bench.format_seconds(RunResult(error="the fault never fired")) == "error: the fault never fired"


def test_cell_environments(bench):
    by_key = {s.key: s for s in bench.SCENARIOS}
    ignite_tr, ignite_par, lightning_ddp, lightning_spawn = bench.LAUNCHERS
    assert bench.not_applicable(ignite_tr, by_key["oec"]) and bench.not_applicable(ignite_par, by_key["oec"])
    assert bench.not_applicable(lightning_spawn, by_key["exc_collective"])
    assert not bench.not_applicable(lightning_ddp, by_key["exc_collective"])
    stock = bench.run_env(ignite_par, by_key["kill"], False, pg_timeout=20, hang_timeout=5)
    assert stock["USE_FT"] == "0" and stock["FTH_TEST_PG_TIMEOUT"] == "20" and stock["LAUNCH"] == "parallel"
    assert stock["FTH_INJECT"] == "kill@rank=1,iteration=3" and stock["RERAISE"] == "1"
    ours = bench.run_env(lightning_ddp, by_key["hang"], True, pg_timeout=20, hang_timeout=5)
    assert ours["USE_FT"] == "1" and ours["FTH_HANG_TIMEOUT_SEC"] == "5" and ours["LAUNCH"] == "ddp"
    worker = bench.run_env(lightning_spawn, by_key["worker_kill"], True, pg_timeout=20, hang_timeout=5)
    assert worker["RESTARTABLE"] == "1" and worker["WORKERS"] == "2"
    assert bench.run_env(ignite_tr, by_key["rank_first"], False, pg_timeout=20, hang_timeout=5)["FAULT_RANK"] == "0"


def test_judging_what_a_rank_reported(bench):
    raised = [{"event": "run_raised", "raised": "PeerFailedError", "message": "rank 1 failed: SIGKILL ..."}]
    assert bench.judge_rank(raised, "", 0, "SIGKILL")[0] is True
    assert bench.judge_rank(raised, "", 0, "hung")[0] is False
    output = "noise\n[rank 1] fault-tolerant-handlers: ending this process (exit code 88) because:\nrank 1 hung: ...\n"
    assert bench.judge_rank([], output, 1, "hung") == (True, "rank 1 hung: ...")
    logged = "[rank 1 step 3] FTH_INJECT=hang@rank=1,iteration=3: injecting hang\n[rank 1] rank 1 hung: no progress\n"
    assert bench.judge_rank([], logged, 1, "hung") == (True, "logged: [rank 1] rank 1 hung: no progress")
    assert bench.judge_rank([], logged, 0, "hung")[0] is False
    assert bench.judge_rank([], logged.splitlines()[0], 1, "hang@rank=1")[0] is False  # the injection itself
    assert bench.judge_rank([{"event": "run_returned"}], "", 0, "x")[0] is None
    assert bench.judge_rank([], "", 0, "x") == (False, "ended without a word")


def test_leaked_processes_of_a_real_job_are_counted_then_killed(bench):
    # a job whose top process exits at once, leaving a grandchild (in its session) and a child that
    # moved to a session of its own (as torchrun's workers do)
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen(['sleep', '30'])\n"
            "subprocess.Popen(['sleep', '30'], start_new_session=True)\n"
            "time.sleep(0.5)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    job = bench.JobProcesses(proc.pid)
    try:
        seen_all = False
        while proc.poll() is None:
            seen_all = seen_all or len(job.poll()) == 3
            time.sleep(0.02)
        assert seen_all
        time.sleep(0.2)
        alive = job.poll()
        assert proc.pid not in alive and len(alive) == 2  # the two orphans: leaked
        assert proc.pid in job.first_dead
    finally:
        killed = job.kill_all()
        proc.wait()
    assert killed == 2
    deadline = time.time() + 5
    while job.poll() and time.time() < deadline:
        time.sleep(0.05)
    assert job.poll() == set()
