"""Exact resume under ``torchrun --max-restarts 2``: 2 ranks, Ignite and Lightning (``resume_main.py``).

Rank 1 fails mid-epoch (iteration 37 of 150, checkpoints every 10) in the first attempt only
(``FTH_INJECT``'s default ``attempt=0``), or rank 0 is SIGKILLed while writing the checkpoint of
iteration 40 (``torn-save``: half a file under its final name, and a temporary file). The job must exit 0; the second attempt must have started
on both ranks from the newest checkpoint (iteration 30), trained exactly the batches of an
uninterrupted run from iteration 31 on, and rank 0's final weights must be ``torch.equal`` to that
run's. A DataLoader worker killed mid-epoch must need no restart at all.

Default: one case per framework (a kill during a checkpoint write; a SIGKILL), and Lightning relaunched
from the checkpoint of an epoch's last batch (``long``: a user's shape, at 2 and 4 ranks). ``FTH_RESUME_FULL=1`` (``make test-resume``) runs every framework x fault.
torchrun runs in its own session, killed by pid (``launch.run_ranks``); process groups time out
after 20 s.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, kill_workers, run_ranks

SCRIPT = PROGRAMS / "resume_main.py"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
            "--monitor-interval", "0.5"]
FAULTS = {
    "raise": "raise@rank=1,iteration=37",
    "kill": "kill@rank=1,iteration=37",
    "hang": "hang@rank=1,iteration=37",
    "worker-kill": "worker-kill@rank=1,iteration=37",
}
DEFAULT = [("ignite", "torn-save"), ("lightning", "kill")]
FULL = [(f, k) for f in ("ignite", "lightning") for k in FAULTS] + [("ignite", "torn-save")]
CASES = FULL if os.environ.get("FTH_RESUME_FULL") == "1" else DEFAULT
_reference: dict[str, Path] = {}


def torchrun(framework: str, out: Path, env: dict[str, str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / f"{framework}-1"
    try:
        results = run_ranks(1, framework, out, script=SCRIPT, launcher=TORCHRUN, deadline=150,
                            env={"PG_TIMEOUT_SEC": "20", "FTH_INJECT": "", **env})
    finally:
        kill_workers(run_dir)  # torchrun's workers have sessions of their own
    assert results[0].returncode == 0, f"torchrun exited {results[0].returncode}:\n{results[0].stderr[-4000:]}"
    return run_dir


def reference(framework: str, tmp_path_factory) -> Path:
    if framework not in _reference:
        _reference[framework] = torchrun(framework, tmp_path_factory.mktemp(f"ref-{framework}"), {})
    return _reference[framework]


def attempts(run_dir: Path, rank: int) -> dict[int, dict]:
    return {int(p.name[7:p.name.index("_")]): json.loads(p.read_text()) for p in run_dir.glob(f"attempt*_rank{rank}.json")}


def strip(entries: list[dict]) -> list[tuple]:
    return [(e["attempt"], e["step"], e["idx"]) for e in entries]


def trained(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"batches{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("framework, fault", CASES)
def test_restarted_attempt_resumes_exactly(framework, fault, tmp_path, tmp_path_factory):
    ref = reference(framework, tmp_path_factory)
    env = {"FTH_INJECT": FAULTS[fault]} if fault in FAULTS else {"TORN_SAVE": "40"}
    if fault == "hang":
        env["FTH_HANG_TIMEOUT_SEC"] = "4"
    run = torchrun(framework, tmp_path / "faulted", env)
    if fault == "torn-save":  # rank 0 killed while writing checkpoint_40: both earlier ones are still there
        names = attempts(run, 0)[1]["ckpt_files"]  # what the second attempt found
        assert {"checkpoint_20.pt", "checkpoint_30.pt", "checkpoint_40.pt"} <= set(names), names
        assert any(n.startswith("tmp") for n in names), names
        stderr = (run / "rank0.stderr").read_text()  # torchrun's output: every attempt of every rank
        assert "skipping checkpoint_40.pt: does not load" in stderr and "a temporary file" in stderr

    for rank in (0, 1):
        got, want = trained(run, rank), trained(ref, rank)
        tries = attempts(run, rank)
        if fault == "worker-kill":  # no restart: the loader replaced its worker
            assert set(tries) == {0} and tries[0]["done"], tries
            assert tries[0]["worker_restarts"] == (1 if rank == 1 else 0), tries
            assert strip(got) == strip(want)
            continue
        assert set(tries) == {0, 1}, f"rank {rank}: attempts {sorted(tries)} (expected exactly one restart)"
        assert "done" not in tries[0] and tries[1]["done"]
        first = tries[1]
        # the newest checkpoint before the fault, on both ranks: iteration 30
        assert first["start_iteration"] == 30 and first["first_step"] == 31, first
        name = Path(first["resumed_from"]).name
        assert name in (("checkpoint_30.pt",) if framework == "ignite" else ("last.ckpt", "epoch=0-step=30.ckpt")), name
        assert first["resumed_from"] == attempts(run, 1 - rank)[1]["resumed_from"]
        # attempt 0 got to the fault; attempt 1 trained exactly the rest of the uninterrupted run
        steps0 = [e["step"] for e in got if e["attempt"] == 0]
        assert steps0 == list(range(1, len(steps0) + 1)) and steps0[-1] >= 36
        rest = [e for e in got if e["attempt"] == 1]
        assert [(e["step"], e["idx"]) for e in rest] == [(e["step"], e["idx"]) for e in want[30:]]
    # every complete checkpoint: the loader's snapshot matches the iteration saved beside it
    checked = 0
    for path in sorted((run / "ckpt").glob("*.*")):
        if fault == "torn-save" and path.name == "checkpoint_40.pt":
            continue
        ckpt = torch.load(path, map_location="cpu", weights_only=framework == "ignite")
        if framework == "ignite":
            step, loader = ckpt["trainer"]["iteration"], ckpt["loader"]
        else:
            step, loader = ckpt["global_step"], ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
        assert (loader["epoch"], loader["batches_yielded"]) == ((step - 1) // 50, (step - 1) % 50 + 1), (path.name, loader)
        assert loader["epoch_finished"] == (step % 50 == 0)
        checked += 1
    assert checked >= 2
    final, expected = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    for key in expected:
        assert torch.equal(final[key], expected[key]), f"{framework}/{fault}: {key} differs from the uninterrupted run"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("shape, nproc", [
    pytest.param("every-10", 2, id="step-checkpoint-2-ranks"),
    pytest.param("user", 2, id="user-shape-2-ranks", marks=pytest.mark.long),
    pytest.param("user", 4, id="user-shape-4-ranks", marks=pytest.mark.long),
])
def test_lightning_relaunched_from_an_epochs_last_batch_resumes_exactly(shape, nproc, tmp_path):
    """Rank 1 fails in the second epoch; the relaunch resumes from the checkpoint of the first epoch's
    last batch, through ``FaultTolerance``: ``every-10``, a ``ModelCheckpoint(every_n_train_steps=10)``
    (saved in ``on_train_batch_end``, Lightning's counters one short: the epoch was counted done inside
    the next one, drawn in epoch 0's order); ``user``, resume_main's ``USER_SHAPE`` with a plain
    ``DataLoader`` (validation, StepLR, ``last.ckpt`` saved at the epoch's end, whose next epoch
    Lightning drew in epoch 0's order: a DataLoader with workers draws its indices when its iterator is
    made, before the sampler's ``set_epoch``). The rest, the weights and the loop counters are the
    uninterrupted run's."""
    env = {"EPOCHS": "2", "PG_TIMEOUT_SEC": "20"}
    if shape == "user":
        env.update(USER_SHAPE="1", LOADER="plain")
    launcher = TORCHRUN[:TORCHRUN.index("--nproc-per-node") + 1] + [str(nproc)] + TORCHRUN[TORCHRUN.index("--nproc-per-node") + 2:]
    last = 400 // (4 * nproc)  # the first epoch's last step

    def launch(out: Path, extra: dict[str, str]) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        try:
            results = run_ranks(1, "lightning", out, script=SCRIPT, launcher=launcher, deadline=200,
                                env={"FTH_INJECT": "", **env, **extra})
        finally:
            kill_workers(out / "lightning-1")
        assert results[0].returncode == 0, f"torchrun exited {results[0].returncode}:\n{results[0].stderr[-4000:]}"
        return out / "lightning-1"

    ref = launch(tmp_path / "ref", {})
    run = launch(tmp_path / "faulted", {"FTH_INJECT": f"raise@rank=1,iteration={last + 3}"})
    for rank in range(nproc):
        tries = attempts(run, rank)
        assert set(tries) == {0, 1} and tries[1]["done"], tries
        assert tries[1]["start_iteration"] == last, tries[1]
        rest = [(e["step"], e["idx"]) for e in trained(run, rank) if e["attempt"] == 1]
        assert rest == [(e["step"], e["idx"]) for e in trained(ref, rank)[last:]], f"rank {rank}"
    final, expected = torch.load(run / "weights.pt"), torch.load(ref / "weights.pt")
    for key in expected:
        assert torch.equal(final[key], expected[key]), f"{shape}: {key} differs from the uninterrupted run"
    progress = {}
    for name, folder in (("run", run), ("ref", ref)):
        fit = torch.load(folder / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)["loops"]["fit_loop"]
        progress[name] = {key: fit[key] for key in ("epoch_progress", "epoch_loop.batch_progress")}
    assert progress["run"] == progress["ref"]


@pytest.mark.long  # suite time: a torchrun relaunch; the check itself is unit-tested in test_dataloader_resume.py
@pytest.mark.timeout(420)
def test_an_evaluator_over_the_training_loader_resumes_silently_and_exactly(tmp_path):
    """Ignite's cifar10 example shape (``EVAL_TRAIN=1``: an evaluator runs over the training loader
    at each epoch's end, so the loader counts two passes an epoch). Rank 1 raises at iteration 87
    (epoch 2); the relaunch resumes from checkpoint_80 with the loader restored: no resume warning
    (before: "the loader's next iter() starts at batch 30 of its epoch 3: was it left out of ..."),
    and every rank trains the batches of an uninterrupted run."""
    from torch.utils.data import DistributedSampler

    out = tmp_path / "faulted"
    out.mkdir()
    run_dir = out / "ignite-1"
    try:
        results = run_ranks(1, "ignite", out, script=SCRIPT, launcher=TORCHRUN, deadline=200,
                            env={"PG_TIMEOUT_SEC": "20", "FTH_INJECT": "raise@rank=1,iteration=87", "EVAL_TRAIN": "1"})
    finally:
        kill_workers(run_dir)
    output = results[0].stderr
    assert results[0].returncode == 0, output[-4000:]
    assert "left out of Checkpoint.load_objects" not in output and "the engine resumes at" not in output, output[-4000:]
    for rank in (0, 1):
        assert attempts(run_dir, rank)[1]["start_iteration"] == 80, attempts(run_dir, rank)
        sampler = DistributedSampler(range(400), num_replicas=2, rank=rank, shuffle=True, seed=0)
        expected = {}
        for epoch in range(3):
            sampler.set_epoch(epoch)
            ids = list(sampler)
            for j in range(50):
                expected[epoch * 50 + j + 1] = ids[j * 4:(j + 1) * 4]
        kept = {e["step"]: e["idx"] for e in trained(run_dir, rank) if e["attempt"] == 1 or e["step"] <= 80}
        assert kept == expected, rank
