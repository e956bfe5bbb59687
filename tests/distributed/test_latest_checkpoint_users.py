"""``latest_checkpoint`` in scripts shaped like users' (issue 46): 2 ranks under torchrun
(``programs/ckpt_users_main.py``; the folder only rank 0 knows at 4 ranks too).

* Ignite's cifar10 shape with ``recover_in_place``: rank 0 makes a timestamped output folder, the
  other ranks keep the base folder, and all pass theirs. Before, the ranks agreed by a broadcast
  that the live state let one rank skip after a recovery: a deadlock. Now every rank raises the same
  ``ValueError`` naming both folders, at once, and the job ends.
* Before any process group, under torchrun (Lightning's case): different folders raise the same
  way (before, rank 1 silently took rank 0's answer for another folder), and a rank that does not
  call is named within ``FTH_CKPT_AGREE_TIMEOUT_SEC`` (before, rank 0 did not wait, and rank 1 would
  have waited 300 s).
* Ignite's cifar10 pair of ``Checkpoint``s in one folder, relaunched by ``--max-restarts 1``:
  ``latest_checkpoint(trainer)`` resumes from the training checkpoint, not the newer model-only
  best-model file, and the final weights are those of an uninterrupted run.
* ``LightningCLI`` with the default ``ModelCheckpoint`` (folder unknown before ``fit``):
  ``latest_checkpoint(cli.trainer)`` finds the previous run's ``version_0`` checkpoint from the
  relaunch's ``version_1``, and the final weights are those of an uninterrupted run; the same in the
  CLI's ``run=True`` form (``programs/user_lightning_cli_main.py``, shaped like Lightning's
  ``backbone_image_classifier.py``: ``fit`` and ``FaultTolerance`` on the command line, the
  ``before_fit`` hook giving ``ckpt_path``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, kill_workers, run_ranks

SCRIPT = PROGRAMS / "programs" / "ckpt_users_main.py"


def torchrun(mode: str, out: Path, env: dict[str, str], *, restarts: int = 0, deadline: float = 120, world: int = 2,
             script: Path = SCRIPT):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "--max-restarts",
                str(restarts), "--monitor-interval", "0.5"]
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / f"{mode or script.stem}-1"
    try:
        results = run_ranks(1, mode, out, script=script, launcher=launcher, deadline=deadline, result_ranks=world,
                            env={"FTH_INJECT": "", **env})
    finally:
        kill_workers(run_dir, program=script.name)  # torchrun's workers have sessions of their own
    return results, run_dir


def events(run_dir: Path, rank: int, name: str) -> list[dict]:
    path = run_dir / f"rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == name]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 4])
def test_a_folder_only_rank_0_knows_is_named_on_every_rank_in_place(world, tmp_path):
    results, run = torchrun("ignite-folders", tmp_path, {"FTH_INJECT": "raise@rank=1,iteration=7"},
                            deadline=90 if world == 2 else 150, world=world)
    output = results[0].stderr
    asked = {r: events(run, r, "asked") for r in range(world)}
    for rank in range(world):
        assert asked[rank] and all(a.get("raised") == "ValueError" for a in asked[rank]), (rank, asked, output[-4000:])
        message = asked[rank][0]["message"]
        assert "different folders" in message and "run_" in message and repr(str(run / "output")) in message, message
        assert asked[rank][0]["seconds"] < 30, asked[rank]
    assert all(asked[r][0]["message"] == asked[0][0]["message"] for r in range(world))
    assert results[0].returncode not in (None, 0)


@pytest.mark.timeout(120)
def test_before_a_group_different_folders_and_a_rank_that_never_calls(tmp_path):
    results, run = torchrun("store-folders", tmp_path, {"FTH_CKPT_AGREE_TIMEOUT_SEC": "2"}, deadline=60)
    first = {r: events(run, r, "asked")[0] for r in (0, 1)}
    for rank in (0, 1):
        assert first[rank].get("raised") == "ValueError", (first, results[0].stderr[-3000:])
        assert repr(str(run / "stamped")) in first[rank]["message"] and repr(str(run / "base")) in first[rank]["message"]
    alone = events(run, 0, "asked")[1]
    assert alone.get("raised") == "TimeoutError" and "rank 1 did not call latest_checkpoint" in alone["message"], alone
    assert 1.5 < alone["seconds"] < 10, alone
    assert results[0].returncode == 0, results[0].stderr[-3000:]


def check_relaunch(mode: str, tmp_path: Path, inject: str, resumed_key: str, resumed_at: int, name: str,
                   script: Path = SCRIPT):
    ref, ref_dir = torchrun(mode, tmp_path / "ref", {}, deadline=150, script=script)
    assert ref[0].returncode == 0, ref[0].stderr[-4000:]
    results, run = torchrun(mode, tmp_path / "faulted", {"FTH_INJECT": inject}, restarts=1, deadline=200,
                            script=script)
    assert results[0].returncode == 0, results[0].stderr[-5000:]
    for rank in (0, 1):
        asked = [a for a in events(run, rank, "asked") if a["attempt"] == 1]
        assert len(asked) == 1 and Path(asked[0]["path"]).name == name, (rank, asked)
        resumed = [e for e in events(run, rank, "resumed") if e["attempt"] == 1]
        assert resumed and resumed[0][resumed_key] == resumed_at, (rank, resumed)
    final, expected = torch.load(run / "weights.pt"), torch.load(ref_dir / "weights.pt")
    assert expected and all(torch.equal(final[k], expected[k]) for k in expected), (final, expected)
    return run


@pytest.mark.timeout(450)
def test_ignite_relaunch_resumes_from_the_training_checkpoint_not_the_best_model(tmp_path):
    # iteration 10 ends epoch 1: training_checkpoint_10.pt, then the evaluator's best_model_1_*.pt (newer)
    run = check_relaunch("ignite-best", tmp_path, "raise@rank=1,iteration=12", "iteration", 10,
                         "training_checkpoint_10.pt")
    files = [e for e in events(run, 0, "files") if e["attempt"] == 1][0]["names"]
    assert any(n.startswith("best_model_1_test_accuracy=") for n in files), files


@pytest.mark.timeout(600)
@pytest.mark.long  # three Lightning starts: 40-110 s here
@pytest.mark.parametrize("mode", ["lightning-cli", "lightning-default"])
def test_lightning_default_folder_relaunch_resumes_exactly(mode, tmp_path):
    """``LightningCLI`` needs jsonargparse (not a dependency of ``lightning``): without it, only the
    same ``Trainer`` made directly runs."""
    if mode == "lightning-cli" and importlib.util.find_spec("jsonargparse") is None:
        pytest.skip("LightningCLI needs jsonargparse[signatures], which is not installed")
    # 10 steps an epoch; the default ModelCheckpoint saves at epoch ends in lightning_logs/version_0
    run = check_relaunch(mode, tmp_path, "raise@rank=1,iteration=15", "global_step", 10,
                         "epoch=0-step=10.ckpt")
    asked = [a for a in events(run, 0, "asked") if a["attempt"] == 1][0]
    assert "/lightning_logs/version_0/checkpoints/" in asked["path"], asked
    assert (run / "lightning_logs" / "version_1").is_dir()


@pytest.mark.timeout(600)
@pytest.mark.long  # three Lightning starts
def test_lightning_cli_run_form_relaunch_resumes_exactly(tmp_path):
    """``LightningCLI(LitClassifier, MyDataModule)`` running ``fit`` from the command line, ``FaultTolerance``
    given as ``--trainer.callbacks+=...``, ``ckpt_path`` from ``latest_checkpoint(self.trainer)`` in the
    CLI's ``before_fit``: rank 1 raises at step 15 (epoch 1); the relaunch (logger ``version_1``)
    resumes from ``version_0``'s ``epoch=0-step=10.ckpt`` and ends with an uninterrupted run's weights."""
    if importlib.util.find_spec("jsonargparse") is None:
        pytest.skip("LightningCLI needs jsonargparse[signatures], which is not installed")
    script = PROGRAMS / "programs" / "user_lightning_cli_main.py"
    run = check_relaunch("", tmp_path, "raise@rank=1,iteration=15", "global_step", 10, "epoch=0-step=10.ckpt",
                         script=script)
    asked = [a for a in events(run, 0, "asked") if a["attempt"] == 1][0]
    assert "/lightning_logs/version_0/checkpoints/" in asked["path"], asked
    assert (run / "lightning_logs" / "version_1" / "config.yaml").is_file()
