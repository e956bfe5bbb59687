"""The newest checkpoint kept in memory while a recovery in place runs (``data/snapshots.py``)."""

from __future__ import annotations

import collections

import pytest
import torch

from fault_tolerant_handlers import load_checkpoint
from fault_tolerant_handlers.core import attempts
from fault_tolerant_handlers.data import snapshots


@pytest.fixture
def recovering(monkeypatch):
    monkeypatch.setattr(attempts, "_running_pid", __import__("os").getpid())
    yield
    snapshots.forget()


def state(value: float) -> dict:
    model = collections.OrderedDict(weight=torch.full((3,), value))
    model._metadata = {"": {"version": 2}}
    return {"model": model, "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]},
            "trainer": {"iteration": 30}}


def test_nothing_is_kept_outside_a_recovery(tmp_path):
    assert not snapshots.keep(tmp_path / "c.pt", state(1.0))
    assert snapshots.newest(tmp_path / "c.pt") is None


def test_a_kept_checkpoint_is_a_copy_handed_over_once(recovering, tmp_path):
    live = state(1.0)
    path = tmp_path / "checkpoint_30.pt"
    torch.save(state(9.0), path)  # the file: what a second read gets
    assert snapshots.keep(path, live)
    live["model"]["weight"].add_(5)  # training goes on: the copy is of the moment it was saved
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["model"]["weight"], torch.full((3,), 1.0))
    assert loaded["model"]._metadata == {"": {"version": 2}} and isinstance(loaded["model"], collections.OrderedDict)
    assert loaded["trainer"] == {"iteration": 30}
    assert snapshots.last_cost[1] == 3 * 4 + 3 * 4
    # handed over: an optimizer may update the tensors it was given, so the next read is the file's
    assert snapshots.newest(path) is None
    assert torch.equal(load_checkpoint(str(path))["model"]["weight"], torch.full((3,), 9.0))


def test_only_the_newest_is_kept_and_any_other_path_is_read_from_its_file(recovering, tmp_path):
    torch.save(state(7.0), tmp_path / "checkpoint_20.pt")
    snapshots.keep(tmp_path / "checkpoint_20.pt", state(2.0))
    snapshots.keep(tmp_path / "checkpoint_30.pt", state(3.0))
    assert snapshots.newest(tmp_path / "checkpoint_20.pt") is None
    assert torch.equal(load_checkpoint(tmp_path / "checkpoint_20.pt")["model"]["weight"], torch.full((3,), 7.0))
    assert torch.equal(load_checkpoint(tmp_path / "checkpoint_30.pt")["model"]["weight"], torch.full((3,), 3.0))


def test_lightnings_last_ckpt_of_the_same_step_shares_the_copy(recovering, tmp_path):
    step = {"epoch": 0, "global_step": 30, "state_dict": {"w": torch.zeros(2)}}
    snapshots.keep(tmp_path / "epoch=0-step=30.ckpt", step)
    snapshots.keep(tmp_path / "last.ckpt", dict(step))
    assert snapshots.newest(tmp_path / "last.ckpt") is snapshots.newest(tmp_path / "epoch=0-step=30.ckpt")


def test_the_variable_turns_it_off_and_is_checked(recovering, tmp_path, monkeypatch):
    monkeypatch.setenv("FTH_SNAPSHOT", "0")
    assert not snapshots.keep(tmp_path / "c.pt", state(1.0))
    monkeypatch.setenv("FTH_SNAPSHOT", "yes")
    with pytest.raises(ValueError, match="FTH_SNAPSHOT='yes': expected one of 0, 1"):
        snapshots.enabled()
    from fault_tolerant_handlers.core import config

    with pytest.raises(ValueError, match="FTH_SNAPSHOT='yes'"):  # at start, with every other setting
        config.load()
