"""The Lightning callback in one process with a RestartableDataLoader: an injected worker kill is
survived, and the restart count is logged as a metric.

Lightning is imported here, at collection: imported inside the test it took 15-41 s of the test's
120 s on a loaded 2-core machine (the fit itself 3-4 s), time that says nothing of the loader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from fault_tolerant_handlers import RestartableDataLoader

pl = pytest.importorskip("lightning.pytorch")
from fault_tolerant_handlers.adapters import compat_lightning  # noqa: E402
from fault_tolerant_handlers.lightning import FaultTolerance  # noqa: E402 - after Lightning's skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("made", ["before-fit", "in-train_dataloader"])
def test_worker_kill_is_survived_and_logged_as_a_metric(monkeypatch, tmp_path, made):
    # in-train_dataloader: Lightning's usual pattern, a LightningDataModule making the loader inside
    # fit, where Lightning wraps every DataLoader class's __init__ (functools.wraps); the private-name
    # check read the wrapper's code and refused it ("needs torch's DataLoader.__init__ ...")
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

    class Data(pl.LightningDataModule):
        loader = None

        def train_dataloader(self):
            self.loader = RestartableDataLoader(data, batch_size=4, num_workers=2, max_restarts=2)
            return self.loader

    model, datamodule = Model(), Data()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[FaultTolerance()],
                         default_root_dir=tmp_path)
    if made == "before-fit":
        loader = RestartableDataLoader(data, batch_size=4, num_workers=2, max_restarts=2)
        trainer.fit(model, loader)
    else:
        trainer.fit(model, datamodule=datamodule)
        loader = datamodule.loader
    assert loader.restart_count == 1, [r.describe() for r in loader.restarts]  # each restart named, if more
    assert loader.restarts[0].signal == "SIGKILL"
    assert sorted(model.seen) == list(range(64)) and model.seen == list(range(64))  # none lost, none repeated
    assert float(trainer.callback_metrics["dataloader_restarts"]) == 1.0


def test_live_states_copy_at_a_steps_end_is_no_checkpoint_written(monkeypatch):
    """With ``FTH_SHARD_REPLICAS`` the live state (what ``trainer.save_checkpoint`` would write, which
    runs the callbacks' ``on_save_checkpoint``) is copied at every step's end: no checkpoint is
    written, so ``hang_timeout="auto"`` learns no checkpoint's duration from it (a real write would
    then be judged by a memory copy's deadline). A real save still begins a checkpoint's work."""
    callback = FaultTolerance()
    beats = []
    monkeypatch.setattr(callback.guard, "beat", lambda step=None, work=None, **_: beats.append(work))
    trainer = SimpleNamespace(global_step=3)
    monkeypatch.setattr(compat_lightning, "dump_checkpoint",
                        lambda t: callback.on_save_checkpoint(t, None, {}) or {"loops": {}})
    monkeypatch.setattr(compat_lightning, "loop_state", lambda parts, loops: {})
    callback._live.trainer = trainer
    callback._live.tracker = SimpleNamespace(check=lambda unit: None, step=3, rng_after=lambda step: None,
                                             small={"loops": None, "epoch": 0, "param_groups": []})
    assert callback._live.capture().step == 3
    callback.on_save_checkpoint(trainer, None, {})
    assert beats == ["checkpoint"]


def _fit_loops(batches_completed: int, epochs_processed: int, is_last_batch: bool) -> dict:
    """``checkpoint["loops"]`` of a 16-batch epoch 1 (Lightning 2.6.6's keys), at its 16th batch."""
    def progress(**counts):
        return {"total": dict(counts), "current": dict(counts)}

    return {"fit_loop": {
        "epoch_progress": progress(ready=2, started=2, processed=epochs_processed, completed=1),
        "epoch_loop.batch_progress": {**progress(ready=32, started=32, processed=32, completed=batches_completed),
                                      "is_last_batch": is_last_batch},
        "epoch_loop.state_dict": {"_batches_that_stepped": 31 if batches_completed == 31 else 32},
    }}


def test_a_state_saved_at_an_epochs_last_batch_is_counted_as_at_its_end():
    # on_train_batch_end of the last batch (a step-interval ModelCheckpoint, live state): one short
    loops = _fit_loops(31, 1, True)
    assert compat_lightning.finish_epoch(loops)
    # what ModelCheckpoint saves in on_train_epoch_end of that epoch
    assert loops == _fit_loops(32, 2, True)
    assert not compat_lightning.finish_epoch(loops)  # once
    assert not compat_lightning.finish_epoch(_fit_loops(31, 1, False))  # mid-epoch: Lightning resumes it exactly
    assert not compat_lightning.finish_epoch({"fit_loop": {"epoch_progress": {}}})  # another layout: left alone
    assert not compat_lightning.finish_epoch(None)


def test_the_step_after_a_checkpoint_is_beaten_as_a_step(monkeypatch, tmp_path):
    """A real fit, a ModelCheckpoint every 2 steps (Lightning runs it after this callback, so the file is
    written after this callback's step-end beat): its ``checkpoint`` beat is followed, at the next batch's
    start, by a ``step`` beat, so a hang in that step is named at it and judged by a step's deadline
    (``hang_timeout="auto"``), not the checkpoint's. Without it the checkpoint's beat stood until the
    next step ended."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    callback = FaultTolerance()
    beats = []
    real = callback.guard.beat
    monkeypatch.setattr(callback.guard, "beat", lambda step=None, work=None, *, completed=False:
                        beats.append((work, step, completed)) or real(step, work, completed=completed))
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, limit_val_batches=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[callback, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)])
    trainer.fit(BoringModel())
    after = [beats[i + 1] for i, beat in enumerate(beats[:-1]) if beat[0] == "checkpoint"]
    assert beats.index(("checkpoint", 2, False)) < beats.index(("step", 3, True)), beats
    assert after[0] == ("step", 2, False), beats  # step 3 under way (global_step 2 + 1)
