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


def test_ctrl_c_to_torchrun_ends_every_rank_with_one_short_report(tmp_path):
    """SIGINT to torchrun's process group (Ctrl-C in its terminal) while rank 1 is stuck in a step
    and rank 0 waits for it in the gradient all_reduce: the agent forwards SIGINT to both ranks;
    each says it was signalled, once, and ends; no thread dumps a traceback."""
    import json
    import os
    import subprocess
    import sys
    import time

    from launch import free_port

    out = tmp_path / "ctrl-c"
    out.mkdir()
    env = dict(os.environ, FAULT="hang", LINGER="0", FTH_TEST_PG_TIMEOUT="20", PYTHONUNBUFFERED="1")
    log = open(out / "torchrun.out", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                             f"--master-port={free_port()}", str(SCRIPT), str(out)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out / "rank1.jsonl").exists() or \
                "fault" not in (out / "rank1.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "the training did not reach the hang"
            time.sleep(0.2)
        time.sleep(1.0)  # rank 0 is in the all_reduce, rank 1 in its sleep
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for rank_file in out.glob("rank*.jsonl"):
            for line in rank_file.read_text().splitlines():
                event = json.loads(line)
                if event.get("pid"):
                    try:
                        os.kill(event["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    log.seek(0)
    text = log.read()
    for rank in (0, 1):
        assert text.count(f"[rank {rank}] rank {rank} (pid ") == 1, text[-4000:]
        assert f"rank {rank} (pid " in text and "received SIGINT" in text
        ended = [json.loads(l) for l in (out / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [e for e in ended if e["event"] == "run_raised"][0]["raised"] == "KeyboardInterrupt", ended
    worker_tracebacks = [l for l in text.splitlines() if l.startswith("[rank") and "Traceback" in l]
    assert worker_tracebacks == [], text[-4000:]
    assert "Exception in thread" not in text and "fth-" not in text, text[-4000:]
