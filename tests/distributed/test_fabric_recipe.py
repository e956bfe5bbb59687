"""docs/fabric.md's recipe for Lightning Fabric, run as printed on 2 CPU ranks (Fabric's ``ddp``
launcher re-runs the script for rank 1): rank 1 raises in its step while rank 0 waits in DDP's
gradient all_reduce; rank 0 is released and raises ``PeerFailedError`` naming rank 1. The same
recipe with the ``raise`` replaced by a SIGKILL of rank 1: rank 0 names it, killed by SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from launch import ROOT, readme_snippet

DEADLINE_SEC = 90
RAISE = 'raise ValueError("bad sample 17")   # one rank fails...'


def _run(tmp_path, code):
    script = tmp_path / "fabric_train.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("FTH_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_SEC)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        try:  # rank 0 and the rank 1 it started share this session
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)
    elapsed = time.monotonic() - start
    assert elapsed < DEADLINE_SEC, f"the recipe hung:\n{out[-3000:]}"
    return proc.returncode, out


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
