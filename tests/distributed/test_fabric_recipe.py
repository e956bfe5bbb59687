"""docs/fabric.md's recipe for Lightning Fabric, run as printed on 2 CPU ranks (Fabric's ``ddp``
launcher re-runs the script for rank 1): rank 1 raises in its step while rank 0 waits in DDP's
gradient all_reduce; rank 0 is released and raises ``PeerFailedError`` naming rank 1. The same
recipe with the ``raise`` replaced by a SIGKILL of rank 1: rank 0 names it, killed by SIGKILL."""

from __future__ import annotations

import re

import pytest

from launch import readme_snippet, run_script

DEADLINE_SEC = 90
RAISE = 'raise ValueError("bad sample 17")   # one rank fails...'


def _run(tmp_path, code):
    script = tmp_path / "fabric_train.py"
    script.write_text(code)
    returncode, out, elapsed = run_script(script, deadline=DEADLINE_SEC, drop_fth=True)
    assert elapsed < DEADLINE_SEC, f"the recipe hung:\n{out[-3000:]}"
    return returncode, out


def test_fabric_recipe_fails_together(tmp_path):
    pytest.importorskip("lightning.fabric")
    returncode, out = _run(tmp_path, readme_snippet("fabric", page="docs/fabric.md"))
    assert returncode != 0
    assert "[rank 1] failed in 'train': ValueError: bad sample 17" in out, out[-4000:]
    assert "[rank 0] stopping: rank 1 failed in 'train' (epoch 0): ValueError: bad sample 17" in out, out[-4000:]
    assert "rank 0 stopped: rank 1 raised ValueError: bad sample 17 in 'train' (epoch 0)" in out, out[-4000:]
    assert re.search(r"^(\[rank1\]: )?ValueError: bad sample 17$", out, re.M), out[-4000:]  # rank 1: its own error


@pytest.mark.long  # suite time: a killed peer is covered for each adapter in make test
def test_fabric_recipe_names_a_killed_rank(tmp_path):
    pytest.importorskip("lightning.fabric")
    code = readme_snippet("fabric", page="docs/fabric.md")
    assert RAISE in code
    code = "import os, signal\n" + code.replace(RAISE, "os.kill(os.getpid(), signal.SIGKILL)")
    returncode, out = _run(tmp_path, code)
    assert returncode != 0
    assert re.search(r"rank 0 stopped: rank 1 raised PeerLost: rank 1 \(pid \d+ on \S+\) lost: killed by SIGKILL", out), \
        out[-4000:]
