"""The Ignite handler in one process: a no-op that changes nothing, clear errors, state."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist
from ignite.engine import Engine, Events

from fault_tolerant_handlers.ignite import FaultTolerance


def test_without_distribution_the_run_is_unchanged(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not dist.is_initialized()
    seen = []
    trainer = Engine(lambda e, b: seen.append(b))
    handler = FaultTolerance(sync_every=1).attach(trainer)
    assert isinstance(handler, FaultTolerance)
    trainer.run([1, 2, 3], max_epochs=2)
    assert seen == [1, 2, 3, 1, 2, 3]
    assert handler.guard.session is None


def _engine_failing_at(batch_no: int, epoch: int = 1) -> Engine:
    def step(engine, batch):
        if batch == batch_no and engine.state.epoch == epoch:
            raise ValueError(f"bad sample {batch_no}")

    return Engine(step)


def test_without_distribution_an_exception_is_raised_as_by_stock_ignite(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    trainer = _engine_failing_at(3)
    FaultTolerance().attach(trainer)  # the only EXCEPTION_RAISED handler
    with pytest.raises(ValueError, match="bad sample 3"):
        trainer.run([1, 2, 3, 4], max_epochs=2)
    assert trainer.state.epoch == 1 and trainer.state.iteration == 3


def test_without_distribution_a_user_exception_handler_decides_as_in_stock_ignite(monkeypatch):
    """One process, no peer to wait: the user's handler takes the exception, exactly as without ours."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    outcomes = []
    for attach in (False, True):
        trainer = _engine_failing_at(3)
        handled = []
        trainer.add_event_handler(Events.EXCEPTION_RAISED, lambda e, exc, h=handled: h.append(str(exc)))
        if attach:
            FaultTolerance().attach(trainer)
        trainer.run([1, 2, 3, 4], max_epochs=2)  # stock Ignite: no exception, the run goes on
        outcomes.append((handled, trainer.state.epoch, trainer.state.iteration))
    assert outcomes[0] == (["bad sample 3"], 2, 7)
    assert outcomes[1] == outcomes[0]


def test_stock_ignite_swallows_it_and_continues():
    """The rule the handler guards against: stock Ignite with an EXCEPTION_RAISED handler."""
    def step(engine, batch):
        if batch == 3 and engine.state.epoch == 1:
            raise ValueError("bad sample 3")

    trainer = Engine(step)
    trainer.add_event_handler(Events.EXCEPTION_RAISED, lambda e, exc: None)
    trainer.run([1, 2, 3, 4], max_epochs=2)  # no exception
    assert trainer.state.epoch == 2


@pytest.mark.parametrize(
    "kwargs, error, says",
    [
        ({"sync_every": 0}, ValueError, r"FaultTolerance\(sync_every=\.\.\.\) must be a positive int"),
        ({"sync_every": 2.5}, ValueError, r"FaultTolerance\(sync_every=\.\.\.\) must be a positive int"),
        ({"hang_timeout": "5m"}, TypeError, r"FaultTolerance\(hang_timeout=\.\.\.\) must be None \(off\), a datetime.timedelta"),
        ({"hang_timeout": "automatic"}, TypeError, r"FaultTolerance\(hang_timeout=\.\.\.\) must be None \(off\), a "
                                              r"datetime.timedelta \(e.g. timedelta\(minutes=5\)\), .* or 'auto'"),
        ({"hang_timeout": 0.5}, ValueError, r"FaultTolerance\(hang_timeout=\.\.\.\) must be between 1 and 604800 seconds"),
        ({"hang_timeout": timedelta(0)}, ValueError, r"FaultTolerance\(hang_timeout=\.\.\.\) must be between 1 and 604800 seconds"),
        ({"watchdog": "yes"}, TypeError, r"FaultTolerance\(watchdog=\.\.\.\) must be True or False"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, says):
    with pytest.raises(error, match=says):
        FaultTolerance(**kwargs)


def test_attach_needs_an_engine():
    with pytest.raises(TypeError, match=r"attach\(engine=...\) takes an ignite.engine.Engine"):
        FaultTolerance().attach("trainer")


def test_state_dict_round_trip_reads_older_checkpoints():
    handler = FaultTolerance()
    other = FaultTolerance()
    other.load_state_dict(handler.state_dict())
    assert other.state_dict() == {}
    other.load_state_dict({"failures_seen": 2})  # written by version 0.1: still loads
    with pytest.raises(TypeError, match="takes a mapping"):
        other.load_state_dict([1])


def test_without_distribution_a_run_terminated_mid_epoch_and_run_again_says_nothing(monkeypatch, caplog, recwarn):
    """Ignite's own ``test_terminate_stops_run_mid_epoch`` / ``test_resume_after_terminate_resets_init_iter``
    shape with the handler attached: terminated at iteration 13 of a 10-iteration epoch over a list,
    run again (it resumes there). Without a process group the handler does nothing, so it says
    nothing either (no resume warning about the list having no state_dict)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []
    engine = Engine(lambda e, b: seen.append(b))
    FaultTolerance().attach(engine)
    stops = [13]

    @engine.on(Events.ITERATION_STARTED)
    def stop_once(e):
        if stops and e.state.iteration == stops[0]:
            stops.pop()
            e.terminate()

    caplog.set_level("DEBUG", logger="fault_tolerant_handlers")
    engine.run(list(range(10)), max_epochs=3)
    assert engine.state.iteration == 13 and engine.state.epoch == 2
    engine.run(list(range(10)), max_epochs=3)  # resumes mid-epoch, as stock Ignite does
    assert engine.state.iteration > 13  # resumed mid-epoch, ran on
    assert not [str(w.message) for w in recwarn.list], [str(w.message) for w in recwarn.list]
    assert not caplog.records, caplog.text


def test_the_cause_is_decided_as_the_trainer_logs_it_never_for_an_evaluator_that_handles_its_own(monkeypatch):
    """The log filter recognises the trainer's own run loop by the frame that caught the exception: an
    evaluator run from a trainer handler, whose EXCEPTION_RAISED handler takes its error, decides nothing."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    evaluator = _engine_failing_at(2)
    evaluator.add_event_handler(Events.EXCEPTION_RAISED, lambda e, exc: None)  # the evaluator goes on
    trainer = _engine_failing_at(3, epoch=2)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: evaluator.run([1, 2, 3]))
    handler = FaultTolerance().attach(trainer)
    decided = []
    monkeypatch.setattr(handler, "_decide", lambda engine, exc: decided.append((engine, str(exc))) or exc)
    with pytest.raises(ValueError, match="bad sample 3"):
        trainer.run([1, 2, 3, 4], max_epochs=2)
    assert decided and all(d == (trainer, "bad sample 3") for d in decided), decided  # the trainer's loop only


def test_attached_twice_an_exception_is_still_raised_as_by_stock_ignite(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    trainer = _engine_failing_at(3)
    handler = FaultTolerance()
    handler.attach(trainer)
    handler.attach(trainer)  # a script's mistake: the engine's own exception path is still the one behind it
    with pytest.raises(ValueError, match="bad sample 3"):
        trainer.run([1, 2, 3, 4], max_epochs=2)
