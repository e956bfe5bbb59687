"""The phases of a recovery in place (``core/phases.py``): steps run in the order they were
registered over one state value; a step registered as tolerated is logged and the recovery goes on,
any other stops it; each layer registers its own part, so that ``recover/`` imports only ``core/``.
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
from fault_tolerant_handlers import adapters, launchers
from fault_tolerant_handlers import lightning as ft_lightning
from fault_tolerant_handlers.adapters import compat_ignite
from fault_tolerant_handlers.core import attempts, phases
from fault_tolerant_handlers.core.phases import Phase, RecoveryState
from fault_tolerant_handlers.data import recovery as data_recovery
from fault_tolerant_handlers.launchers import compat_torchrun
from fault_tolerant_handlers.recover.inplace import _cause_of, _Recovery


@pytest.fixture
def registered():
    """Register steps for the test; every one is unregistered after it."""
    added = []

    def register(phase, step, **kwargs):
        phases.register(phase, step, **kwargs)
        added.append((phase, step))
        return step

    yield register
    for phase, step in added:
        phases.unregister(phase, step)


def test_steps_run_in_the_order_registered_over_one_state(registered):
    ran = []
    registered(Phase.CALL_AGAIN, lambda state: ran.append(("a", state.rank)) or replace(state, rank=state.rank + 1))
    registered(Phase.CALL_AGAIN, lambda state: ran.append(("b", state.rank)))  # None: the state is kept
    registered(Phase.CALL_AGAIN, lambda state: ran.append(("c", state.rank)) or replace(state, world_size=4))
    out = phases.run(Phase.CALL_AGAIN, RecoveryState(rank=0, world_size=2))
    assert ran == [("a", 0), ("b", 1), ("c", 1)]
    assert (out.rank, out.world_size) == (1, 4)
    with pytest.raises(Exception):  # frozen: a step makes a new state, never changes the one it was given
        out.rank = 3  # type: ignore[misc]


def test_a_step_is_registered_once_and_unregistered():
    def step(state):
        return None

    phases.register(Phase.CALL_AGAIN, step)
    phases.register(Phase.CALL_AGAIN, step)
    try:
        assert phases.steps(Phase.CALL_AGAIN).count(step) == 1
    finally:
        phases.unregister(Phase.CALL_AGAIN, step)
    assert step not in phases.steps(Phase.CALL_AGAIN)


def test_a_tolerated_step_that_raises_is_logged_and_the_next_step_runs(registered, caplog):
    ran = []

    def broken(state):
        raise OSError("the key is gone\nsecond line")

    registered(Phase.CALL_AGAIN, broken, tolerate=True)
    registered(Phase.CALL_AGAIN, lambda state: ran.append("after"))
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        phases.run(Phase.CALL_AGAIN, RecoveryState())
    assert ran == ["after"]
    assert "recovery phase call again: a step (test_a_tolerated_step_that_raises_is_logged_and_the_next_step_runs." \
           "<locals>.broken) failed, the recovery goes on: OSError: the key is gone" in caplog.text
    assert "second line" not in caplog.text


def test_a_step_not_tolerated_stops_the_recovery_with_its_exception(registered):
    ran = []

    def broken(state):
        raise KeyError("k")

    registered(Phase.CALL_AGAIN, broken)
    registered(Phase.CALL_AGAIN, lambda state: ran.append("after"))
    with pytest.raises(KeyError):
        phases.run(Phase.CALL_AGAIN, RecoveryState())
    assert ran == []


def test_bad_registrations_and_returns_are_named(registered):
    with pytest.raises(ValueError, match=r"phase must be a Phase \(BEGIN, WORLD, .*got 'end'"):
        phases.register("end", print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be a callable taking a RecoveryState, got 3"):
        phases.register(Phase.END, 3)  # type: ignore[arg-type]
    registered(Phase.CALL_AGAIN, lambda state: {"rank": 1})
    with pytest.raises(TypeError, match="returned dict, not a RecoveryState or None"):
        phases.run(Phase.CALL_AGAIN, RecoveryState())


def test_each_layer_registers_its_part_in_order():
    assert phases.steps(Phase.BEGIN) == (compat_torchrun.begin_recovery,)
    assert phases.steps(Phase.WORLD) == (compat_torchrun.world_of_recovery,)
    assert phases.steps(Phase.CAPTURE_LIVE) == (data_recovery.capture_live,)
    # the data layer holds the live state, then the adapters learn of it (a keeper's replacement runs no teardown)
    assert phases.steps(Phase.SETTLE_LIVE) == (data_recovery.settle_live, adapters._resolve_live_names)
    assert phases.steps(Phase.TEAR_DOWN) == (compat_torchrun.forget_addresses_of_attempt,)
    # the adapters' (registered with the package), then the Lightning adapter's (with its module)
    assert phases.steps(Phase.RESET_FRAMEWORKS) == tuple(
        step for phase, step in adapters.STEPS if phase is Phase.RESET_FRAMEWORKS) + (
        ft_lightning._keep_logger_versions,)
    assert phases.steps(Phase.COLLECTED) == (data_recovery.reap_workers,)
    assert phases.steps(Phase.RE_FORM) == (compat_torchrun.re_form,)
    assert set(phases.steps(Phase.END)) == {compat_torchrun.end_recovery, data_recovery.end_recovery,
                                            ft_lightning._forget_logger_versions}
    assert all(step in phases.steps(phase) for phase, step in launchers.STEPS + data_recovery.STEPS)


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
    state = phases.run(Phase.CAPTURE_LIVE, RecoveryState(rank=0))
    assert state.live is None and state.live_why == "FTH_LIVE_STATE=0"


def test_the_launchers_know_no_world_before_a_rendezvous():
    assert compat_torchrun.first_rendezvous() is None
    assert phases.run(Phase.WORLD, RecoveryState(rank=3)) == RecoveryState(rank=3)


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
        compat_torchrun.release_rendezvous()


def _recovery(store) -> tuple[_Recovery, dict]:
    recovery = _Recovery(print, 2, timedelta(seconds=10))
    recovery.backend, recovery.timeout = "gloo", timedelta(seconds=10)
    recovery.given = (store, 0, 1, "gloo", timedelta(seconds=10))
    recovery.causes.append(_cause_of(ValueError("boom"), 0))
    now = time.monotonic()
    return recovery, {"detected": now, "stopped": now, "agreed": now}


def test_teardown_and_re_forming_run_the_layers_steps_in_their_order(one_rank_group, registered, caplog):
    seen = []

    def note(phase):
        return lambda state: seen.append((phase.name, state.rank, state.world_size, state.store is one_rank_group,
                                          dist.is_initialized()))

    def broken(state):
        raise RuntimeError("a framework that is not there")

    registered(Phase.TEAR_DOWN, note(Phase.TEAR_DOWN))
    registered(Phase.RESET_FRAMEWORKS, broken, tolerate=True)  # as the adapters' steps are
    for phase in (Phase.RESET_FRAMEWORKS, Phase.COLLECTED, Phase.RE_FORM):
        registered(phase, note(phase))
    recovery, timings = _recovery(one_rank_group)
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        recovery._teardown(timings)
        recovery._reform(timings)
    assert seen == [("TEAR_DOWN", 0, 1, True, True),  # before the groups go
                    ("RESET_FRAMEWORKS", 0, 1, True, False), ("COLLECTED", 0, 1, True, False),
                    ("RE_FORM", 0, 1, True, False)]
    assert dist.is_initialized() and dist.get_world_size() == 1  # re-formed, as the group existed before
    assert list(timings["parts"]) == ["keys", "sessions", "groups", "frameworks", "collected", "workers"]
    assert "a framework that is not there" in caplog.text
    assert "recovering in place, attempt 1 (max_restarts=2)" in caplog.text


def test_the_adapters_steps_are_tolerated_the_data_layers_are_not(one_rank_group, monkeypatch):
    def missing():
        raise RuntimeError("ignite.distributed.utils._model is missing")

    monkeypatch.setattr(compat_ignite, "reset_idist", missing)
    phases.run(Phase.RESET_FRAMEWORKS, RecoveryState())  # logged (as an event's subscriber was), not raised

    def stuck(timeout: float = 2.0) -> int:
        raise OSError("a worker that cannot be joined")

    monkeypatch.setattr(data_recovery, "reap_loader_workers", stuck)
    recovery, timings = _recovery(one_rank_group)
    with pytest.raises(OSError, match="cannot be joined"):  # as when the recovery reaped them itself
        recovery._teardown(timings)


def test_address_keys_left_behind_do_not_stop_the_teardown(one_rank_group, caplog):
    class Refusing:
        def delete_key(self, key):
            raise RuntimeError(f"cannot delete {key}")

    with caplog.at_level(logging.DEBUG, logger="fault_tolerant_handlers"):
        phases.run(Phase.TEAR_DOWN, RecoveryState(rank=0, world_size=1, store=Refusing()))
    assert "deleting the failed attempt's address keys: cannot delete " in caplog.text


def test_the_recoverys_state_carries_its_world_and_takes_any_field(one_rank_group):
    recovery, _ = _recovery(one_rank_group)
    state = recovery._state(cause="this rank's own", live=None)
    assert (state.rank, state.world_size, state.store, state.cause) == (0, 1, one_rank_group, "this rank's own")
    assert recovery._state().cause is recovery.causes[-1]
