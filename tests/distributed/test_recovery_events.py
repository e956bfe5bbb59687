"""Recovery made visible: rank 1 raises at iteration 7 under ``recover_in_place`` (``torchrun
--max-restarts 0``, 2 ranks, a real ``Engine`` or ``Trainer``: ``programs/recovery_events_main.py``),
and every rank's handlers see the recovery, once, with its cause.

Each rank must have seen, through the framework (Ignite's ``FaultToleranceEvents`` on the engine;
Lightning's ``on_failure_seen``/``on_recovery_started``/``on_recovered`` on a callback and
``on_recovered`` on the module) and through ``on_recovery``, exactly one failure seen, one recovery
started and one recovered, in that order, each naming rank 1, ``FailureKind.RAISED``, the injected
message and attempt 1; the recovery carries on from live state at step 6 (0 steps computed twice),
the numbers are on ``engine.state.fault_tolerance`` (Ignite) or given to the trainer's logger at the
first step after the recovery (Lightning), and ``recovery_history()`` holds the same three moments.

Default suite: Ignite and Lightning from live state. ``long``: both with ``FTH_LIVE_STATE=0`` (from
the checkpoint of step 5: 1 step computed twice).
"""

from __future__ import annotations

import pytest

from fault_tolerant_handlers.errors import FailureKind
from launch import PROGRAMS, kill_workers, run_ranks

SCRIPT = PROGRAMS / "programs" / "recovery_events_main.py"
INJECT = "raise@rank=1,iteration=7"
PHASES = ["FAILURE_SEEN", "RECOVERY_STARTED", "RECOVERED"]


def run_job(framework: str, tmp_path, env: dict[str, str]):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                "--monitor-interval", "0.5"]
    run_dir = tmp_path / f"{framework}-1"
    try:
        results = run_ranks(1, framework, tmp_path, script=SCRIPT, launcher=launcher, deadline=150, result_ranks=2,
                            env={"FTH_INJECT": INJECT, **env})
    finally:
        kill_workers(run_dir, program=SCRIPT.name)  # torchrun's workers have sessions of their own
    assert results[0].returncode == 0, f"torchrun exited {results[0].returncode}:\n{results[0].stderr[-4000:]}"
    return results


def check_info(info: dict, phase: str, rank: int) -> None:
    assert info["phase"] == {"FAILURE_SEEN": "failure seen", "RECOVERY_STARTED": "recovery started",
                             "RECOVERED": "recovered"}[phase], info
    assert info["attempt"] == 1 and info["rank"] == rank, info
    cause = info["cause"]
    assert cause["rank"] == 1 and FailureKind(cause["kind"]) is FailureKind.RAISED, cause
    # a peer names the type as its PeerFailedError does (qualified), the failing rank by its own name
    assert cause["exc_type"].split(".")[-1] == "InjectedFault" and INJECT in cause["message"], cause
    assert info["seconds"] >= 0, info


def check_sequence(events: list[dict], via: str, rank: int, live: bool) -> list[dict]:
    seen = [e for e in events if e["via"] == via]
    assert [e["event"] for e in seen] == PHASES, f"rank {rank}, {via}: {[e.get('event') for e in seen]}"
    for e, phase in zip(seen, PHASES):
        check_info(e["info"], phase, rank)
    first, started, recovered = (e["info"] for e in seen)
    assert first["source"] is None and first["step"] is None and first["seconds"] == 0, first
    assert [e["attempt"] for e in seen] == [0, 0, 1], "failure seen, started in attempt 0; recovered in attempt 1"
    if live:
        assert started["source"] == recovered["source"] == "live", (started, recovered)
        assert started["step"] == recovered["step"] == 6, (started, recovered)
    else:
        assert started["source"] == recovered["source"] == "checkpoint", (started, recovered)
    assert started["seconds"] <= recovered["seconds"], (started, recovered)
    return seen


CASES = [pytest.param("ignite", True, id="ignite-live"), pytest.param("lightning", True, id="lightning-live"),
         pytest.param("ignite", False, id="ignite-checkpoint", marks=pytest.mark.long),
         pytest.param("lightning", False, id="lightning-checkpoint", marks=pytest.mark.long)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("framework, live", CASES)
def test_every_rank_sees_one_failure_one_start_and_one_recovery(framework, live, tmp_path):
    results = run_job(framework, tmp_path, {} if live else {"FTH_LIVE_STATE": "0"})
    step, twice = (6, 0) if live else (5, 1)  # the checkpoint of step 5; rank 1 had completed 6
    for rank, result in enumerate(results):
        events = result.events
        assert events, f"rank {rank} recorded nothing:\n{result.stderr[-3000:]}"
        # the framework-neutral subscription, in the process that trains
        neutral = check_sequence(events, "on_recovery", rank, live)
        if framework == "ignite":
            seen = check_sequence(events, "ignite", rank, live)
            state = [e for e in events if e["via"] == "state"]
            assert len(state) == 1, state
            metrics = state[0]["metrics"]
            assert metrics["recoveries"] == 1 and metrics["steps_computed_twice"] == twice, metrics
            assert metrics["time_to_recover"] == seen[2]["info"]["seconds"] > 0, metrics
            assert metrics["last"]["phase"] == "recovered" and metrics["last"]["step"] == step, metrics
            assert state[0]["iteration"] == step, state
        else:
            seen = check_sequence(events, "callback", rank, live)
            assert seen[2]["global_step"] == step, seen[2]
            module = [e for e in events if e["via"] == "module"]
            assert len(module) == 1 and module[0]["info"] == seen[2]["info"], module
            logged = [e for e in events if e["via"] == "logger" and "fault_tolerance/recoveries" in e["metrics"]]
            assert len(logged) == 1, f"rank {rank}: {logged}"
            assert logged[0]["step"] == step + 1, logged  # the first step after the recovery
            assert logged[0]["metrics"]["fault_tolerance/recoveries"] == 1.0, logged
            assert logged[0]["metrics"]["fault_tolerance/steps_computed_twice"] == twice, logged
            assert logged[0]["metrics"]["fault_tolerance/time_to_recover"] > 0, logged
            final = [e for e in events if e["via"] == "callback_metrics"]
            assert final and final[0]["metrics"]["fault_tolerance/recoveries"] == 1.0, final
        # what the framework got is the recovery's info, completed by the loop that carried on
        assert seen[2]["info"]["step"] == step and seen[2]["info"]["steps_computed_twice"] == twice, seen[2]
        assert neutral[0]["info"] == seen[0]["info"] and neutral[1]["info"] == seen[1]["info"]
        done = [e for e in events if e["via"] == "done"]
        assert [d["attempt"] for d in done] == [1], done
        history = done[0]["history"]
        assert [h["phase"] for h in history] == ["failure seen", "recovery started", "recovered"], history
        assert history[2] == seen[2]["info"], (history[2], seen[2]["info"])
        assert done[0]["iteration"] == 20, done
