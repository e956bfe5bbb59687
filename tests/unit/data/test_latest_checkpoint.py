"""latest_checkpoint(): the newest complete checkpoint, torn and temporary files skipped with a warning."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

from fault_tolerant_handlers import latest_checkpoint
from fault_tolerant_handlers.data.checkpoints import check_file


def save(path, step, mtime):
    torch.save({"model": {"w": torch.full((64,), float(step))}, "trainer": {"iteration": step, "epoch_length": 50}}, path)
    os.utime(path, ns=(mtime, mtime))
    return path


def test_ignite_names_newest_complete_wins_torn_and_temporary_skipped(tmp_path):
    base = time.time_ns()
    save(tmp_path / "checkpoint_10.pt", 10, base)
    save(tmp_path / "checkpoint_20.pt", 20, base + 10**9)
    torn = save(tmp_path / "checkpoint_30.pt", 30, base + 2 * 10**9)
    data = torn.read_bytes()
    torn.write_bytes(data[: len(data) // 2])  # killed in mid-write
    os.utime(torn, ns=(base + 2 * 10**9,) * 2)
    (tmp_path / "tmpab12cd34").write_bytes(b"PK\x03\x04partial")  # DiskSaver's leftover
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.warns(RuntimeWarning) as record:
        assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint_20.pt")
    text = "\n".join(str(w.message) for w in record)
    assert "skipping checkpoint_30.pt" in text and "skipping tmpab12cd34: a temporary file" in text
    assert "notes.txt" not in text and "checkpoint_20" not in text and "checkpoint_10" not in text
    assert torch.load(latest_checkpoint(tmp_path), weights_only=True)["trainer"]["iteration"] == 20


def test_lightning_names_last_ckpt_and_ties(tmp_path):
    base = time.time_ns()
    save(tmp_path / "epoch=0-step=40.ckpt", 40, base)
    save(tmp_path / "last.ckpt", 40, base - 10**9)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "epoch=0-step=40.ckpt")
    save(tmp_path / "last.ckpt", 50, base + 10**9)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")
    # same modification time: the larger step in the name
    save(tmp_path / "epoch=0-step=60.ckpt", 60, base + 5 * 10**9)
    save(tmp_path / "epoch=0-step=70.ckpt", 70, base + 5 * 10**9)
    assert latest_checkpoint(tmp_path).endswith("epoch=0-step=70.ckpt")


def test_none_when_nothing_usable(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoint_5.pt").write_bytes(b"")
    with pytest.warns(RuntimeWarning, match="skipping checkpoint_5.pt: empty"):
        assert latest_checkpoint(tmp_path) is None
    with pytest.raises(TypeError, match="dirname=3"):
        latest_checkpoint(3)


def test_a_pickle_that_would_run_code_is_not_run(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"x": Evil()}, tmp_path / "checkpoint_1.pt")
    assert check_file(tmp_path / "checkpoint_1.pt") is None  # complete; the framework decides how to load it
    assert not (tmp_path / "pwned").exists()
