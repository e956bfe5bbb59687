"""``make demo`` keeps telling the truth: every rank stops with the real cause."""

import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT



@pytest.mark.timeout(90)
def test_demo_shows_every_rank_stopping_with_the_cause():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--no-stock"],
        capture_output=True, text=True, timeout=80, start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "rank 0: OSError: mirror unreachable" in out
    assert "rank 1: PeerFailedError: rank 0 failed in 'download MNIST': OSError: mirror unreachable" in out
    assert "reading the dataset (must not happen)" not in out + proc.stderr
    assert "rank 0: PeerFailedError: rank 1 failed in 'train step' (epoch 0, iteration 3): ValueError: bad sample 17" in out
    assert "rank 1: ValueError: bad sample 17" in out
