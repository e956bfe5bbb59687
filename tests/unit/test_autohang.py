"""The learned hang deadline (``AutoHangProbe``) with a fake clock: no thread, no process."""

from __future__ import annotations

import sys

import pytest

from fault_tolerant_handlers.autohang import AutoHangProbe


def probe(**kw) -> AutoHangProbe:
    here = sys._getframe()
    return AutoHangProbe(rank=1, pid=42, frame=lambda: here, wall=lambda: 1_700_000_000.0,
                         **{"multiple": 10.0, "first_multiple": 10.0, "floor": 5.0, "warmup": 3, **kw})


def run(p: AutoHangProbe, kind: str, start: float, seconds: float, step=None) -> float:
    p.started(kind, start, step)
    assert p.poll(start + seconds / 2) is None
    p.finished(start + seconds)
    return start + seconds


def test_nothing_during_the_warm_up_even_a_very_long_first_step():
    p = probe()
    p.started("step", 0.0, 1)
    assert p.deadline("step") is None
    assert p.poll(10_000.0) is None


def test_a_step_stuck_after_warm_up_is_reported_at_the_learned_deadline_with_its_stack():
    p = probe()
    t = 0.0
    for step in range(3):
        t = run(p, "step", t, 0.8, step)          # longest step 0.8 s -> deadline max(5, 8) = 8 s
    assert p.deadline("step") == pytest.approx(8.0)
    p.started("step", t, 3)
    assert p.poll(t + 7.9) is None
    found = p.poll(t + 8.01)
    assert found is not None and found.hung_self
    assert found.error.failed_rank == 1 and found.error.exc_type == "RankHung"
    assert "learned deadline of 8.0 s" in found.error.exc_message and "at step 3" in found.error.exc_message
    assert "test_a_step_stuck_after_warm_up" in found.declare.traceback  # the main thread's stack


def test_the_floor_holds_for_fast_steps():
    p = probe()
    t = 0.0
    for _ in range(3):
        t = run(p, "step", t, 0.01)
    assert p.deadline("step") == 5.0


def test_a_long_normal_evaluation_is_not_a_hang_and_teaches_its_own_deadline():
    p = probe()
    t = 0.0
    for _ in range(3):
        t = run(p, "step", t, 0.5)
    # first evaluation: 40 s, far over a step's 5 s deadline, but within first_multiple x that
    assert p.deadline("evaluation") == pytest.approx(50.0)
    p.started("evaluation", t)
    assert p.poll(t + 40.0) is None
    p.finished(t + 40.0)
    assert p.deadline("evaluation") == pytest.approx(400.0)
    assert p.deadline("step") == pytest.approx(5.0)  # steps keep theirs


def test_a_checkpoint_longer_than_any_step_is_learned_once_seen():
    p = probe()
    t = 0.0
    for _ in range(3):
        t = run(p, "step", t, 1.0)
    t = run(p, "checkpoint", t, 30.0)
    p.started("checkpoint", t)
    assert p.poll(t + 299.0) is None
    assert p.poll(t + 300.01) is not None


def test_waiting_in_a_collective_is_the_peers_hang_until_twice_the_deadline(monkeypatch):
    import fault_tolerant_handlers.autohang as autohang

    monkeypatch.setattr(autohang, "waiting_on_peers", lambda frame: True)
    p = probe()
    t = 0.0
    for _ in range(3):
        t = run(p, "step", t, 1.0)
    p.started("step", t)
    assert p.poll(t + 15.0) is None
    assert p.poll(t + 20.01) is not None


@pytest.mark.parametrize("bad", [dict(multiple=0.5), dict(floor=-1.0), dict(warmup=0), dict(warmup=2.5)])
def test_bad_settings_are_refused_naming_the_argument(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        probe(**bad)
