"""docs/fabric.md's recipe for Lightning Fabric, run as printed on 2 CPU ranks (Fabric's ``ddp``
launcher re-runs the script for rank 1): rank 1 raises in its step while rank 0 waits in DDP's
gradient all_reduce; rank 0 is released and raises ``PeerFailedError`` naming rank 1. The same
recipe with the ``raise`` replaced by a SIGKILL of rank 1: rank 0 names it, killed by SIGKILL.

The page's checkpoint recipes (a plain torchrun loop shaped like PyTorch's DDP tutorial, and
Fabric), as printed, under ``torchrun --max-restarts 1`` with ``FTH_INJECT``: the relaunch resumes
from the newest checkpoint and ends with an uninterrupted run's weights, bit for bit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from launch import ROOT, readme_snippet, run_script

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


# -- the checkpoint recipes (docs/fabric.md, "Checkpoints: relaunch and in place") under torchrun ---------

INJECT = "raise@rank=1,iteration=26"  # epoch 1 (from 0), its 10th batch; the newest checkpoint: step 20


def reference_weights() -> dict[str, torch.Tensor]:
    """The recipes' model after an uninterrupted run, computed in this process as DDP computes it at
    2 ranks: each rank's gradient on its own batch, divided by 2 and summed (exact: a sum of two
    terms does not depend on their order), then the SGD step."""
    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(128, 1, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    samplers = [DistributedSampler(range(128), num_replicas=2, rank=r, seed=0) for r in (0, 1)]
    for epoch in range(3):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        ids = [list(sampler) for sampler in samplers]
        for b in range(16):
            grads = []
            for r in (0, 1):
                batch = ids[r][b * 4:(b + 1) * 4]
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, g0, g1 in zip(model.parameters(), *grads):
                p.grad = g0 / 2 + g1 / 2
            optimizer.step()
    return model.state_dict()


def _kill_leftovers(script: Path) -> None:
    """The workers of a torchrun job that ran ``script`` (each in a session of its own), killed by pid:
    only processes whose command line names this test's own script."""
    needle = str(script).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    os.kill(int(entry), signal.SIGKILL)
        except OSError:
            continue


def run_torchrun(tmp_path: Path, code: str, *, env: dict[str, str], deadline: float,
                 max_restarts: int = 1) -> tuple[int | None, str]:
    """``torchrun --standalone --nproc-per-node 2 --max-restarts N train.py`` in ``tmp_path``, bounded;
    every process it started is killed by pid after."""
    script = tmp_path / "train.py"
    script.write_text(code)
    full = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith("FTH_")}
    full.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **env)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.5", str(script)]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)
        _kill_leftovers(script)
    return proc.returncode, out


def _check_relaunch(tmp_path: Path, returncode, out: str, final_key: str = "") -> None:
    assert returncode == 0, out[-5000:]
    assert "FTH_INJECT=raise@rank=1,iteration=26: injecting raise" in out, out[-5000:]
    assert re.search(r"\[rank 0\] stopping: rank 1 failed in 'train' \(epoch 1[,)].*InjectedFault", out), out[-5000:]
    assert "resumed from step_20.pt at step 20" in out, out[-5000:]
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    final = final[final_key] if final_key else final
    expected = reference_weights()
    assert sorted(final) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(final[key], value), (key, final[key], value, out[-3000:])


@pytest.mark.timeout(240)
def test_plain_loop_recipe_relaunches_exactly_after_an_injected_raise(tmp_path):
    """docs/fabric.md's plain torchrun loop as printed (PyTorch's DDP tutorial shape, its peek at
    each epoch's start kept): ``FTH_INJECT`` fires at ``inject.step`` (before: nothing fired, the job
    finished); the relaunch resumes from step_20.pt, the peek does not use up the restored position
    (before: the resumed epoch started at batch 0), and the final weights are an uninterrupted run's,
    bit for bit."""
    code = readme_snippet("plain-checkpoint", page="docs/fabric.md")
    returncode, out = run_torchrun(tmp_path, code, env={"FTH_INJECT": INJECT}, deadline=180)
    _check_relaunch(tmp_path, returncode, out)
    assert out.count("resumed from step_20.pt at step 20") == 2 and "finished at step 48" in out, out[-5000:]


@pytest.mark.long  # suite time: the plain loop's relaunch above is the default suite's
@pytest.mark.timeout(300)
def test_fabric_recipe_relaunches_exactly_after_an_injected_raise(tmp_path):
    """docs/fabric.md's Fabric checkpoint recipe as printed, under torchrun: the same (FTH_INJECT
    fires at inject.step; Fabric's save/load carry the loader's position; bit for bit)."""
    pytest.importorskip("lightning.fabric")
    code = readme_snippet("fabric-checkpoint", page="docs/fabric.md")
    returncode, out = run_torchrun(tmp_path, code, env={"FTH_INJECT": INJECT}, deadline=240)
    _check_relaunch(tmp_path, returncode, out, final_key="model")


@pytest.mark.long  # suite time: the relaunch above is the default suite's
@pytest.mark.timeout(240)
def test_plain_loop_recipe_recovers_in_place_exactly(tmp_path):
    """The same recipe wrapped as the page says, ``recover_in_place(train, max_restarts=1)()``, under
    ``torchrun --max-restarts 0``: both ranks recover in their own processes, carry on from
    step_20.pt (a loop of its own holds no live state: the line says so), and end bit for bit."""
    code = readme_snippet("plain-checkpoint", page="docs/fabric.md")
    code = code.replace("load_checkpoint, start_watchdog)", "load_checkpoint, recover_in_place, start_watchdog)")
    code = code.replace("    train()\n", "    recover_in_place(train, max_restarts=1)()\n")
    assert "recover_in_place(train, max_restarts=1)()" in code and "recover_in_place, start" in code
    returncode, out = run_torchrun(tmp_path, code, env={"FTH_INJECT": INJECT}, deadline=180, max_restarts=0)
    _check_relaunch(tmp_path, returncode, out)
    assert out.count("recovering in place, attempt 1") == 2 and "carries on from the newest checkpoint" in out, \
        out[-5000:]
