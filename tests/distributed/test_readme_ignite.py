"""The README's Ignite quick start runs as printed: its code block is extracted and run on 2 ranks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from launch import ROOT, readme_snippet as _snippet


@pytest.mark.timeout(90)
def test_readme_ignite_snippet_fails_every_rank_with_the_cause(tmp_path):
    script = tmp_path / "quickstart_ignite.py"
    script.write_text(_snippet("ignite"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80,
                          start_new_session=True, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0  # the job failed, as it should
    assert "[rank 1 step 2] failed: ValueError: bad sample 42" in out
    assert "[rank 0 step 2] stopping: rank 1 failed in 'train' (epoch 1, iteration 2): ValueError: bad sample 42" in out


@pytest.mark.timeout(90)
def test_ignite_example_script(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "ignite_ddp.py"), "--fault", "rank0_handler"],
                          capture_output=True, text=True, timeout=80, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert re.search(r"\[rank 0\] trainer.run raised after [\d.]+ s: PermissionError: cannot write logs/epoch.json", out)
    assert re.search(r"\[rank 1\] trainer.run raised after [\d.]+ s: PeerFailedError: rank 0 failed in 'train' "
                     r"\(epoch 1, iteration \d+\): PermissionError: cannot write logs/epoch.json", out), out[-3000:]
