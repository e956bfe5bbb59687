"""The README's Lightning snippet, run as written: 2 CPU ranks with ``strategy="ddp"``, rank 1 raises
in ``training_step``; rank 0's ``trainer.fit`` raises ``PeerFailedError`` naming it, and the whole
job ends in seconds (the process-group timeout is Lightning's default, 30 minutes)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SNIPPET = '''\
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fault_tolerant_handlers import PeerFailedError
from fault_tolerant_handlers.lightning import FaultTolerance


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == 3:
            raise ValueError("bad sample 17")            # one rank fails...
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                        enable_progress_bar=False, callbacks=[FaultTolerance()])
    try:
        trainer.fit(Model(), data)
    except PeerFailedError as err:                          # ...every other rank learns why
        print(f"rank {trainer.global_rank} stopped: rank {err.failed_rank} raised "
              f"{err.exc_type}: {err.exc_message} at step {err.step}, epoch {err.epoch}")
        raise
'''

DEADLINE_SEC = 90


def test_readme_snippet_fails_together(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SNIPPET)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
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
    assert elapsed < DEADLINE_SEC, f"the snippet hung:\n{out[-3000:]}"
    assert "rank 0 stopped: rank 1 raised ValueError: bad sample 17 at step 3, epoch 0" in out, out[-4000:]
    assert re.search(r"^(\[rank1\]: )?ValueError: bad sample 17$", out, re.M), out[-4000:]  # rank 1: its own error
    assert proc.returncode != 0


def test_readme_has_the_tested_snippet():
    readme = (ROOT / "README.md").read_text()
    if "## Lightning" not in readme or "<!-- lightning-section -->" in readme:
        pytest.skip("README.md's Lightning section is not filled in yet")
    assert SNIPPET.strip() in readme, "the README's Lightning snippet differs from the one tested here"
