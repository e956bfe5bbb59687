"""``bench/goodput.py``'s pure parts: the schedule it draws (and the ``FTH_INJECT`` it makes of it,
read back by the library's parser) and the figures it reads from a run's records and log. No timing
targets here: those are the bench's."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from fault_tolerant_handlers.core.inject import parse

BENCH = Path(__file__).resolve().parents[2] / "bench" / "goodput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_goodput", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_goodput"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_goodput", None)


def test_the_schedule_is_seeded_spaced_by_the_rate_and_numbers_the_attempts(bench):
    # 10 min of 50 ms steps, one fault per 20 s: windows of 400 steps
    faults = bench.draw_schedule(7, 12000, 20, 50, 8)
    assert faults == bench.draw_schedule(7, 12000, 20, 50, 8)
    assert faults != bench.draw_schedule(8, 12000, 20, 50, 8)
    assert len(faults) == 30
    for j, f in enumerate(faults):  # the middle half of the j-th window
        assert j * 400 + 100 <= f.iteration <= j * 400 + 300 and 0 <= f.rank < 8 and f.kind in bench.KINDS
    assert len({f.kind for f in faults}) == len(bench.KINDS)
    # every kind as often as the others (+-1), even in 10 faults: each kind is in the draw
    for seed in range(20):
        ten = bench.draw_schedule(seed, 12000, 60, 50, 8)
        counts = [sum(f.kind == k for f in ten) for k in bench.KINDS]
        assert len(ten) == 10 and max(counts) - min(counts) <= 1, counts
    attempt = 0
    for f in faults:  # each but a worker kill starts a new attempt
        assert f.attempt == attempt
        attempt += f.kind != "worker-kill"
    injections = parse(bench.inject_env(faults))
    assert [(i.kind, i.rank, i.iteration, i.attempt) for i in injections] == \
        [(f.kind, f.rank, f.iteration, f.attempt) for f in faults]
    # one per 60 s in a short run: within the margins only
    short = bench.draw_schedule(0, 1200, 60, 50, 4, ("raise",))
    assert len(short) == 1 and bench.MARGIN <= short[0].iteration <= 1200 - bench.MARGIN
    with pytest.raises(ValueError, match="unknown kinds.*choose from raise, kill"):
        bench.draw_schedule(0, 1200, 60, 50, 4, ("crash",))
    with pytest.raises(ValueError, match="must be positive"):
        bench.draw_schedule(0, 1200, 0, 50, 4)


LOG = """\
[rank 1 step 40] FTH_INJECT=kill@rank=1,iteration=40: injecting kill
[rank 0] recovering in place, attempt 1 (max_restarts=4), after rank 1 lost; watchdogs stopped 0.10 s, agreed 0.20 s, torn down 0.30 s (sessions 0.01), re-formed 0.50 s after the failure reached this rank; the next call carries on from live state
[rank 1] recovering in place, attempt 1 (max_restarts=4), after rank 1 lost; watchdogs stopped 0.10 s, agreed 0.20 s, torn down 0.30 s (-), re-formed 0.40 s after the failure reached this rank; the next call carries on from live state
[rank 0 step 70] FTH_INJECT=worker-kill@rank=0,iteration=70,attempt=1: injecting worker-kill
"""


def test_a_runs_records_give_the_faults_figures(bench, tmp_path):
    assert bench.parse_fired(LOG) == {("kill", 1, 40), ("worker-kill", 0, 70)}
    assert bench.parse_reformed(LOG) == {1: {0: 0.5, 1: 0.4}}
    # 2 ranks, steps of 0.1 s; rank 1 killed as step 40 would start (t = 4.0): both ranks called
    # again at 5.0 (re-formed 0.5 s / 0.4 s after the failure reached them: 4.5 / 4.6), first step
    # 39 again at 5.3 (one step twice: live state of 38), 40 at 5.4; a worker kill at 70 costs 0.5 s
    for rank in range(2):
        steps = [{"attempt": 0, "step": s, "t": round(s * 0.1, 3)} for s in range(1, 40)]
        steps += [{"attempt": 1, "step": s, "t": round(5.3 + (s - 39) * 0.1, 3)} for s in range(39, 71)]
        steps += [{"attempt": 1, "step": s, "t": round(5.3 + (s - 39) * 0.1 + 0.5, 3)} for s in range(71, 101)]
        (tmp_path / f"batches{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps))
        (tmp_path / f"attempt1_rank{rank}.json").write_text(json.dumps(
            {"start_iteration": 38, "first_step_at": 5.3, "started_at": 0.0, "marks": {"imported": 5.0}}))
    (tmp_path / "log").write_text(LOG)
    faults = [bench.Fault("kill", 1, 40, 0), bench.Fault("worker-kill", 0, 70, 1), bench.Fault("hang", 0, 90, 1)]
    run = bench.read_run(tmp_path, "inplace", faults, 2, 100, 5.0)
    assert run["wall"] == pytest.approx(5.3 + 61 * 0.1 + 0.5 - 0.1)
    assert run["fired"] == 2 and run["twice"] == 1 and run["wall_no_hang"] == run["wall"]  # the hang never fired
    kill, worker, hang = run["faults"]
    assert kill["fired"] and kill["lost"] == pytest.approx(1.4)  # 4.0 -> step 40 again at 5.4
    assert kill["detection"] == pytest.approx(0.6) and kill["recovery"] == pytest.approx(0.4)
    assert kill["first_step"] == pytest.approx(0.3) and kill["recompute"] == pytest.approx(0.1)
    assert worker["fired"] and worker["lost"] == pytest.approx(0.5) and math.isnan(worker["detection"])
    assert not hang["fired"]
    with pytest.raises(RuntimeError, match="did not reach step 101"):
        bench.read_run(tmp_path, "inplace", faults, 2, 101, 5.0)


def test_a_run_finished_with_the_same_settings_is_reused_and_one_with_other_settings_is_refused(bench, tmp_path):
    settings = dict(minutes=10, step_ms=50, hang_timeout=5, seed=0, faults=["raise@rank=1,iteration=300,attempt=0"])
    assert bench.kept_result(tmp_path, settings) is None  # nothing finished there: run it
    (tmp_path / bench.RESULT).write_text(json.dumps(dict(settings=settings, commit="abc", result={"wall": 612.5})))
    assert bench.kept_result(tmp_path, settings) == {"wall": 612.5, "commit": "abc"}
    with pytest.raises(RuntimeError, match="other settings"):
        bench.kept_result(tmp_path, dict(settings, seed=1))
