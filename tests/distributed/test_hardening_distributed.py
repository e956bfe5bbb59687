"""Fault scenarios that once defeated the core (2 gloo ranks, 20 s process-group timeout, so a
hang shows as a wait to the timeout): each asserts what every rank saw, and how fast."""

from __future__ import annotations

import pytest
import torch

from launch import PROGRAMS, run_ranks


SCRIPT = PROGRAMS / "hardening_main.py"

pytestmark = pytest.mark.timeout(150)


def _run(tmp_path, scenario, **kwargs):
    return run_ranks(2, scenario, tmp_path, script=SCRIPT, **kwargs)


def test_a_trainer_and_an_evaluator_share_one_watchdog_that_outlives_the_evaluation(tmp_path):
    r0, r1 = _run(tmp_path, "trainer_and_evaluator")
    for r in (r0, r1):
        assert r.returncode == 0 and r.has("done"), r.stderr[-8000:]
        assert r.event("after_evaluation")["running"] is True
    seen = r0.event("epoch2")
    assert seen["raised"] == "PeerFailedError" and seen["failed_rank"] == 1
    assert seen["t"] - r1.event("fault-epoch2")["t"] < 1.4  # released by the watchdog the evaluator did not stop
    assert "released blocked collectives" in r0.stderr


@pytest.mark.long
def test_a_main_thread_holding_the_gil_for_20_s_is_not_declared_lost(tmp_path):
    r0, r1 = _run(tmp_path, "gil_held", pg_timeout=60, deadline=90)
    for r in (r0, r1):
        assert r.returncode == 0 and r.has("done"), r.stderr[-3000:]
        assert "lost" not in r.stderr and "PeerFailedError" not in r.stderr, r.stderr[-3000:]
    assert r1.event("gil_end")["t"] - r1.event("gil_start")["t"] >= 19.5


@pytest.mark.parametrize("first_bad", [1, 0], ids=["peer-failure-caught", "own-failure-caught"])
def test_a_caught_failure_does_not_blind_the_watchdog_to_a_later_one(first_bad, tmp_path):
    """Rank 0 takes a failure that user code catches (rank 1's, acknowledged as a PeerFailedError,
    or its own), then blocks in a collective at once (no agreement in between) while rank 1 fails:
    its watchdog must release it, not the 20 s process-group timeout."""
    r0, r1 = _run(tmp_path, "caught_then_blocked", env={"FIRST_BAD": str(first_bad)})
    for r in (r0, r1):
        assert r.returncode == 0 and r.has("in_step"), r.stderr[-3000:]
    bad, other = (r1, r0) if first_bad == 1 else (r0, r1)
    assert bad.event("first")["raised"] == "OSError"
    assert other.event("first")["raised"] == "PeerFailedError" and other.event("first")["exc_type"] == "OSError"
    second = r0.event("second")
    assert second["raised"] == "PeerFailedError" and second["failed_rank"] == 1
    assert second["exc_message"] == "bad batch 1"
    assert second["t"] - r1.event("fault-second")["t"] < 1.4  # released by its watchdog, not the 20 s timeout
    assert "released blocked collectives" in r0.stderr
    assert r1.event("second")["raised"] == "ValueError"


def test_a_failure_in_an_outer_section_ends_a_rank_inside_an_inner_one(tmp_path):
    r0, r1 = _run(tmp_path, "nested")
    for r in (r0, r1):
        assert r.returncode == 0 and r.has("done"), r.stderr[-3000:]
    fault = r1.event("fault")
    assert r1.event("nested")["raised"] == "KeyError"
    seen = r0.event("nested")
    assert seen["raised"] == "PeerFailedError" and seen["failed_rank"] == 1 and seen["exc_type"] == "KeyError"
    assert "'setup'" in seen["where"]
    assert seen["t"] - fault["t"] < 3.0
    assert not r1.has("inner_body")  # rank 0 ran it as the first rank; rank 1 never got there


def test_ranks_in_different_sections_are_told_which_sections_met(tmp_path):
    results = _run(tmp_path, "mismatched", deadline=40)
    for r in results:
        assert r.returncode == 0 and r.has("done"), r.stderr[-3000:]
        seen = r.event("mismatch")
        assert seen["raised"] == "SectionMismatchError"
        assert "rank 0: fail_together 'evaluate' (agreement 0)" in seen["message"]
        assert "rank 1: fail_together 'checkpoint' (agreement 0)" in seen["message"]


def test_the_reported_exit_waits_for_a_checkpoint_being_written(tmp_path):
    r0, r1 = _run(tmp_path, "checkpoint_during_exit", env={"FTH_EXIT_GRACE_SEC": "1"}, deadline=60)
    assert r0.event("section")["raised"] == "PeerFailedError"
    assert r0.has("write_end"), r0.stderr[-3000:]
    assert r0.event("write_end")["t"] - r0.event("write_start")["t"] > 4.0  # the write outlasted the grace
    assert r0.returncode == 0, r0.stderr[-3000:]  # it took the failure once the write was done
    saved = torch.load(next(p for p in tmp_path.rglob("ckpt.pt")), weights_only=True)
    assert saved["step"] == 7 and saved["w"].numel() == 100_000
    assert "waiting for the checkpoint being written" in r0.stderr


def test_a_hostile_value_in_a_polled_key_breaks_neither_the_job_nor_detection(tmp_path):
    r0, r1 = _run(tmp_path, "garbage_in_store")
    for r in (r0, r1):
        assert r.returncode == 0 and r.has("done"), r.stderr[-3000:]
        assert r.event("new_group_ok")["value"] == 2.0
        assert "lost" not in r.stderr  # nobody was declared lost over it
    assert "store key n held a non-integer value" in r0.stderr + r1.stderr
    assert "store key hb/1 held a non-integer value" in r0.stderr + r1.stderr
    after = r0.event("after")
    assert after["raised"] == "PeerFailedError" and after["failed_rank"] == 1
    assert after["t"] - r1.event("fault-after")["t"] < 1.4
    assert "released blocked collectives" in r0.stderr


def test_file_descriptors_do_not_grow_over_many_runs(tmp_path):
    results = _run(tmp_path, "many_runs", deadline=90)
    for r in results:
        assert r.returncode == 0 and r.has("done"), r.stderr[-3000:]
        counts = r.event("fds")["counts"]
        assert counts[-1] - counts[1] <= 1, counts  # the first run sets up the side group once
