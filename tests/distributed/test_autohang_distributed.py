"""``hang_timeout="auto"`` with real ranks (gloo, 2 ranks, real Ignite ``Engine`` / Lightning ``Trainer``),
the rule shortened through its environment (floor 2 s, warm-up 5 steps): a rank hung in a step after
the warm-up is reported on every rank with its own stack within the learned deadline + 1 s; long but
normal work (an evaluation, a checkpoint write), each longer than the learned step deadline of the
time, raises no alarm."""

from __future__ import annotations

import re

import pytest

from launch import PROGRAMS, run_ranks

IGNITE = PROGRAMS / "ignite_main.py"
LIGHTNING = PROGRAMS / "lightning_main.py"
RULE = {"FTH_AUTO_HANG_FLOOR_SEC": "2", "FTH_AUTO_HANG_WARMUP": "5"}
FLOOR, MULTIPLE = 2.0, 10.0
HUNG_LINE = "time.sleep(1000)  # the hung line the report must show"

pytestmark = pytest.mark.timeout(90)


def _learned_deadline(message: str) -> float:
    found = re.search(r"over the learned deadline of ([0-9.]+) s", message)
    assert found, message
    return float(found.group(1))


def _assert_reported_within_the_learned_deadline(fault: dict, hung, survivor, hung_exit: int | None) -> None:
    from fault_tolerant_handlers import EXIT_HUNG

    # the deadline the hung rank had learned when it hung: max(floor, 10 x its longest step)
    assert fault["steps"] >= 5 and fault["step_deadline"] == pytest.approx(
        max(FLOOR, MULTIPLE * fault["longest"]["step"]))
    assert hung_exit == EXIT_HUNG
    assert HUNG_LINE in hung.stderr  # its own report, with its stack
    seen = survivor.event("run_raised")
    assert seen["raised"] == "PeerFailedError" and seen["failed_rank"] == hung.rank and seen["exc_type"] == "RankHung"
    assert HUNG_LINE in seen["message"] or HUNG_LINE in seen.get("remote_traceback", "")
    deadline = _learned_deadline(seen["exc_message"])
    assert deadline == pytest.approx(fault["step_deadline"], abs=0.05)
    latency = seen["t"] - fault["t"]
    assert latency <= deadline + 1.0, (latency, deadline)
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    assert not survivor.leaked and not hung.leaked


def _assert_no_alarm(results, slow_kinds: set[str]) -> None:
    slow = [e for r in results for e in r.events if e["event"] == "slow"]
    assert {e["kind"] for e in slow} == slow_kinds, slow
    for e in slow:  # each piece of work was longer than the deadline it is judged by: a step's at the
        # time, or a Lightning checkpoint's own (learned from the fast ones before it)
        limit = e.get("checkpoint_deadline") if e["kind"] == "checkpoint" and "checkpoint_deadline" in e \
            else e["step_deadline"]
        assert limit is not None and e["seconds"] > limit >= FLOOR, e
        if e["kind"] == "validation" and "evaluation_deadline" in e:  # Lightning: within its own kind's
            assert e["seconds"] < e["evaluation_deadline"], e  # deadline, or the rule would be right to alarm
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.has("run_returned"), r.events
        assert "hung" not in r.stderr, r.stderr[-3000:]


def test_ignite_rank_hung_in_a_step_after_warm_up_is_reported_within_the_learned_deadline(tmp_path):
    env = dict(FAULT="hang", FAULT_RANK="1", FAULT_ITER="12", HANG="auto", USE_FT="1", FTH_TEST_PG_TIMEOUT="30", **RULE)
    results = run_ranks(2, "", tmp_path, script=IGNITE, env=env, deadline=45)
    _assert_reported_within_the_learned_deadline(results[1].event("fault"), results[1], results[0], results[1].returncode)


@pytest.mark.long  # suite time: the Lightning no-alarm case runs in make test
def test_ignite_long_evaluations_and_a_slow_checkpoint_raise_no_alarm(tmp_path):
    # 0.1 s steps: after waiting for rank 0's work, rank 1 is still inside its step at a poll
    env = dict(FAULT="none", SLOW="1", HANG="auto", USE_FT="1", FTH_TEST_PG_TIMEOUT="30", STEP_SLEEP="0.1", **RULE)
    results = run_ranks(2, "", tmp_path, script=IGNITE, env=env, deadline=60)
    _assert_no_alarm(results, {"nested evaluation", "epoch-end evaluation", "checkpoint"})


def _lightning(tmp_path, **env):
    env = dict(USE_FT="1", OEC="0", LAUNCH="ddp", FTH_TEST_TOP="1", FTH_HANG_TIMEOUT_SEC="auto", **RULE, **env)
    return run_ranks(1, "", tmp_path, script=LIGHTNING, env=env, result_ranks=2, deadline=60)


@pytest.mark.long  # suite time: the Ignite hung-step case runs in make test
def test_lightning_rank_hung_in_a_step_after_warm_up_is_reported_within_the_learned_deadline(tmp_path):
    results = _lightning(tmp_path, FAULT="hang", FAULT_RANK="1", FAULT_STEP="12", LINGER="0")
    hung, survivor = results[1], results[0]
    # rank 1 is the child Lightning's launcher (rank 0) started: rank 0 records how it exited
    _assert_reported_within_the_learned_deadline(hung.event("fault"), hung, survivor,
                                                 survivor.event("child_exited")["returncode"])


@pytest.mark.parametrize("step_sleep", ["0", "0.35"], ids=["fast-steps", "slow-steps"])
def test_lightning_long_validation_and_a_slow_checkpoint_raise_no_alarm(tmp_path, step_sleep):
    # slow steps: a step's deadline (>= 3.5 s) is more than twice the checkpoint's own (2 s, learned
    # from the fast checkpoints before it), which is the one a checkpoint is judged by
    results = _lightning(tmp_path, FAULT="none", SLOW="1", STEP_SLEEP=step_sleep)
    _assert_no_alarm(results, {"validation", "checkpoint"})


@pytest.mark.parametrize("hang", ["auto", "2"], ids=["learned-deadline", "fixed-2s"])
def test_a_job_suspended_and_resumed_raises_no_alarm(tmp_path, hang):
    # Every process of the job stopped for 3 s in a step of rank 0's (a scheduler's suspend), then
    # continued: the step's own work is 0.8 s, under a 2 s deadline. Time in which the watchdog could
    # not look is no evidence against a main thread that could not run either.
    env = dict(FAULT="freeze", FAULT_RANK="0", FAULT_ITER="12", FREEZE="3", HANG=hang, USE_FT="1",
               FTH_TEST_PG_TIMEOUT="30", **RULE)
    results = run_ranks(2, "", tmp_path, script=IGNITE, env=env, deadline=60)
    frozen = results[0]
    assert frozen.has("resumed"), frozen.events  # the freeze happened, with the deadline armed:
    if hang == "auto":
        assert frozen.event("fault")["step_deadline"] == pytest.approx(FLOOR)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert not r.has("run_raised"), r.events
        assert "hung" not in r.stderr and "PeerSilent" not in r.stderr, r.stderr[-3000:]


@pytest.mark.long  # 8 ranks: the default suite runs the 2-rank cases
@pytest.mark.timeout(240)
def test_an_8_rank_job_suspended_and_resumed_beside_busy_cores_raises_no_alarm(tmp_path):
    from launch import cpu_hogs

    # 8 ranks run 2 iterations an epoch, 3 epochs: iteration 6 is the first judged (warm-up 5)
    env = dict(FAULT="freeze", FAULT_RANK="3", FAULT_ITER="6", FREEZE="3", HANG="auto", USE_FT="1",
               FTH_TEST_PG_TIMEOUT="60", **RULE)
    with cpu_hogs(2):
        results = run_ranks(8, "", tmp_path, script=IGNITE, env=env, deadline=200)
    assert results[3].has("resumed"), results[3].events
    assert results[3].event("fault")["step_deadline"] is not None  # judged
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert not r.has("run_raised"), r.events
        assert "hung" not in r.stderr and "PeerSilent" not in r.stderr, r.stderr[-3000:]
