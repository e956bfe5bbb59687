"""The steps of a recovery in place (``core/hooks.py``): steps run in the order they were added
over one state value; a step added as tolerated is logged and the recovery goes on, any other stops
it; each layer adds its own part, so that ``recover/`` imports only ``core/``.
The recoveries themselves are proven on real ranks in ``tests/distributed/test_recover_in_place.py``."""

from __future__ import annotations

import ast
import logging
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import fault_tolerant_handlers
from fault_tolerant_handlers.adapters import compat_ignite
from fault_tolerant_handlers.core import attempts, hooks
from fault_tolerant_handlers.core.phases import RecoveryState
from fault_tolerant_handlers.data import compat_dataloader
from fault_tolerant_handlers.launchers import compat_torchrun
from fault_tolerant_handlers.recover.agree import cause_of
from fault_tolerant_handlers.recover.inplace import _Recovery


@pytest.fixture
def registered():
    """Add steps for the test; every one is removed after it."""
    added = []

    def register(hook, step, **kwargs):
        hooks.add(hook, step, **kwargs)
        added.append((hook, step))
        return step

    yield register
    for hook, step in added:
        hooks.remove(hook, step)


@pytest.fixture
def bare(monkeypatch):
    """``hooks.BEGIN`` with none of the layers' steps, for the test."""
    monkeypatch.setitem(hooks._hooks, hooks.BEGIN, ())
    return hooks.BEGIN


def test_steps_run_in_the_order_added_over_one_state(bare):
    ran = []
    hooks.add(bare, lambda state: ran.append(("a", state.rank)) or replace(state, rank=state.rank + 1))
    hooks.add(bare, lambda state: ran.append(("b", state.rank)))  # None: the state is kept
    hooks.add(bare, lambda state: ran.append(("c", state.rank)) or replace(state, world_size=4))
    out = hooks.run(bare, RecoveryState(rank=0, world_size=2))
    assert ran == [("a", 0), ("b", 1), ("c", 1)]
    assert (out.rank, out.world_size) == (1, 4)
    with pytest.raises(Exception):  # frozen: a step makes a new state, never changes the one it was given
        out.rank = 3  # type: ignore[misc]


def test_a_step_is_added_once_and_removed(bare):
    def step(state):
        return None

    hooks.add(bare, step)
    hooks.add(bare, step)
    assert hooks.callbacks(bare).count(step) == 1
    hooks.remove(bare, step)
    assert step not in hooks.callbacks(bare)


def test_a_tolerated_step_that_raises_is_logged_and_the_next_step_runs(bare, caplog):
    ran = []

    def broken(state):
        raise OSError("the key is gone\nsecond line")

    hooks.add(bare, broken, tolerate=True)
    hooks.add(bare, lambda state: ran.append("after"))
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        hooks.run(bare, RecoveryState())
    assert ran == ["after"]
    assert "recovery step begin: test_a_tolerated_step_that_raises_is_logged_and_the_next_step_runs." \
           "<locals>.broken failed, the recovery goes on: OSError: the key is gone" in caplog.text
    assert "second line" not in caplog.text


def test_a_step_not_tolerated_stops_the_recovery_with_its_exception(bare):
    ran = []

    def broken(state):
        raise KeyError("k")

    hooks.add(bare, broken)
    hooks.add(bare, lambda state: ran.append("after"))
    with pytest.raises(KeyError):
        hooks.run(bare, RecoveryState())
    assert ran == []


def test_bad_hooks_and_returns_are_named(bare):
    with pytest.raises(ValueError, match=r"unknown hook 'call again'; the hooks are session started, "):
        hooks.add("call again", print)
    with pytest.raises(TypeError, match="callback must be callable, got 3"):
        hooks.add(hooks.END, 3)  # type: ignore[arg-type]
    hooks.add(bare, lambda state: {"rank": 1})
    with pytest.raises(TypeError, match="returned dict, not a RecoveryState or None"):
        hooks.run(bare, RecoveryState())


def test_recover_imports_only_core_and_itself():
    package = Path(fault_tolerant_handlers.__file__).parent
    outside = []
    for path in (package / "recover").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                module = node.module or ""
                if node.level > 2 or not module.startswith("core"):
                    outside.append(f"{path.name}: {'.' * node.level}{module}")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(package.name):
                outside.append(f"{path.name}: {node.module}")
    assert outside == []


def test_the_data_layer_says_why_there_is_no_live_state(monkeypatch):
    monkeypatch.setenv("FTH_LIVE_STATE", "0")
    state = hooks.run(hooks.CAPTURE_LIVE, RecoveryState(rank=0))
    assert state.live is None and state.live_why == "FTH_LIVE_STATE=0"


def test_the_launchers_know_no_world_before_a_rendezvous():
    assert compat_torchrun.first_rendezvous() is None


@pytest.fixture
def one_rank_group(tmp_path):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    before = attempts.in_place()
    try:
        yield store
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        attempts.set_in_place(before)
        compat_torchrun.end_recovery()


def _recovery(store) -> tuple[_Recovery, dict]:
    recovery = _Recovery(print, 2, timedelta(seconds=10))
    recovery.backend, recovery.timeout = "gloo", timedelta(seconds=10)
    recovery.given = (store, 0, 1, "gloo", timedelta(seconds=10))
    recovery.causes.append(cause_of(ValueError("boom"), 0))
    now = time.monotonic()
    return recovery, {"detected": now, "stopped": now, "agreed": now}


def test_teardown_and_re_forming_run_the_layers_steps_in_their_order(one_rank_group, registered, caplog):
    seen = []

    def note(hook):
        return lambda state: seen.append((hook, state.rank, state.world_size, state.store is one_rank_group,
                                          dist.is_initialized()))

    def broken(state):
        raise RuntimeError("a framework that is not there")

    registered(hooks.TEAR_DOWN, note(hooks.TEAR_DOWN))
    registered(hooks.RESET_FRAMEWORKS, broken, tolerate=True)  # as the adapters' steps are
    for hook in (hooks.RESET_FRAMEWORKS, hooks.COLLECTED, hooks.RE_FORM):
        registered(hook, note(hook))
    recovery, timings = _recovery(one_rank_group)
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        recovery._teardown(timings)
        recovery._reform(timings)
    assert seen == [(hooks.TEAR_DOWN, 0, 1, True, True),  # before the groups go
                    (hooks.RESET_FRAMEWORKS, 0, 1, True, False), (hooks.COLLECTED, 0, 1, True, False),
                    (hooks.RE_FORM, 0, 1, True, False)]
    assert dist.is_initialized() and dist.get_world_size() == 1  # re-formed, as the group existed before
    assert list(timings["parts"]) == ["keys", "sessions", "groups", "frameworks", "collected", "workers"]
    assert "a framework that is not there" in caplog.text
    assert "recovering in place, attempt 1 (max_restarts=2)" in caplog.text


def test_the_adapters_steps_are_tolerated_the_data_layers_are_not(one_rank_group, monkeypatch):
    def missing():
        raise RuntimeError("ignite.distributed.utils._model is missing")

    monkeypatch.setattr(compat_ignite, "reset_idist", missing)
    hooks.run(hooks.RESET_FRAMEWORKS, RecoveryState())  # logged (as an event's subscriber was), not raised

    def stuck() -> list:
        raise OSError("a worker that cannot be joined")

    monkeypatch.setattr(compat_dataloader.multiprocessing, "active_children", stuck)
    recovery, timings = _recovery(one_rank_group)
    with pytest.raises(OSError, match="cannot be joined"):  # as when the recovery reaped them itself
        recovery._teardown(timings)


def test_address_keys_left_behind_do_not_stop_the_teardown(one_rank_group, caplog):
    class Refusing:
        def delete_key(self, key):
            raise RuntimeError(f"cannot delete {key}")

    with caplog.at_level(logging.DEBUG, logger="fault_tolerant_handlers"):
        hooks.run(hooks.TEAR_DOWN, RecoveryState(rank=0, world_size=1, store=Refusing()))
    assert "deleting the failed attempt's address keys: cannot delete " in caplog.text


def test_the_recoverys_state_carries_its_world_and_takes_any_field(one_rank_group):
    recovery, _ = _recovery(one_rank_group)
    state = recovery._state(cause="this rank's own", live=None)
    assert (state.rank, state.world_size, state.store, state.cause) == (0, 1, one_rank_group, "this rank's own")
    assert recovery._state().cause is recovery.causes[-1]
