"""A ``LightningCLI`` script with a YAML config (``programs/user_lightning_cli_yaml_main.py`` and
``programs/user_lightning_cli.yaml``: ``FaultTolerance`` and two ``ModelCheckpoint``s in
``trainer.callbacks``, the default folder ``lightning_logs/version_N/checkpoints``, a DataModule's
``RestartableDataLoader`` with a worker), 2 ranks under torchrun, relaunched and recovered in place.

Rank 1 raises at step 11, just after epoch 0's validation: the best-model ``ModelCheckpoint``
(``save_weights_only=True``) has just written ``best-epoch=0-...ckpt``, the newest file of the folder.
Relaunched (``--max-restarts 1``, logger ``version_1``), ``latest_checkpoint(trainer)`` must answer
``version_0``'s checkpoint of step 8 (``last.ckpt``, the same as ``epoch=0-step=8.ckpt``), a full one (before: the weights-only best model, and
``fit`` failed on every rank with ``KeyError: 'Trying to restore optimizer state but checkpoint contains
only the model'``: the job did not recover). In place, rank 1 raises at step 14 and every rank carries on
from live state at step 13, logging on in ``version_0``. Both end with the same weights, bit for bit
(each resumed mid-epoch from a different step: the checkpoint of 8, the live state of 13; compared by
the test that runs second, as the module orders them).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, kill_workers, run_ranks

SCRIPT = PROGRAMS / "programs" / "user_lightning_cli_yaml_main.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jsonargparse") is None,
                                reason="LightningCLI needs jsonargparse[signatures], which is not installed")


def torchrun(mode: str, out: Path, inject: str, restarts: int) -> Path:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                str(restarts), "--monitor-interval", "0.5"]
    run_dir = out / f"{mode}-1"
    try:
        results = run_ranks(1, mode, out, script=SCRIPT, launcher=launcher, deadline=150, result_ranks=2,
                            env={"FTH_INJECT": inject})
    finally:
        kill_workers(run_dir, program=SCRIPT.name)  # torchrun's workers lead sessions of their own
    assert results[0].returncode == 0, results[0].stderr[-5000:]
    return run_dir


def events(run_dir: Path, rank: int, name: str) -> list[dict]:
    lines = (run_dir / f"rank{rank}.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


#: Final weights of each form, once its test ran: the second compares them (module order: relaunch first).
_weights: dict[str, Path] = {}


@pytest.mark.timeout(240)
def test_lightning_cli_yaml_relaunch_resumes_from_a_full_checkpoint_not_the_weights_only_best(tmp_path):
    run = torchrun("relaunch", tmp_path, "raise@rank=1,iteration=11", restarts=1)
    for rank in (0, 1):
        asked = [e["path"] for e in events(run, rank, "asked") if e["attempt"] == 1]
        assert len(asked) == 1 and Path(asked[0]).name in ("last.ckpt", "epoch=0-step=8.ckpt"), asked
        assert Path(asked[0]).parent.parent.name == "version_0", asked
        resumed = [e for e in events(run, rank, "resumed") if e["attempt"] == 1]
        assert [e["global_step"] for e in resumed] == [8], resumed
        assert [e["global_step"] for e in events(run, rank, "done")] == [30]
    assert any(run.glob("lightning_logs/version_0/checkpoints/best-epoch=0-*.ckpt"))  # newer than step 8's
    _weights["relaunch"] = run / "weights.pt"
    compare()


@pytest.mark.timeout(240)
def test_lightning_cli_yaml_in_place_carries_on_in_the_first_version(tmp_path):
    run = torchrun("in-place", tmp_path, "raise@rank=1,iteration=14", restarts=0)
    for rank in (0, 1):
        resumed = [e for e in events(run, rank, "resumed") if e["in_place"] == 1]
        assert [e["global_step"] for e in resumed] == [13], resumed
        assert [e["global_step"] for e in events(run, rank, "done")] == [30]
    assert resumed[0]["log_dir"].endswith("/lightning_logs/version_0"), resumed
    _weights["in-place"] = run / "weights.pt"
    compare()


def compare() -> None:
    """Both forms end with the same weights, bit for bit (resumed from different steps: 8 and 13)."""
    if len(_weights) == 2:
        final, expected = torch.load(_weights["in-place"]), torch.load(_weights["relaunch"])
        assert expected and all(torch.equal(final[k], expected[k]) for k in expected), (final, expected)
