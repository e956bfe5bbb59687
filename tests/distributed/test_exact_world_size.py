"""A resume is exact at 4 and 8 ranks too (``resume_main.py``, ``DDPBucketLayout``).

Stock DDP reduces a new model's first iteration in its initial buckets and later ones in the buckets
it rebuilds after the first backward; from 3 ranks on gloo's ring then adds each gradient element in
another order, and a resumed run differs from the uninterrupted one in the last bits (at 2 ranks it
does not: ``test_resume_distributed.py``). With the bucket layout in the checkpoint (Ignite:
``DDPBucketLayout`` in ``to_save``; Lightning: the ``FaultTolerance`` callback's state), the new DDP
reduces its first iteration in the uninterrupted run's buckets.

Each case: an uninterrupted run; the same run with rank 1 raising at iteration 8 (a checkpoint every
5; ``Linear(8, 32), Tanh, Linear(32, 1)``, one epoch: 25 iterations at 4 ranks, 13 at 8), recovered by
a relaunch (``torchrun --max-restarts 1``) or in place (``recover_in_place``), or rank 1 SIGKILLed
there and replaced in place; its second attempt must resume from iteration 5 (in place: from the live
state of iteration 7, the last completed, whose bucket layout is the live DDP's; a replaced rank is
sent rank 0's), train exactly the uninterrupted run's batches and end with its
weights (``torch.equal``); killed and replaced, with no ``DDPBucketLayout`` line (Ignite's adapter saves the
layout itself, the DDP found from the step's closure). The property the layout gives is checked too: a relaunch
from the same kind of checkpoint (iteration 5) that gives the DDP no layout (``BUCKETS=0`` loading a checkpoint
written with the explicit line, as an earlier version's) ends with other weights.

Default suite: Ignite at 4 ranks, relaunched (and the stock relaunch that differs), in place, and
killed and replaced. ``long``: Lightning at 4 ranks, and both frameworks at 8.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, kill_workers, run_ranks

SCRIPT = PROGRAMS / "resume_main.py"
ENV = {"PG_TIMEOUT_SEC": "30", "EPOCHS": "1", "EVERY": "5", "WORKERS": "0", "HIDDEN": "32", "KEEP": "10",
       "FTH_INJECT": ""}
FAULT = "raise@rank=1,iteration=8"
_reference: dict[tuple[str, int], Path] = {}


def torchrun(framework: str, nproc: int, out: Path, env: dict[str, str], max_restarts: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "--max-restarts",
                str(max_restarts), "--monitor-interval", "0.5"]
    run_dir = out / f"{framework}-1"
    try:
        results = run_ranks(1, framework, out, script=SCRIPT, launcher=launcher, deadline=60 + 30 * nproc,
                            env={**ENV, **env})
    finally:
        kill_workers(run_dir)  # torchrun's workers have sessions of their own
    assert results[0].returncode == 0, f"torchrun exited {results[0].returncode}:\n{results[0].stderr[-4000:]}"
    return run_dir


def reference(framework: str, nproc: int, tmp_path_factory) -> Path:
    if (framework, nproc) not in _reference:
        _reference[framework, nproc] = torchrun(framework, nproc, tmp_path_factory.mktemp(f"ref-{framework}-{nproc}"), {})
    return _reference[framework, nproc]


def attempts(run_dir: Path, rank: int) -> dict[int, dict]:
    return {int(p.name[7:p.name.index("_")]): json.loads(p.read_text()) for p in run_dir.glob(f"attempt*_rank{rank}.json")}


def trained(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"batches{rank}.jsonl").read_text().splitlines()]


def same_weights(a: Path, b: Path) -> bool:
    x, y = torch.load(a / "weights.pt"), torch.load(b / "weights.pt")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def assert_resumed_exactly(run: Path, ref: Path, nproc: int, start: int = 5) -> None:
    for rank in range(nproc):
        tries = attempts(run, rank)
        assert set(tries) == {0, 1} and tries[1]["done"], f"rank {rank}: attempts {sorted(tries)}"
        assert tries[1]["start_iteration"] == start and tries[1]["first_step"] == start + 1, tries[1]
        got = [(e["step"], e["idx"]) for e in trained(run, rank) if e["attempt"] == 1]
        assert got == [(e["step"], e["idx"]) for e in trained(ref, rank)[start:]], f"rank {rank}: other batches"
    assert same_weights(run, ref), "the resumed run's weights differ from the uninterrupted run's"


def _step(path: Path) -> int:
    found = re.search(r"(?:checkpoint_|step=)(\d+)", path.name)
    return int(found.group(1)) if found else -1


CASES = [
    pytest.param("ignite", 4, "relaunch", id="ignite-4-relaunch"),
    pytest.param("ignite", 4, "inplace", id="ignite-4-inplace"),
    pytest.param("lightning", 4, "relaunch", id="lightning-4-relaunch", marks=pytest.mark.long),
    pytest.param("lightning", 4, "inplace", id="lightning-4-inplace", marks=pytest.mark.long),
    pytest.param("ignite", 8, "relaunch", id="ignite-8-relaunch", marks=pytest.mark.long),
    pytest.param("lightning", 8, "relaunch", id="lightning-8-relaunch", marks=pytest.mark.long),
    pytest.param("ignite", 8, "inplace", id="ignite-8-inplace", marks=pytest.mark.long),
    pytest.param("ignite", 4, "killed", id="ignite-4-killed"),
    pytest.param("lightning", 4, "killed", id="lightning-4-killed", marks=pytest.mark.long),
    pytest.param("ignite", 8, "killed", id="ignite-8-killed", marks=pytest.mark.long),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework, nproc, how", CASES)
def test_a_resume_is_bit_identical_at_any_world_size(framework, nproc, how, tmp_path, tmp_path_factory):
    ref = reference(framework, nproc, tmp_path_factory)
    if how == "relaunch":
        run = torchrun(framework, nproc, tmp_path / "faulted", {"FTH_INJECT": FAULT}, max_restarts=1)
    elif how == "inplace":
        run = torchrun(framework, nproc, tmp_path / "faulted", {"FTH_INJECT": FAULT, "INPLACE": "2"})
        assert attempts(run, 0)[0]["pid"] == attempts(run, 0)[1]["pid"], "not recovered in the same process"
    else:  # SIGKILLed: its keeper's new process is sent rank 0's live state
        # Ignite with no DDPBucketLayout line: the adapter saves the layout itself (the DDP named by the step)
        run = torchrun(framework, nproc, tmp_path / "faulted", {"FTH_INJECT": FAULT.replace("raise", "kill"),
                                                                "INPLACE": "2", "BUCKETS": "0"})
        for rank in range(nproc):
            pids = {t["pid"] for t in attempts(run, rank).values()}
            assert (len(pids) == 1) == (rank != 1), f"rank {rank}: pids of its attempts {pids}"
        resumed = {r: Path(attempts(run, r)[1]["resumed_from"]).name for r in range(nproc)}
        # Rank 1 dies as iteration 8 starts, its part of iteration 7's all-reduce done: bytes it wrote and
        # the kernel had not sent yet go with it (its socket resets), so a survivor may not complete 7
        # either. Every rank then carries on from 6, the newest iteration every survivor completed (7
        # trained again); never from the checkpoint of 5, and never two ranks from different iterations.
        assert set(resumed.values()) in ({"live-state-step=7.pt"}, {"live-state-step=6.pt"}), f"resumed from {resumed}"
        start = 7 if set(resumed.values()) == {"live-state-step=7.pt"} else 6
    assert_resumed_exactly(run, ref, nproc, start=5 if how == "relaunch" else 7 if how == "inplace" else start)
    if how != "relaunch":
        return
    # Without the layout, a relaunch from the same checkpoint (the uninterrupted run's) ends elsewhere.
    older = next(p for p in (ref / "ckpt").iterdir() if _step(p) == 5)
    stock = tmp_path / "stock"
    (stock / f"{framework}-1" / "ckpt").mkdir(parents=True)
    shutil.copy(older, stock / f"{framework}-1" / "ckpt" / older.name)
    stock_run = torchrun(framework, nproc, stock, {"BUCKETS": "0"})
    assert attempts(stock_run, 0)[0]["start_iteration"] == _step(older)
    assert not same_weights(stock_run, ref), (
        f"a relaunch without the bucket layout from {older.name} ended with the uninterrupted run's weights: "
        "this test no longer shows what DDPBucketLayout is for")


# -- a script written from Ignite's quick start: no DDPBucketLayout line ------------------------------------
QUICKSTART = PROGRAMS / "programs" / "ignite_quickstart_main.py"
_quickstart_reference: dict[tuple[int, str], Path] = {}


def quickstart(nproc: int, out: Path, env: dict[str, str], max_restarts: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "--max-restarts",
                str(max_restarts), "--monitor-interval", "0.5"]
    run_dir = out / f"{QUICKSTART.stem}-1"
    try:
        results = run_ranks(1, "", out, script=QUICKSTART, launcher=launcher, deadline=60 + 30 * nproc,
                            env={"FTH_INJECT": "", **env})
    finally:
        kill_workers(run_dir, program=QUICKSTART.name)
    assert results[0].returncode == 0, f"torchrun exited {results[0].returncode}:\n{results[0].stderr[-4000:]}"
    return run_dir


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc, how, module", [
    pytest.param(4, "relaunch", "0", id="4-relaunch", marks=pytest.mark.long),
    pytest.param(4, "inplace", "0", id="4-inplace"),
    pytest.param(4, "relaunch", "1", id="4-relaunch-module", marks=pytest.mark.long),
    pytest.param(8, "relaunch", "0", id="8-relaunch", marks=pytest.mark.long),
    pytest.param(8, "inplace", "0", id="8-inplace", marks=pytest.mark.long),
])
def test_the_ignite_quick_start_resumes_bit_identically_with_no_layout_line(nproc, how, module, tmp_path,
                                                                             tmp_path_factory):
    """``ignite_quickstart_main.py`` (``idist.auto_model``, ``create_supervised_trainer``, ``to_save`` with
    the DDP, or with ``MODULE=1`` the model it wraps; no ``DDPBucketLayout``): rank 1 raises at iteration 8,
    relaunched by torchrun (from the checkpoint of iteration 5) or recovered in place (from the live state of
    iteration 7); the weights equal the uninterrupted run's. Its checkpoints hold the DDP's layout."""
    env = {"MODULE": module}
    if (nproc, module) not in _quickstart_reference:
        _quickstart_reference[nproc, module] = quickstart(nproc, tmp_path_factory.mktemp(f"quick-{nproc}"), env)
    ref = _quickstart_reference[nproc, module]
    fault = {**env, "FTH_INJECT": FAULT}
    if how == "relaunch":
        run = quickstart(nproc, tmp_path, fault, max_restarts=1)
    else:
        run = quickstart(nproc, tmp_path, {**fault, "INPLACE": "2"})
    for rank in range(nproc):
        tries = attempts(run, rank)
        assert set(tries) == {0, 1}, f"rank {rank}: attempts {sorted(tries)}"
        assert tries[1]["start_iteration"] == (5 if how == "relaunch" else 7), tries[1]
        assert tries[0]["ddp"] == "DistributedDataParallel"
        assert (tries[0]["pid"] == tries[1]["pid"]) == (how == "inplace")
    assert same_weights(run, ref), "the resumed run's weights differ from the uninterrupted run's"
    saved = torch.load(next((ref / "ckpt").glob("checkpoint_*.pt")), weights_only=True)
    assert saved["fault_tolerance_ddp_buckets"]["buckets"], sorted(saved)
