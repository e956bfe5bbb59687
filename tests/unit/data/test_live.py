"""Live state (``data/live.py``): the per-step bookkeeping, what the capture trusts, and how the next
attempt gets it (``latest_checkpoint``, ``load_checkpoint``, the RNG put back)."""

from __future__ import annotations

import os
import random

import numpy
import pytest
import torch

from fault_tolerant_handlers import latest_checkpoint, load_checkpoint
from fault_tolerant_handlers.core import attempts, config, rng_state
from fault_tolerant_handlers.data import live, snapshots


@pytest.fixture
def recovering(monkeypatch):
    monkeypatch.setattr(attempts, "_running_pid", os.getpid())
    yield
    live.forget()
    snapshots.forget()


def model_and_optimizer(batchnorm: bool = False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4)] + ([torch.nn.BatchNorm1d(4)] if batchnorm else [])
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()


def test_a_completed_step_is_trusted_and_the_next_forward_backward_do_not_change_that(recovering):
    model, optimizer = model_and_optimizer()
    tracker = live.StepTracker([model], update_at_pre_hook=True)
    try:
        train_step(model, optimizer)
        tracker.complete(1, {"engine": 1})
        model(torch.randn(8, 4)).sum().backward()  # the failed step got this far
        tracker.check("iteration")
        assert tracker.step == 1 and tracker.small == {"engine": 1}
    finally:
        tracker.close()


def test_a_failure_inside_the_optimizer_step_is_not_trusted(recovering):
    model, optimizer = model_and_optimizer()
    tracker = live.StepTracker([model], update_at_pre_hook=True)
    try:
        train_step(model, optimizer)
        tracker.complete(1, {})

        def fails(opt, args, kwargs):
            raise RuntimeError("inside the step")

        handle = optimizer.register_step_pre_hook(fails)  # runs after the library's global pre-hook
        with pytest.raises(RuntimeError):
            train_step(model, optimizer)
        handle.remove()
        with pytest.raises(live.NotLive, match="inside the optimizer step of the iteration after 1"):
            tracker.check("iteration")
    finally:
        tracker.close()


def test_a_failure_after_the_optimizer_step_before_the_step_completed_is_not_trusted(recovering):
    model, optimizer = model_and_optimizer()
    tracker = live.StepTracker([model], update_at_pre_hook=True)
    try:
        tracker.complete(0, {}, initial=True)
        train_step(model, optimizer)
        with pytest.raises(live.NotLive, match="after the optimizer step of the iteration after 0"):
            tracker.check("iteration")
    finally:
        tracker.close()


def test_lightnings_closure_runs_inside_optimizer_step_and_is_not_the_update(recovering):
    """``update_at_pre_hook=False``: ``optimizer.step(closure)`` runs the training step first; only
    what follows ``update_begins`` (Lightning's ``on_before_optimizer_step``) is the update."""
    model, optimizer = model_and_optimizer()
    tracker = live.StepTracker([model], update_at_pre_hook=False)
    try:
        tracker.complete(3, {}, initial=True)

        def closure():
            model(torch.randn(8, 4)).sum().backward()
            raise RuntimeError("the training step failed")

        with pytest.raises(RuntimeError):
            optimizer.step(closure)
        tracker.check("global step")  # trusted: no update began
        tracker.update_begins()
        with pytest.raises(live.NotLive, match="inside the optimizer step"):
            tracker.check("global step")
    finally:
        tracker.close()


def test_a_step_without_an_update_and_changed_buffers_are_not_trusted(recovering):
    model, optimizer = model_and_optimizer(batchnorm=True)
    tracker = live.StepTracker([model], update_at_pre_hook=True)
    try:
        tracker.complete(0, {}, initial=True)
        tracker.complete(1, {})  # no optimizer step in it: gradient accumulation
        with pytest.raises(live.NotLive, match="without an optimizer step"):
            tracker.check("iteration")
        train_step(model, optimizer)
        tracker.complete(2, {})
        tracker.check("iteration")
        model(torch.randn(8, 4))  # BatchNorm's running statistics move in the failed step's forward
        with pytest.raises(live.NotLive, match="buffers changed after iteration 2"):
            tracker.check("iteration")
    finally:
        tracker.close()


def test_the_optimizer_hooks_go_with_the_last_tracker():
    first = live.StepTracker([], update_at_pre_hook=True)
    second = live.StepTracker([], update_at_pre_hook=True)
    assert len(live._hook_handles) == 2
    first.close()
    assert len(live._hook_handles) == 2
    second.close()
    second.close()
    assert live._hook_handles == [] and live._trackers == []


def captured(step: int = 36, directory: str | None = None, rng: tuple | None = None) -> live.Captured:
    return live.Captured(step, "iteration", {"model": {"w": torch.full((2,), float(step))}}, directory, rng)


def test_latest_checkpoint_names_the_held_state_and_load_checkpoint_hands_it_over_once(recovering, tmp_path):
    torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / "checkpoint_30.pt")
    live.hold(captured(directory=str(tmp_path.resolve())))
    # any folder (a folder named anew at each call, one only rank 0 knows): the last name given is the one
    assert latest_checkpoint(tmp_path / "other") == str(tmp_path / "other" / "live-state-step=36.pt")
    path = latest_checkpoint(tmp_path)
    assert path == str(tmp_path / "live-state-step=36.pt") and not os.path.exists(path)
    assert snapshots.newest(path) is not None  # without taking it (resume_main reads the step so)
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((2,), 36.0))
    assert live.held() is None and snapshots.newest(path) is None
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint_30.pt")  # then the files, as before


def test_a_loop_start_restores_held_state_the_script_did_not_load_and_says_so_after(recovering, tmp_path, caplog):
    """Live state reaches the loop whatever the script asked: ``restore`` is called at the loop's start,
    and the line saying it carries on from live state comes after the restore, checked against where
    the loop really starts."""
    position = {"step": 0}

    def restore(state):
        position["step"] = 36
        return "the objects"

    live.hold(captured(step=36))
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        live.loop_starts("iteration", lambda: position["step"], restore)
    assert position["step"] == 36 and live.held() is None
    assert "carries on from live state, iteration 36 (restored into the objects)" in caplog.text
    caplog.clear()
    live.loop_starts("iteration", lambda: 36, restore)  # told once
    assert caplog.text == ""


def test_a_rank_that_had_completed_a_step_past_the_agreed_one_says_it_computes_it_again(recovering, caplog):
    """A lost rank's shard of step 37 was held nowhere: every rank carries on from 36, and this rank,
    which had completed 37, says it computes that step again (not "no step computed twice")."""
    live.register(lambda: captured(step=37))
    assert live.collect().step == 37  # the failed attempt's capture: its last completed step
    live.hold(captured(step=36))
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        live.loop_starts("iteration", lambda: 36, lambda state: "the objects")
    assert "carries on from live state, iteration 36 (restored into the objects" in caplog.text
    assert "): 1 step(s) this rank had completed computed again" in caplog.text and "no step computed twice" not in caplog.text


def test_a_loop_whose_data_does_not_resume_with_it_says_so_not_that_no_step_is_computed_twice(recovering, caplog):
    """The adapter's ``data()`` says the loop's data restarts its epoch (a plain DataLoader resumed inside
    one): the line says the loop resumed at the step but its data did not, never "no step computed twice"."""
    live.hold(captured(step=36))
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        live.loop_starts("iteration", lambda: 36, lambda state: "the objects", data=lambda: "its data starts over")
    assert "carries on from live state, iteration 36 (restored into the objects" in caplog.text
    assert "): resumed at that iteration, but its data starts over, not the batches an uninterrupted run trains" \
        in caplog.text
    assert "no step computed twice" not in caplog.text


def test_a_loop_start_that_cannot_restore_warns_where_it_starts_instead(recovering, caplog):
    live.hold(captured(step=36))
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        live.loop_starts("iteration", lambda: 30, None, "no Checkpoint handler")
    assert "live state of iteration 36 was not restored: no Checkpoint handler" in caplog.text
    assert "the run starts at iteration 30" in caplog.text and "carries on from live state" not in caplog.text
    caplog.clear()
    live.hold(None, "no rank holds live state (rank 0: FTH_LIVE_STATE=0)")
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        live.loop_starts("iteration", lambda: 0, None)
    assert "this attempt starts at iteration 0: the script loaded no checkpoint, so from the start (live state could " \
           "not serve: no rank holds live state" in caplog.text


def test_a_script_load_of_the_live_name_is_told_at_the_loop_start_and_checked(recovering, tmp_path, caplog):
    live.hold(captured(step=36))
    load_checkpoint(latest_checkpoint(tmp_path / "a-folder-of-this-call"))
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        live.loop_starts("iteration", lambda: 30, lambda state: "x")  # the script loaded a file after it
    assert "live state of iteration 36 was handed over (loaded by the script from live-state-step=36.pt), but " \
           "the loop starts at iteration 30" in caplog.text


def test_substitute_names_the_held_state_for_a_framework_load_of_another_path(recovering, tmp_path):
    live.hold(captured(step=36))
    name = live.substitute(tmp_path / "epoch=0-step=30.ckpt", "fit")
    assert name == str(tmp_path / "live-state-step=36.pt")
    assert live.substitute(name, "fit") is None  # the name itself: nothing to replace
    assert torch.equal(load_checkpoint(name)["model"]["w"], torch.full((2,), 36.0))
    assert live.substitute(None, "fit") is None  # taken: nothing held


def test_a_held_state_whose_directory_is_unknown_answers_for_any_directory(recovering, tmp_path):
    live.hold(captured(step=7))
    assert latest_checkpoint(tmp_path / "empty") == str(tmp_path / "empty" / "live-state-step=7.pt")


def test_the_rng_is_put_back_as_the_step_after_the_held_one_starts(recovering, tmp_path):
    """Torch's, Python's ``random`` and numpy's global RNG (a script's ``seed_everything`` in each call)."""
    def seed(n: int) -> None:
        torch.manual_seed(n)
        random.seed(n)
        numpy.random.seed(n)

    def draws() -> list:
        return [torch.rand(3).tolist(), random.random(), numpy.random.rand()]

    seed(1)
    state = rng_state.of(rng_state.read())
    expected = draws()
    live.hold(captured(step=36, rng=state))
    load_checkpoint(latest_checkpoint(tmp_path))
    seed(2)
    assert not live.restore_rng(35)  # another step: disarmed, nothing put back
    live.hold(captured(step=36, rng=state))
    load_checkpoint(latest_checkpoint(tmp_path))
    assert live.restore_rng(36) and draws() == expected
    assert not live.restore_rng(36)  # once


def test_collect_says_why_there_is_no_live_state(recovering, monkeypatch):
    with pytest.raises(live.NotLive, match="no training loop"):
        live.collect()

    def untrusted():
        raise live.NotLive("it failed inside the optimizer step")

    live.capture_now(untrusted)
    with pytest.raises(live.NotLive, match="inside the optimizer step"):
        live.collect()

    def broken():
        raise KeyError("x")

    live.register(broken)
    with pytest.raises(live.NotLive, match="capturing it failed: KeyError"):
        live.collect()
    live.capture_now(lambda: captured())
    assert live.collect().step == 36
    live.capture_now(lambda: captured())
    monkeypatch.setenv(config.LIVE_STATE_ENV, "0")
    with pytest.raises(live.NotLive, match="FTH_LIVE_STATE=0"):
        live.collect()
    with pytest.raises(live.NotLive, match="no training loop"):  # the capture went with the collect
        monkeypatch.delenv(config.LIVE_STATE_ENV)
        live.collect()


def test_the_variable_is_checked(monkeypatch):
    monkeypatch.setenv(config.LIVE_STATE_ENV, "off")
    with pytest.raises(ValueError, match="FTH_LIVE_STATE='off': expected 0 .* or 1"):
        config.load()
    monkeypatch.setenv(config.LIVE_STATE_ENV, " 0 ")
    assert not config.settings().live_state
