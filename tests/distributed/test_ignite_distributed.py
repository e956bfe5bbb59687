"""Ignite: ``FaultTolerance().attach(trainer)`` on 2 real gloo ranks with a real DDP model.

For each kind of fault, every rank's ``Engine.run`` raises within 5 s of the fault, the failing
rank its own exception and the other ``PeerFailedError`` with the cause, iteration and epoch. The
failing rank stays alive after its run raised (``LINGER``), so the other rank cannot be released
by the failing process's exit: only by the handler. The same scenarios with stock Ignite wait to
the (short) process-group timeout, or lose the cause, or abort."""

from __future__ import annotations

from pathlib import Path

import signal

import pytest

from launch import PROGRAMS, run_ranks

SCRIPT = PROGRAMS / "ignite_main.py"
MAX_LATENCY_SEC = 5.0

pytestmark = pytest.mark.timeout(120)

# fault kind -> (failing rank, exception type it raises, message)
FAULTS = {
    "step": (1, "RuntimeError", "CUDA-like failure at iteration 3"),
    "data": (1, "ValueError", "bad sample 17"),
    "handler": (1, "ZeroDivisionError", "metric denominator is 0"),
    "rank0_handler": (0, "PermissionError", "cannot write /logs/epoch1.json"),
    "exc_collective": (1, "RuntimeError", "CUDA-like failure at iteration 3"),
    "evaluator": (1, "KeyError", "'missing label column'"),
}


def _run(tmp_path, fault, use_ft, **kw):
    bad = FAULTS[fault][0]
    env = dict(FAULT=fault, FAULT_RANK=str(bad), USE_FT="1" if use_ft else "0", LINGER=kw.pop("linger", "4"))
    return run_ranks(2, "", tmp_path, script=SCRIPT, env=env, deadline=60, **kw)


def _assert_failed_together(results, fault):
    bad, exc_type, message = FAULTS[fault]
    fault_event = results[bad].event("fault")
    assert fault_event["message"] == message
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}:\n{r.stderr[-3000:]}"
        seen = r.event("run_raised")
        assert not r.has("run_returned")
        assert seen["t"] - fault_event["t"] < MAX_LATENCY_SEC, (r.rank, seen["t"] - fault_event["t"])
        if r.rank == bad:
            assert seen["raised"] == exc_type, seen
            assert seen["message"] == message, seen
        else:
            assert seen["raised"] == "PeerFailedError", seen
            assert seen["failed_rank"] == bad
            assert seen["exc_type"] == exc_type
            assert seen["exc_message"] == message
            assert seen["step"] is not None and seen["epoch"] is not None
            assert f"rank {bad} failed in 'train' (epoch {seen['epoch']}, iteration {seen['step']})" in seen["message"]
            assert "Traceback of rank" in seen["message"]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_rank_raises_with_the_cause(fault, tmp_path):
    results = _run(tmp_path, fault, use_ft=True)
    _assert_failed_together(results, fault)
    if fault == "exc_collective":
        # the user's own exception handler ran on the failing rank, and the run still raised
        assert results[1].has("user_exc_handler")


@pytest.mark.long  # stock Ignite's behaviour, not the library's: make test-long
@pytest.mark.parametrize("fault", ["step", "rank0_handler", "exc_collective"])
def test_stock_ignite_waits_loses_the_cause_or_aborts(fault, tmp_path):
    bad = FAULTS[fault][0]
    results = _run(tmp_path, fault, use_ft=False, pg_timeout=4.0, linger="6")
    fault_event = results[bad].event("fault")
    peer = results[1 - bad]
    seen = [e for e in peer.events if e["event"] in ("run_raised", "run_returned")]
    assert seen, peer.events
    assert FAULTS[fault][2] not in seen[0].get("message", "")  # stock never tells the other rank why
    if fault == "exc_collective":
        # the failing rank's own exception handler runs a collective the peer is not in: it aborts
        assert results[bad].returncode == -signal.SIGABRT, results[bad].stderr[-2000:]
    else:
        # the other rank sits in its next collective until the process-group timeout
        assert seen[0]["event"] == "run_raised" and "Timed out" in seen[0]["message"], seen
        assert seen[0]["t"] - fault_event["t"] >= 3.5


def test_under_idist_parallel(tmp_path):
    results = run_ranks(1, "", tmp_path, script=SCRIPT, env=dict(FAULT="step", LAUNCH="parallel", LINGER="3"),
                        result_ranks=2, deadline=60)
    _assert_failed_together(results, "step")


@pytest.mark.long  # suite time: Ignite under torchrun runs in test_torchrun_distributed.py
def test_under_torchrun(tmp_path):
    results = run_ranks(1, "", tmp_path, script=SCRIPT, env=dict(FAULT="handler", LINGER="3"), result_ranks=2,
                        deadline=60, launcher=["-m", "torch.distributed.run", "--nproc-per-node=2"])
    _assert_failed_together(results, "handler")


def test_clean_run_completes_on_every_rank(tmp_path):
    results = run_ranks(2, "", tmp_path, script=SCRIPT, env=dict(FAULT="none"), deadline=60)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.event("run_returned")["epoch"] == 3
