"""latest_checkpoint given a framework's object: an Ignite Engine or Checkpoint, a Lightning Trainer."""

from __future__ import annotations

import os
import time

import pytest
import torch

from fault_tolerant_handlers import latest_checkpoint


def _ignite_pair(tmp_path):
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, DiskSaver

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Engine(lambda e, b: None)
    to_save = {"trainer": trainer, "model": model, "optimizer": optimizer}
    training = Checkpoint(to_save, DiskSaver(tmp_path, require_empty=False), filename_prefix="training", n_saved=2)
    best = Checkpoint({"model": model}, DiskSaver(tmp_path, require_empty=False), filename_prefix="best",
                      score_name="test_accuracy", score_function=lambda e: 0.5)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=4), training)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, best)
    return trainer, to_save, training, best


def test_ignite_engine_and_checkpoint_never_pick_the_best_model_file(tmp_path):
    from ignite.engine import Engine
    from ignite.handlers import Checkpoint

    trainer, to_save, training, _ = _ignite_pair(tmp_path)
    trainer.run(list(range(10)), max_epochs=1)
    names = sorted(os.listdir(tmp_path))
    assert names == ["best_model_test_accuracy=0.5000.pt", "training_checkpoint_4.pt", "training_checkpoint_8.pt"]
    later = time.time_ns() + 10**9
    os.utime(tmp_path / names[0], ns=(later, later))  # the best model is the newest file
    assert latest_checkpoint(tmp_path).endswith("best_model_test_accuracy=0.5000.pt")  # what went wrong before
    assert latest_checkpoint(trainer) == str(tmp_path / "training_checkpoint_8.pt")
    assert latest_checkpoint(training) == str(tmp_path / "training_checkpoint_8.pt")
    fresh, *_ = _ignite_pair(tmp_path)
    Checkpoint.load_objects(to_load={"trainer": fresh}, checkpoint=latest_checkpoint(trainer))
    assert fresh.state.iteration == 8
    with pytest.raises(ValueError, match="no ignite Checkpoint whose to_save holds this engine"):
        latest_checkpoint(Engine(lambda e, b: None))


def test_ignite_checkpoint_keys_skip_a_file_without_them(tmp_path):
    _, to_save, training, _ = _ignite_pair(tmp_path)
    torch.save({"model": {}, "optimizer": {}}, tmp_path / "training_checkpoint_99.pt")  # no 'trainer'
    with pytest.warns(RuntimeWarning, match=r"skipping training_checkpoint_99.pt: missing key 'trainer'"):
        assert latest_checkpoint(training) is None


def test_lightning_trainer_default_folder_every_version(tmp_path, monkeypatch):
    import lightning as L

    monkeypatch.chdir(tmp_path)
    trainer = L.Trainer(accelerator="cpu", enable_progress_bar=False)  # the default logger (TensorBoard, else CSV)
    assert trainer.checkpoint_callback.dirpath is None
    assert latest_checkpoint(trainer) is None  # a first run: no folder yet
    old = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    old.mkdir(parents=True)
    (tmp_path / "lightning_logs" / "version_1").mkdir()  # the relaunch's version: nothing saved yet
    torch.save({"state_dict": {}, "global_step": 40, "optimizer_states": []}, old / "epoch=0-step=40.ckpt")
    torch.save({"state_dict": {}, "global_step": 40}, old / "best-epoch=0.ckpt")  # weights only, newer
    with pytest.warns(RuntimeWarning, match="skipping best-epoch=0.ckpt: missing key 'optimizer_states'"):
        assert latest_checkpoint(trainer) == str(old / "epoch=0-step=40.ckpt")
    assert trainer.logger._version is None  # not fixed by the call (fit chooses it)
    bare = L.Trainer(logger=False, default_root_dir=tmp_path / "root", accelerator="cpu")
    (tmp_path / "root" / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {}, "optimizer_states": []}, tmp_path / "root" / "checkpoints" / "last.ckpt")
    assert latest_checkpoint(bare) == str(tmp_path / "root" / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError, match="no ModelCheckpoint"):
        latest_checkpoint(L.Trainer(enable_checkpointing=False, logger=False, accelerator="cpu"))


def test_lightning_a_new_experiment_in_a_finished_runs_folder_is_told(tmp_path, recwarn):
    """A run fitted to its max_epochs, then a new experiment with the same default_root_dir: the newest
    checkpoint is the finished run's last.ckpt, from which fit ends at once; rank 0 is told so, naming
    the file and the limit. A run that goes on past it (a larger max_epochs) is not told."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    def trainer(max_epochs):
        return L.Trainer(default_root_dir=tmp_path, max_epochs=max_epochs, limit_train_batches=2, limit_val_batches=0,
                         accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)])

    trainer(1).fit(BoringModel())
    with pytest.warns(RuntimeWarning, match=r"last.ckpt is of a finished fit \(its 1 epoch reached max_epochs=1\): "
                                            r"fit\(ckpt_path=...\) ends at once"):
        assert latest_checkpoint(trainer(1)) == str(tmp_path / "ckpt" / "last.ckpt")
    recwarn.clear()
    assert latest_checkpoint(trainer(3)) == str(tmp_path / "ckpt" / "last.ckpt")
    assert not [w for w in recwarn if "finished fit" in str(w.message)]
