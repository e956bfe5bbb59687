"""The out-of-band watchdog with real processes and real signals (gloo, 2 ranks): a failure while a
peer is blocked in a collective, a SIGKILLed peer (also the store host), a hung peer, a peer whose
watchdog is frozen (SIGSTOP). Ignite runs use the adapter; the failing rank stays alive after its
failure where that matters, so a peer cannot be woken by its exit."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from launch import PROGRAMS, run_ranks

IGNITE = PROGRAMS / "ignite_main.py"

pytestmark = pytest.mark.timeout(120)


def _fault(results, rank):
    return results[rank].event("fault")


def test_failure_while_peer_is_blocked_in_a_collective_is_released(tmp_path):
    results = run_ranks(2, "blocked_release", tmp_path, env={"LINGER": "6"})
    fault = _fault(results, 1)
    assert results[0].has("entering_collective")  # rank 0 really was inside the all_reduce
    peer = results[0].event("section")
    assert peer["raised"] == "PeerFailedError" and peer["failed_rank"] == 1
    assert peer["exc_type"] == "ValueError" and peer["exc_message"] == "bad batch 5"
    assert peer["t"] - fault["t"] < 3.0
    assert results[1].event("section")["raised"] == "ValueError"
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]


def test_without_in_process_release_the_blocked_rank_makes_a_reported_exit(tmp_path):
    results = run_ranks(2, "reported_exit", tmp_path, env={"LINGER": "8", "FTH_RELEASE": "exit",
                                                           "FTH_EXIT_GRACE_SEC": "1"})
    fault = _fault(results, 1)
    from fault_tolerant_handlers import EXIT_PEER_FAILED

    assert results[0].returncode == EXIT_PEER_FAILED
    assert not results[0].leaked
    assert not results[0].has("section")  # it never got out of the all_reduce by itself
    report = results[0].stderr
    assert "ending this process (exit code 87)" in report
    assert "rank 1 failed in 'step': ValueError: bad batch 5" in report
    assert "fault(ValueError(" in report  # the failing rank's traceback is in the report
    # and where this rank's main thread was stuck, the collective the release did not reach
    assert "its main thread did not take the failure within 1 s" in report
    assert "in blocked_release" in report.split("its main thread did not take the failure")[1]
    # it ended within release grace + exit grace + a margin of the fault
    assert results[1].returncode == 0


def test_a_rank_whose_send_gloo_leaves_waiting_ends_as_soon_as_nothing_can_end_the_call(tmp_path):
    """Rank 0 sends 256 MB to rank 1, which is SIGKILLed with the send under way: gloo leaves rank 0's
    send waiting for the group's timeout (20 s here) on a connection that is gone. Its watchdog names
    the loss and releases; the main thread, still blocked with every released connection closed, is
    ended with a report saying so, not after ``FTH_EXIT_GRACE_SEC`` (set to 30 s: the test cannot pass
    by the grace)."""
    results = run_ranks(2, "send_to_killed", tmp_path, env={"FTH_EXIT_GRACE_SEC": "30"}, deadline=60)
    from fault_tolerant_handlers import EXIT_PEER_FAILED

    assert results[1].returncode == -signal.SIGKILL
    assert results[0].has("entering_collective") and not results[0].has("section")  # never out of the send
    assert results[0].returncode == EXIT_PEER_FAILED, results[0].stderr[-3000:]
    report = results[0].stderr
    assert "rank 1 (pid" in report and "lost" in report
    assert "its main thread is blocked in a call that only its group's timeout ends" in report, report[-3000:]
    assert "in send_to_killed" in report.split("only its group's timeout ends")[1]


def _ignite(tmp_path, fault, fault_rank, **env):
    env = dict(FAULT=fault, FAULT_RANK=str(fault_rank), USE_FT="1", FTH_TEST_PG_TIMEOUT="30", **env)
    return run_ranks(2, "", tmp_path, script=IGNITE, env=env, deadline=45,
                     expect_hang=fault == "stop", stragglers_grace=2.0 if fault == "stop" else None)


@pytest.mark.parametrize("killed", [1, 0], ids=["peer", "store-host"])
def test_sigkilled_peer_ends_every_survivor_naming_the_lost_rank(killed, tmp_path):
    results = _ignite(tmp_path, "kill", killed, WORKERS="2")
    fault = _fault(results, killed)
    assert results[killed].returncode == -signal.SIGKILL
    survivor = results[1 - killed]
    seen = survivor.event("run_raised")
    assert seen["raised"] == "PeerFailedError" and seen["failed_rank"] == killed
    assert seen["exc_type"] == "PeerLost"
    assert f"rank {killed} (pid " in seen["exc_message"] and "lost:" in seen["exc_message"]
    assert seen["t"] - fault["t"] < 3.0
    assert survivor.returncode == 0, survivor.stderr[-3000:]
    assert not survivor.leaked  # its DataLoader workers ended with it


def test_hung_rank_is_reported_with_its_own_stack(tmp_path):
    results = _ignite(tmp_path, "hang", 1, HANG="5")
    fault = _fault(results, 1)
    from fault_tolerant_handlers import EXIT_HUNG

    assert results[1].returncode == EXIT_HUNG
    assert "time.sleep(1000)  # the hung line the report must show" in results[1].stderr
    seen = results[0].event("run_raised")
    assert seen["raised"] == "PeerFailedError" and seen["failed_rank"] == 1 and seen["exc_type"] == "RankHung"
    assert "time.sleep(1000)  # the hung line the report must show" in seen["message"]
    assert seen["t"] - fault["t"] < 8.0
    assert results[0].returncode == 0
    assert not results[0].leaked and not results[1].leaked


def test_frozen_rank_is_named_silent_by_its_neighbour(tmp_path):
    results = _ignite(tmp_path, "stop", 1, HANG="3")
    fault = _fault(results, 1)
    seen = results[0].event("run_raised")
    assert seen["raised"] == "PeerFailedError" and seen["failed_rank"] == 1 and seen["exc_type"] == "PeerSilent"
    assert "no heartbeat" in seen["exc_message"]
    assert seen["t"] - fault["t"] < 3 + 2 + 3  # hang_timeout + margin + poll/ring slack
    assert results[0].returncode == 0
    assert results[1].returncode is None  # still SIGSTOPped: its launcher ends it (here: the harness)


@pytest.mark.parametrize("launch", ["ddp", pytest.param("ddp_spawn", marks=pytest.mark.long)])  # suite time: a SIGKILL under mp.spawn also in test_spawn_report.py
def test_sigkilled_peer_in_a_lightning_fit(launch, tmp_path):
    """A real ``Trainer.fit`` with the callback: rank 1 is SIGKILLed mid-epoch (ddp: Lightning's
    subprocess launcher; ddp_spawn: rank 0 hosts the store in a spawned process, and
    torch.multiprocessing's parent SIGTERMs it as soon as it has reaped rank 1)."""
    script = PROGRAMS / "lightning_main.py"
    env = dict(FAULT="kill", FAULT_RANK="1", FAULT_STEP="10", USE_FT="1", OEC="0", LAUNCH=launch, FTH_TEST_TOP="1",
               OWN_OUTPUT="1")
    results = run_ranks(1, "", tmp_path, script=script, env=env, result_ranks=2, deadline=60)
    fault = results[1].event("fault")
    assert fault["exc_type"] == "ProcessLookupError"  # the kill really fired on rank 1
    pid = results[1].event("start")["pid"]
    if launch == "ddp_spawn":
        # the parent's SIGTERM may end rank 0 before its fit raises: its own output names the cause
        output = (tmp_path / "lightning_main-1" / "rank0.out").read_text()
        assert f"rank 1 (pid {pid} on " in output and "lost: killed by SIGKILL" in output, output[-3000:]
    seen = [e for e in results[0].events if e["event"] == "run_raised"]
    if launch == "ddp_spawn" and not seen:
        return
    assert seen, results[0].events
    seen = seen[0]
    assert seen["raised"] == "PeerFailedError" and seen["failed_rank"] == 1, seen
    assert seen["exc_type"] == "PeerLost" and f"rank 1 (pid {pid} " in seen["exc_message"]
    assert seen["t"] - fault["t"] < 3.0
