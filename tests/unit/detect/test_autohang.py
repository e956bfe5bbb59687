"""The learned hang deadline (``hang_timeout="auto"``, ``AutoHangProbe``) with a fake clock: no
thread, no process; and how its settings and the adapters' arguments are checked."""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest

from fault_tolerant_handlers.core import config
from fault_tolerant_handlers.core.failure import FailureKind
from fault_tolerant_handlers.detect.autohang import AutoHangProbe, from_config, writing_checkpoint_explainer


def probe(**kw) -> AutoHangProbe:
    here = sys._getframe()
    return AutoHangProbe(rank=1, pid=42, frame=lambda: here, wall=lambda: 1_700_000_000.0,
                         **{"multiple": 10.0, "first_multiple": 10.0, "floor": 5.0, "warmup": 3, **kw})


def run(p: AutoHangProbe, kind: str, start: float, seconds: float, step=None) -> float:
    p.mark(kind, start, step)
    assert p.poll(start + seconds / 2) is None
    p.mark(None, start + seconds)
    return start + seconds


def steps(p: AutoHangProbe, n: int, seconds: float, t: float = 0.0) -> float:
    for step in range(n):
        t = run(p, "step", t, seconds, step)
    return t


def test_nothing_during_the_warm_up_even_a_very_long_first_step():
    p = probe()
    p.mark("step", 0.0, 1)
    assert p.deadline("step") is None
    assert p.poll(10_000.0) is None


def test_a_step_stuck_after_warm_up_is_reported_at_the_learned_deadline_with_its_stack():
    p = probe()
    t = steps(p, 3, 0.8)                          # longest step 0.8 s -> deadline max(5, 8) = 8 s
    assert p.deadline("step") == pytest.approx(8.0)
    p.mark("step", t, 3)
    assert p.poll(t + 7.9) is None
    found = p.poll(t + 8.01)
    assert found is not None and found.kind is FailureKind.RANK_HUNG
    assert found.failed_rank == 1 and found.exc_type == "RankHung"
    assert "learned deadline of 8.0 s" in found.exc_message and "at step 3" in found.exc_message
    assert "test_a_step_stuck_after_warm_up" in found.record.traceback  # the main thread's stack
    assert found.record.time_ms == int((1_700_000_000.0 - 8.01) * 1000)  # when the step began


def test_warm_up_steps_are_learned_a_slow_first_step_widens_the_deadline():
    p = probe()
    t = run(p, "step", 0.0, 3.0)                  # compilation, DataLoader start-up
    t = steps(p, 2, 0.1, t)
    assert p.deadline("step") == pytest.approx(30.0)


def test_the_floor_holds_for_fast_steps():
    p = probe()
    steps(p, 3, 0.01)
    assert p.deadline("step") == 5.0


def test_marks_chain_pieces_each_ends_the_one_before_and_is_learned_under_its_kind():
    p = probe()
    for step in range(4):
        p.mark("step", float(step), step)         # steps of 1 s, each mark ends the previous one
    p.mark("evaluation", 4.0)                     # the 4th step ends at the epoch end
    p.mark("step", 24.0)                          # a 20 s evaluation
    assert p.steps == 4 and p.longest == {"step": 1.0, "evaluation": 20.0}
    assert p.deadline("evaluation") == pytest.approx(200.0)
    p.mark(None, 25.0)                            # the loop ended: nothing is watched
    assert p.current is None and p.poll(10_000.0) is None


def test_a_long_normal_evaluation_is_not_a_hang_and_teaches_its_own_deadline():
    p = probe()
    t = steps(p, 3, 0.5)
    # first evaluation: 40 s, far over a step's 5 s deadline, but within first_multiple x that
    assert p.deadline("evaluation") == pytest.approx(50.0)
    p.mark("evaluation", t)
    assert p.poll(t + 40.0) is None
    p.mark(None, t + 40.0)
    assert p.deadline("evaluation") == pytest.approx(400.0)
    assert p.deadline("step") == pytest.approx(5.0)  # steps keep theirs


def test_a_checkpoint_longer_than_any_step_is_learned_once_seen():
    p = probe()
    t = steps(p, 3, 1.0)
    t = run(p, "checkpoint", t, 30.0)
    p.mark("checkpoint", t)
    assert p.poll(t + 299.0) is None
    assert p.poll(t + 300.01) is not None


def test_time_the_watchdog_could_not_look_is_neither_held_against_the_piece_nor_learned():
    # the job suspended for 60 s in a step (SIGSTOP to every process): the watchdog's wait of 0.1 s
    # took 60.1 s; the main thread could not run either
    p = probe()
    t = steps(p, 3, 0.4)                          # deadline max(5, 4) = 5 s
    p.mark("step", t, 3)
    assert p.poll(t + 1.0) is None
    p.unobserved.waited(60.1, 0.1)
    assert p.poll(t + 61.5) is None               # 1.5 s observed
    p.mark(None, t + 62.0)                        # the step took 2 s of its own, not 62
    assert p.longest["step"] == pytest.approx(2.0) and p.deadline("step") == pytest.approx(20.0)
    t += 62.0
    p.mark("step", t, 4)                          # a hang after it is found on time
    assert p.poll(t + 19.9) is None
    found = p.poll(t + 20.1)
    assert found is not None and "has run 20.1 s" in found.exc_message


def test_waiting_in_a_collective_is_never_this_ranks_hang(monkeypatch):
    """A peer running a long rank-0-only evaluation keeps this rank in the DDP all_reduce: the peer
    judges itself; this rank, whose deadlines are its own, never declares itself."""
    import fault_tolerant_handlers.detect.autohang as autohang

    monkeypatch.setattr(autohang, "waiting_on_peers", lambda frame: True)
    p = probe()
    t = steps(p, 3, 1.0)
    p.mark("step", t)
    assert p.poll(t + 15.0) is None
    assert p.poll(t + 10_000.0) is None


def test_time_spent_waiting_for_peers_is_not_held_against_the_piece_nor_learned(monkeypatch):
    """Rank 1 waits in the agreement while rank 0 runs a long evaluation, then goes on with its step:
    the step is judged from when it was last seen waiting, and the wait is not a step's duration."""
    import fault_tolerant_handlers.detect.autohang as autohang

    waiting = [True]
    monkeypatch.setattr(autohang, "waiting_on_peers", lambda frame: waiting[0])
    p = probe()
    t = steps(p, 3, 0.1)                          # step deadline: the floor, 5 s
    p.mark("step", t, 3)
    assert p.poll(t + 5.01) is None               # waiting: not a hang, seen waiting at t + 5.01
    assert p.poll(t + 10.02) is None              # still waiting, seen at t + 10.02
    waiting[0] = False                            # the peer is back: the step goes on
    assert p.poll(t + 14.0) is None               # within a deadline of the last time it waited
    assert p.poll(t + 15.03) is None              # over it: no longer waiting, judged from now
    assert p.poll(t + 20.0) is None
    found = p.poll(t + 20.04)
    assert found is not None and "its step at step 3 no progress for 5.0 s" in found.exc_message
    p.mark("step", t + 21.0)
    assert p.longest["step"] == pytest.approx(0.1) and p.steps == 4  # the wait was not learned


def test_a_wait_that_ends_just_before_the_deadline_is_not_held_against_the_piece(monkeypatch):
    """Rank 1 waits in the all_reduce for a hung peer, which is declared (and releases it) just
    before rank 1's own deadline; rank 1 then handles the failure, past its deadline, outside any
    wait: judged from the last poll that saw it waiting, it is not hung."""
    import fault_tolerant_handlers.detect.autohang as autohang

    waiting = [True]
    monkeypatch.setattr(autohang, "waiting_on_peers", lambda frame: waiting[0])
    p = probe()
    t = steps(p, 3, 0.1)                          # step deadline: the floor, 5 s
    p.mark("step", t, 3)
    assert p.poll(t + 0.1) is None
    assert p.poll(t + 4.9) is None                # waiting, seen at t + 4.9
    waiting[0] = False                            # released at t + 4.95
    assert p.poll(t + 5.1) is None                # past the deadline from the step's start, not from the wait
    assert p.poll(t + 9.8) is None
    found = p.poll(t + 9.95)
    assert found is not None and "its step at step 3 has run 9.9 s" in found.exc_message


def test_a_main_thread_in_the_debugger_is_not_hung():
    import bdb

    p = probe()
    t = steps(p, 3, 0.1)
    p.mark("step", t)
    p.frame = sys._getframe  # the poll's caller: a function bdb.py runs, as during a pdb session
    polled = []
    bdb.Bdb().runcall(lambda: polled.append(p.poll(t + 1000.0)))
    assert polled == [None]
    # out of the debugger, the piece has its deadline again (from when it was last seen in it)
    assert p.poll(t + 1005.01) is None
    assert p.poll(t + 1010.03) is not None


def explained_as(kind_and_token):
    return lambda frame: kind_and_token[0]


def test_recognised_work_is_judged_as_its_kind_from_when_it_was_recognised():
    p = probe()
    t = steps(p, 3, 0.1)                          # step deadline 5 s; a checkpoint borrows 10 x 10 x 0.1 = 10 s
    seen = [("checkpoint", None)]
    p.explainers.append(explained_as(seen))
    p.mark("step", t, 3)                       # a checkpoint handler runs inside the step's piece
    assert p.poll(t + 5.01) is None               # over the step deadline: recognised as a checkpoint
    assert p.poll(t + 5.01 + 9.9) is None         # judged from then against the checkpoint deadline
    found = p.poll(t + 5.01 + 10.01)
    assert found is not None
    assert "its checkpoint (within a step) at step 3 no progress for 10.0 s, over the learned deadline of 10.0 s" \
        in found.exc_message


def test_progress_of_recognised_work_re_arms_its_deadline():
    p = probe()
    t = steps(p, 3, 0.1)
    seen = [("evaluation", 0)]
    p.explainers.append(explained_as(seen))
    p.mark("step", t)
    now = t + 5.01
    assert p.poll(now) is None                    # an evaluator engine, at its iteration 0
    for iteration in range(1, 6):                 # each evaluator iteration well within a deadline
        seen[0] = ("evaluation", iteration)
        now += 10.0
        assert p.poll(now) is None
    now += 10.01                                  # stuck at iteration 5 for a whole deadline
    found = p.poll(now)
    assert found is not None and "its evaluation (within a step)" in found.exc_message


def test_when_recognised_work_ends_the_rest_of_the_piece_gets_its_own_deadline_again():
    p = probe()
    t = steps(p, 3, 0.1)
    seen = [("checkpoint", None)]
    p.explainers.append(explained_as(seen))
    p.mark("step", t)
    assert p.poll(t + 5.01) is None               # a checkpoint write: 10 s allowed from here
    seen[0] = None                                # the write is over; the step goes on
    assert p.poll(t + 5.01 + 10.01) is None       # not judged against the piece's start any more
    assert p.poll(t + 5.01 + 10.01 + 4.9) is None
    assert p.poll(t + 5.01 + 10.01 + 5.01) is not None


def test_recognised_work_within_a_step_is_learned_as_its_kind_not_as_a_step():
    p = probe()
    t = steps(p, 3, 0.1)
    p.explainers.append(explained_as([("checkpoint", None)]))
    p.mark("step", t)
    assert p.poll(t + 5.01) is None               # recognised: a checkpoint written inside the step
    p.mark("step", t + 8.0)
    assert p.longest["step"] == pytest.approx(0.1) and p.longest["checkpoint"] == pytest.approx(8.0)
    assert p.steps == 4


def test_the_checkpoint_explainer_recognises_a_marked_write():
    from fault_tolerant_handlers.detect.watchdog import writing_checkpoint

    assert writing_checkpoint_explainer(sys._getframe()) is None
    with writing_checkpoint():
        assert writing_checkpoint_explainer(sys._getframe()) == ("checkpoint", None)



# -- settings -----------------------------------------------------------------------------------------
def test_the_rule_reads_its_environment_overrides(monkeypatch):
    monkeypatch.setenv("FTH_AUTO_HANG_MULTIPLE", "4")
    monkeypatch.setenv("FTH_AUTO_HANG_FLOOR_SEC", "2.5")
    monkeypatch.setenv("FTH_AUTO_HANG_WARMUP", "7")
    p = from_config(0, 1, frame=lambda: None)
    assert (p.multiple, p.floor, p.warmup) == (4.0, 2.5, 7)
    monkeypatch.delenv("FTH_AUTO_HANG_MULTIPLE")
    monkeypatch.delenv("FTH_AUTO_HANG_FLOOR_SEC")
    monkeypatch.delenv("FTH_AUTO_HANG_WARMUP")
    p = from_config(0, 1, frame=lambda: None)
    assert (p.multiple, p.first_multiple, p.floor, p.warmup) == (10.0, 10.0, 60.0, 20)


@pytest.mark.parametrize("variable, value, expected", [
    ("FTH_AUTO_HANG_MULTIPLE", "0.5", "a number from 1 to 1000"),
    ("FTH_AUTO_HANG_MULTIPLE", "inf", "a number from 1 to 1000"),
    ("FTH_AUTO_HANG_FLOOR_SEC", "0.1", "a number from 1 to 604800"),
    ("FTH_AUTO_HANG_WARMUP", "2.5", "an integer from 1 to 1000000"),
    ("FTH_AUTO_HANG_WARMUP", "0", "an integer from 1 to 1000000"),
])
def test_the_rules_variables_are_range_checked_when_the_job_starts(monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}='{value}': expected {expected}"):
        config.load()


def test_hang_timeout_variable_takes_auto(monkeypatch):
    monkeypatch.setenv("FTH_HANG_TIMEOUT_SEC", "auto")
    assert config.load().hang_timeout == "auto"
    monkeypatch.setenv("FTH_HANG_TIMEOUT_SEC", "sometimes")
    with pytest.raises(ValueError, match=r"FTH_HANG_TIMEOUT_SEC='sometimes': expected a number of seconds .* or auto"):
        config.load()


@pytest.mark.parametrize("adapter", ["ignite", "lightning"])
@pytest.mark.parametrize("bad, error", [("automatic", TypeError), ("5m", TypeError), (True, TypeError),
                                        (timedelta(0), ValueError), (0.5, ValueError), ("08:00:00:00", ValueError)])
def test_adapters_refuse_a_bad_hang_timeout_naming_the_choices(adapter, bad, error):
    if adapter == "ignite":
        from fault_tolerant_handlers.ignite import FaultTolerance
    else:
        from fault_tolerant_handlers.lightning import FaultTolerance
    with pytest.raises(error, match=r"FaultTolerance\(hang_timeout=\.\.\.\) must be"):
        FaultTolerance(hang_timeout=bad)
    if error is TypeError:
        with pytest.raises(error, match=r"None \(off\), a datetime.timedelta .* a number of seconds .* "
                                        r"a 'DD:HH:MM:SS' string .* or 'auto'"):
            FaultTolerance(hang_timeout=bad)


@pytest.mark.parametrize("value, expected", [
    (300, timedelta(minutes=5)),
    (2.5, timedelta(seconds=2.5)),
    ("00:00:05:00", timedelta(minutes=5)),
    ("01:02:03:04", timedelta(days=1, hours=2, minutes=3, seconds=4)),
    ({"minutes": 5}, timedelta(minutes=5)),
    ({"hours": 1, "seconds": 30}, timedelta(hours=1, seconds=30)),
    (timedelta(minutes=5), timedelta(minutes=5)),
    ("auto", "auto"),
    (None, None),
])
def test_hang_timeout_takes_seconds_and_lightning_timer_forms(value, expected):
    """What a YAML / LightningCLI / Hydra config gives: a number, Lightning Timer's string or dict."""
    from fault_tolerant_handlers.core.session import Guard
    from fault_tolerant_handlers.ignite import FaultTolerance as IgniteFT
    from fault_tolerant_handlers.lightning import FaultTolerance as LightningFT

    assert config.check_hang_timeout(value) == expected
    assert Guard(hang_timeout=value).hang_timeout == expected  # normalised once, at construction
    assert IgniteFT(hang_timeout=value).guard.hang_timeout == expected
    assert LightningFT(hang_timeout=value).guard.hang_timeout == expected


@pytest.mark.parametrize("bad", [{"minute": 5}, {}, "5:00", "00:00:05:xx", float("nan"), float("inf"), [300], b"300"])
def test_hang_timeout_refuses_other_forms_naming_the_valid_ones(bad):
    with pytest.raises((TypeError, ValueError)) as err:
        config.check_hang_timeout(bad)
    text = str(err.value)
    assert text.startswith("hang_timeout must be ") and text.endswith(f"got {bad!r}")
    if err.type is TypeError:
        for form in ("None (off)", "datetime.timedelta", "a number of seconds", "'DD:HH:MM:SS'", "a dict", "'auto'"):
            assert form in text, text
    else:  # nan, inf: a number, out of range
        assert "between 1 and 604800 seconds" in text


def test_guard_takes_auto_in_any_case():
    from fault_tolerant_handlers.core.session import Guard

    assert Guard(hang_timeout="auto").hang_timeout == "auto"
    assert Guard(hang_timeout="AUTO", owner="Guard").hang_timeout == "auto"  # as join_timeout and the variable
    with pytest.raises(TypeError, match=r"Guard\(hang_timeout=\.\.\.\) must be None \(off\)"):
        Guard(hang_timeout="automatic", owner="Guard")


def test_a_hang_report_in_a_training_step_names_the_step_under_way():
    """The core's Guard knows no detector: the kinds of work whose report names the next step are autohang's."""
    from fault_tolerant_handlers.core.session import Guard
    from fault_tolerant_handlers.detect.autohang import START, STEP

    assert set(Guard.NEXT_STEP_WORK) == {START, STEP}


# -- the Ignite adapter's evaluator recognition ---------------------------------------------------------
def test_an_evaluator_engine_run_from_a_trainer_handler_is_recognised_with_its_iteration():
    from ignite.engine import Engine, Events

    from fault_tolerant_handlers.ignite import FaultTolerance

    ft = FaultTolerance(hang_timeout="auto")
    trainer = Engine(lambda e, b: None)
    ft.attach(trainer)  # no distribution: the handler does nothing, the recognition still works
    seen = []
    evaluator = Engine(lambda e, b: seen.append(ft._nested_engine(sys._getframe())))

    @trainer.on(Events.ITERATION_COMPLETED(every=2))
    def _evaluate(engine):
        seen.append(("trainer", ft._nested_engine(sys._getframe())))
        evaluator.run([0, 1, 2], max_epochs=1)

    trainer.run([0, 1], max_epochs=1)
    assert seen[0] == ("trainer", None)           # the trainer's own handler: not an evaluation
    assert seen[1:] == [("evaluation", (id(evaluator), 1, i)) for i in (1, 2, 3)]
