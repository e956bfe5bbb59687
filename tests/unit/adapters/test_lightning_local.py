"""The Lightning callback in one process with a RestartableDataLoader: an injected worker kill is
survived, and the restart count is logged as a metric.

Lightning is imported here, at collection: imported inside the test it took 15-41 s of the test's
120 s on a loaded 2-core machine (the fit itself 3-4 s), time that says nothing of the loader."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from fault_tolerant_handlers import RestartableDataLoader

pl = pytest.importorskip("lightning.pytorch")
from fault_tolerant_handlers.lightning import FaultTolerance  # noqa: E402 - after Lightning's skip


@pytest.mark.timeout(120)
def test_worker_kill_is_survived_and_logged_as_a_metric(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("FTH_INJECT", "worker-kill@rank=0,iteration=3")

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            x, y, i = batch
            self.seen.extend(i.tolist())
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g), torch.arange(64))
    loader = RestartableDataLoader(data, batch_size=4, num_workers=2, max_restarts=2)
    model = Model()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[FaultTolerance()],
                         default_root_dir=tmp_path)
    trainer.fit(model, loader)
    assert loader.restart_count == 1, [r.describe() for r in loader.restarts]  # each restart named, if more
    assert loader.restarts[0].signal == "SIGKILL"
    assert sorted(model.seen) == list(range(64)) and model.seen == list(range(64))  # none lost, none repeated
    assert float(trainer.callback_metrics["dataloader_restarts"]) == 1.0
