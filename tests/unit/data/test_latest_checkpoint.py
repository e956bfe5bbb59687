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


class Config:  # hyperparameters beyond tensors (a dataclass, a CLI's namespace): not loadable with weights_only
    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_required_keys_are_checked_in_a_file_that_holds_objects_beyond_tensors(tmp_path):
    """A best model's weights-only file whose hyperparameters hold an object of the user's does not load
    with ``weights_only=True``; it was accepted unchecked, so a Lightning relaunch took it and ended in
    Lightning's KeyError. Its keys are read from the pickle's opcodes (never unpickled)."""
    torch.save({"state_dict": {"w": torch.zeros(3)}, "hyper_parameters": {"config": Config(0.1)}},
               tmp_path / "best.ckpt")
    torch.save({"state_dict": {"w": torch.zeros(3)}, "optimizer_states": [{}], "hyper_parameters": {"config": Config(0.1)}},
               tmp_path / "last.ckpt")
    assert check_file(tmp_path / "best.ckpt", ("optimizer_states",)).startswith("missing key 'optimizer_states'")
    assert check_file(tmp_path / "last.ckpt", ("optimizer_states",)) is None
    assert check_file(tmp_path / "best.ckpt") is None  # no keys asked for: complete is enough


# -- filters: a prefix, the keys the load needs --------------------------------------------------------------
def test_prefix_and_required_keys_skip_a_model_only_file(tmp_path, caplog):
    base = time.time_ns()
    save(tmp_path / "training_checkpoint_40.pt", 40, base)
    torch.save({"w": torch.zeros(3)}, tmp_path / "best_model_2_test_accuracy=0.5.pt")  # model only, newer
    os.utime(tmp_path / "best_model_2_test_accuracy=0.5.pt", ns=(base + 10**9,) * 2)
    assert latest_checkpoint(tmp_path, prefix="training_") == str(tmp_path / "training_checkpoint_40.pt")
    with pytest.warns(RuntimeWarning, match=r"skipping best_model_2_test_accuracy=0.5.pt: missing key 'trainer'"):
        found = latest_checkpoint(tmp_path, required_keys={"trainer": None, "model": None})
    assert found == str(tmp_path / "training_checkpoint_40.pt")
    with pytest.raises(TypeError, match="prefix=3"):
        latest_checkpoint(tmp_path, prefix=3)
    with pytest.raises(TypeError, match="required_keys='trainer'"):
        latest_checkpoint(tmp_path, required_keys="trainer")


def test_a_missing_folder_is_named_once(tmp_path, caplog):
    caplog.set_level("WARNING", logger="fault_tolerant_handlers")
    for _ in range(2):
        assert latest_checkpoint(tmp_path / "typo") is None
    named = [r for r in caplog.records if "typo" in r.getMessage() and "no such folder" in r.getMessage()]
    assert len(named) == 1, caplog.text


def test_load_checkpoint_names_a_bad_path():
    from fault_tolerant_handlers import load_checkpoint

    with pytest.raises(TypeError, match=r"load_checkpoint\(path=123\)"):
        load_checkpoint(123)


# -- the agreement, ranks as threads over one store -------------------------------------------------------------
def _agree_all(sources, timeout=5.0, skip=()):
    import threading
    from datetime import timedelta

    from fault_tolerant_handlers.data.checkpoints import agree

    store = torch.distributed.HashStore()
    results = {}

    def run(rank):
        try:
            results[rank] = agree(store, "k/1", rank, len(sources), sources[rank], timedelta(seconds=timeout))
        except Exception as err:  # noqa: BLE001
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(sources)) if r not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return results


def test_ranks_with_different_folders_all_raise_naming_each_folder(tmp_path):
    from fault_tolerant_handlers.data.checkpoints import folder_source

    stamped = tmp_path / "run_20260101-120000"
    sources = [folder_source(stamped), folder_source(tmp_path), folder_source(tmp_path)]
    results = _agree_all(sources)
    assert all(isinstance(results[r], ValueError) for r in range(3)), results
    text = str(results[1])
    assert str(results[0]) == text and "rank 0: " + repr(str(stamped)) in text and f"ranks 1-2: {str(tmp_path)!r}" in text
    assert "same folder" in text


def test_same_folder_one_answer_and_ignite_sources_of_other_ranks_not_compared(tmp_path):
    from fault_tolerant_handlers.data.checkpoints import Source, folder_source

    base = time.time_ns()
    save(tmp_path / "checkpoint_10.pt", 10, base)
    results = _agree_all([folder_source(tmp_path), folder_source(str(tmp_path) + "/")])
    assert results == {0: str(tmp_path / "checkpoint_10.pt"), 1: str(tmp_path / "checkpoint_10.pt")}
    elsewhere = Source((tmp_path / "base",), "'elsewhere'", compared=False)  # a Checkpoint on rank 1: never read
    results = _agree_all([folder_source(tmp_path), elsewhere])
    assert results[1] == results[0] == str(tmp_path / "checkpoint_10.pt")


def test_a_rank_that_never_calls_is_named_within_the_timeout(tmp_path):
    from fault_tolerant_handlers.data.checkpoints import folder_source

    start = time.monotonic()
    results = _agree_all([folder_source(tmp_path)] * 3, timeout=1.0, skip=(2,))
    assert time.monotonic() - start < 10
    assert isinstance(results[0], TimeoutError) and "rank 2 did not call latest_checkpoint" in str(results[0])
    assert isinstance(results[1], TimeoutError) and str(results[1]) == str(results[0])
    results = _agree_all([folder_source(tmp_path)] * 2, timeout=1.0, skip=(0,))
    assert isinstance(results[1], TimeoutError) and "no answer from rank 0" in str(results[1])


def test_held_live_state_answers_for_any_folder_without_an_exchange(tmp_path, monkeypatch):
    from fault_tolerant_handlers.data import checkpoints, live

    def no_exchange():
        raise AssertionError("latest_checkpoint exchanged with its peers while live state was held")

    monkeypatch.setattr(checkpoints, "_medium", no_exchange)
    monkeypatch.setattr(live, "latest_checkpoint_answer", lambda folder: f"LIVE:{folder}")
    mine, other = tmp_path / "mine", tmp_path / "other"  # each rank's own folder: a timestamp per call
    assert checkpoints.find(checkpoints.folder_source(mine)) == f"LIVE:{mine}"
    assert checkpoints.find(checkpoints.folder_source(other)) == f"LIVE:{other}"
