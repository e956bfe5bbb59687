"""SIGTERM and SIGINT delivered to one rank (real signals, real Ignite DDP training on 2 gloo ranks):
the other rank raises ``PeerFailedError`` naming the signalled rank and the signal within 1 s, and
the signalled rank still ends as the signal's previous handler says (SIGTERM's default: killed by
it; SIGINT's: ``KeyboardInterrupt``)."""

from __future__ import annotations

import signal

import pytest

from launch import PROGRAMS, run_ranks

SCRIPT = PROGRAMS / "ignite_main.py"
MAX_LATENCY_SEC = 1.0

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("sig", ["sigterm", "sigint"])
def test_signalled_rank_is_named_by_its_peer_within_a_second(tmp_path, sig):
    results = run_ranks(2, "", tmp_path, script=SCRIPT, env=dict(FAULT=sig, LINGER="0"), deadline=60)
    peer, signalled = results
    name = sig.upper()
    fault = signalled.event("fault")
    raised = peer.event("run_raised")
    assert raised["raised"] == "PeerFailedError", peer.stderr[-3000:]
    assert raised["failed_rank"] == 1 and raised["exc_type"] == "RankSignalled", raised
    assert f"rank 1 (pid " in raised["message"] and f"received {name}" in raised["message"], raised["message"]
    latency = raised["t"] - fault["t"]
    assert latency < MAX_LATENCY_SEC, f"{latency:.2f} s"
    if sig == "sigterm":  # the default action still ends it, by the signal
        assert signalled.returncode == -signal.SIGTERM, signalled.stderr[-3000:]
    else:  # Python's handler still raises KeyboardInterrupt in the main thread
        assert signalled.event("run_raised")["raised"] == "KeyboardInterrupt", signalled.stderr[-3000:]
    assert "received " + name in signalled.stderr
