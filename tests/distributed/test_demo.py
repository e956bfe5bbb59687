"""``make demo`` keeps telling the truth: every rank stops with the real cause, a killed DataLoader
worker is survived with the same batches, and a SIGKILLed rank is recovered in place at the failed
step with the uninterrupted run's weights."""

import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT


# The demo bounds its torchrun itself (TORCHRUN_DEADLINE_SEC, 240 s, for a loaded machine); about
# 40 s on 2 quiet cores.
@pytest.mark.timeout(330)
def test_demo_shows_every_rank_stopping_with_the_cause():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--no-stock"],
        capture_output=True, text=True, timeout=300, start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "rank 0: OSError: mirror unreachable" in out
    assert "rank 1: PeerFailedError: rank 0 failed in 'download MNIST': OSError: mirror unreachable" in out
    assert "reading the dataset (must not happen)" not in out + proc.stderr
    assert "rank 0: PeerFailedError: rank 1 failed in 'train step' (epoch 0, iteration 3): ValueError: bad sample 17" in out
    assert "rank 1: ValueError: bad sample 17" in out
    # scene 4: the worker's kill survived, the epoch's batches as without it
    assert "the epoch: finished normally, 16 of 16 batches, sum 2016 (without the kill: 2016); worker restarts: 1" in out
    assert "the same batches in the same order as without the kill: yes" in out
    # scene 6: recovered in place from the live state of the last completed iteration, exact
    assert "torchrun exited 0 after" in out, out[-3000:]
    assert "rank 0 carried on in its process from live-state-step=13.pt at iteration 13: nothing trained twice" in out
    assert "rank 1 (a new process, forked by its keeper) from live-state-step=13.pt at iteration 13" in out
    assert "final weights: equal to the uninterrupted run's, bit for bit" in out
    assert "Scene 3" not in out and "Scene 5" not in out and "Scene 7" not in out  # --no-stock
