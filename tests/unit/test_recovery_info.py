"""Recovery made visible, in one process: the frozen :class:`RecoveryInfo`, the
history and subscriptions of :mod:`fault_tolerant_handlers.core.recoveries`, the kind a cause carries,
and the adapters' translation (Ignite events on an engine, Lightning hooks by name). The moments of a
real recovery on real ranks: ``tests/distributed/test_recovery_events.py``."""

from __future__ import annotations

import dataclasses

import pytest

from fault_tolerant_handlers import (RecoveryCause, RecoveryInfo, RecoveryMetrics, RecoveryPhase, on_recovery,
                                     recovery_history)
from fault_tolerant_handlers.core import recoveries
from fault_tolerant_handlers.core.errors import HangInterrupted
from fault_tolerant_handlers.core.failure import PeerFailedError
from fault_tolerant_handlers.errors import FailureKind

CAUSE = RecoveryCause(1, "ValueError", "bad sample 42", "", "train", 0, step=37)


@pytest.fixture(autouse=True)
def _fresh():
    recoveries.forget()
    yield
    recoveries.forget()


def info(phase=RecoveryPhase.FAILURE_SEEN, **kw) -> RecoveryInfo:
    return RecoveryInfo(**{"phase": phase, "attempt": 1, "rank": 0, "cause": CAUSE, **kw})


# -- the data type ------------------------------------------------------------------------------------
def test_a_recovery_info_is_frozen_and_says_what_happened():
    got = info(RecoveryPhase.RECOVERED, seconds=0.25, source="live", step=36, steps_computed_twice=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.step = 3
    assert got.live and got.cause.kind is FailureKind.RAISED
    assert got.describe() == ("[rank 0] recovered, attempt 1, from live state at step 36, 0.25 s: rank 1 failed "
                              "in train: ValueError: bad sample 42")
    # the one failure value, read by the names the recovery documents
    assert (got.cause.message, got.cause.where, got.cause.own, got.cause.not_in_place) == ("bad sample 42", "train",
                                                                                           False, "")
    unknown = PeerFailedError.from_records([]).record
    assert unknown.kind is FailureKind.UNKNOWN and unknown.describe().startswith("a rank failed: unknown: ")
    assert hash(got) == hash(dataclasses.replace(got))  # frozen: usable as a key


# -- history, subscriptions, the loop that carried on ----------------------------------------------------
def _recover(source: str, step: int | None) -> None:
    recoveries.announce(info())
    recoveries.announce(info(RecoveryPhase.RECOVERY_STARTED, seconds=0.1, source=source, step=step,
                             steps_computed_twice=0 if source == "live" else None))
    recoveries.announce(info(RecoveryPhase.RECOVERED, seconds=0.4, source=source, step=step,
                             steps_computed_twice=0 if source == "live" else None))


def test_every_moment_is_told_to_subscribers_and_kept_in_order():
    seen = []
    stop = on_recovery(seen.append)
    try:
        _recover("checkpoint", None)
    finally:
        stop()
    assert [i.phase for i in seen] == list(RecoveryPhase)
    assert recovery_history() == tuple(seen)
    recoveries.announce(info())
    assert len(seen) == 3, "unsubscribed"


def test_a_subscriber_that_raises_does_not_stop_the_others(caplog):
    seen = []

    def broken(_):
        raise RuntimeError("a bug in a user's callback")

    stops = [on_recovery(broken), on_recovery(seen.append)]
    try:
        recoveries.announce(info())
    finally:
        for stop in stops:
            stop()
    assert len(seen) == 1 and "a bug in a user's callback" in caplog.text


def test_on_recovery_takes_a_callable():
    with pytest.raises(TypeError, match=r"on_recovery\(callback\): callback must be a callable taking a "
                                        r"RecoveryInfo, got 'print'"):
        on_recovery("print")


def test_the_loop_that_carried_on_from_a_checkpoint_completes_the_recovered_info_once():
    assert recoveries.carried_on(30, 36) is None  # no recovery yet: the first attempt's loop
    _recover("checkpoint", None)
    got = recoveries.carried_on(30, 36)
    assert (got.step, got.steps_computed_twice, got.source) == (30, 6, "checkpoint")
    assert recovery_history()[-1] == got
    assert recoveries.carried_on(0, 36) is None, "a second loop (an evaluator) is not the one that carried on"
    m = recoveries.metrics()
    assert m == RecoveryMetrics(recoveries=1, time_to_recover=0.4, total_time_to_recover=0.4, steps_computed_twice=6,
                                total_steps_computed_twice=6, last=got)
    assert m.as_dict() == {"fault_tolerance/recoveries": 1.0, "fault_tolerance/time_to_recover": 0.4,
                           "fault_tolerance/steps_computed_twice": 6.0}


def test_from_live_state_no_step_is_computed_twice_and_an_unknown_count_stays_unknown():
    _recover("live", 36)
    got = recoveries.carried_on(36, 36)
    assert (got.step, got.steps_computed_twice) == (36, 0)
    recoveries.forget()
    _recover("live", 36)  # a lost rank's shard of 37 was held nowhere: this rank, at 37, computes it again
    assert recoveries.carried_on(36, 37).steps_computed_twice == 1
    recoveries.forget()
    _recover("live", 36)  # a replaced rank (its process new): nothing it completed is computed again
    assert recoveries.carried_on(36, None).steps_computed_twice == 0
    recoveries.forget()
    _recover("checkpoint", None)
    got = recoveries.carried_on(30, None)  # the failed loop was not seen (no adapter)
    assert (got.step, got.steps_computed_twice) == (30, None)
    assert "fault_tolerance/steps_computed_twice" not in recoveries.metrics().as_dict()


def test_no_recovery_no_numbers():
    assert recoveries.metrics() == RecoveryMetrics()
    assert RecoveryMetrics().as_dict() == {"fault_tolerance/recoveries": 0.0}


# -- the kind a cause carries (recover_in_place's view of an exception) -----------------------------------
def test_a_cause_carries_its_kind_through_the_store():
    from fault_tolerant_handlers.core.failure import FailureRecord, FailureState
    from fault_tolerant_handlers.recover.agree import cause_of

    assert cause_of(ValueError("x"), 1).kind is FailureKind.RAISED
    # a hang is the kind the attempt's failure state holds (its watchdog declared it), not the exception's type
    state = FailureState()
    state.failed_here(FailureRecord.declared(rank=1, kind=FailureKind.RANK_HUNG, message="hung", by=1), told=False)
    assert cause_of(HangInterrupted("RankHung: rank 1"), 1).kind is FailureKind.RAISED
    assert cause_of(HangInterrupted("RankHung: rank 1"), 1, [state]).kind is FailureKind.RANK_HUNG
    assert cause_of(ValueError("x"), 1, [state]).kind is FailureKind.RANK_HUNG
    peer = PeerFailedError(1, "RankHung", "no progress", origin="declared")
    assert cause_of(peer, 0, [state]).kind is FailureKind.RANK_HUNG
    hung = cause_of(HangInterrupted("RankHung: rank 1"), 1, [state])
    assert (hung.exc_type, hung.message, hung.own) == ("RankHung", "hung", True)  # the record its watchdog declared
    # this rank's own signal, as its failure state holds it: not recovered in place, whatever it raised
    from fault_tolerant_handlers.recover.agree import NOT_IN_PLACE
    signalled = FailureState()
    signalled.signalled(PeerFailedError.from_records([FailureRecord.declared(
        rank=0, kind=FailureKind.RANK_SIGNALLED, message="rank 0 received SIGTERM", by=0)]))
    own = cause_of(RuntimeError("interrupted"), 0, [signalled])
    assert own.kind is FailureKind.RANK_SIGNALLED and own.not_in_place == NOT_IN_PLACE[FailureKind.RANK_SIGNALLED]
    assert not cause_of(RuntimeError("interrupted"), 0).not_in_place
    assert RecoveryCause.from_json(hung.to_json(), 2) == hung
    assert RecoveryCause.from_json(hung.to_json(), 2).kind is FailureKind.RANK_HUNG  # the codec reads a FailureKind back
    forged = hung.to_json().replace(b'"RankHung"', b'"Bogus"')
    assert RecoveryCause.from_json(forged, 2) is None  # a kind that is none: the cause is not believed at all
    replacement = FailureRecord.replaced(1, "replaced")
    assert RecoveryCause.from_json(replacement.to_json(), 2) == replacement  # the keeper's and a spare's
    assert replacement.kind is FailureKind.RANK_REPLACED and replacement.own


def test_the_cause_a_recovery_tells_is_the_failure_record_the_peers_raise_with():
    """One failure value: what a recovery tells (``RecoveryInfo.cause``) is the record a
    ``PeerFailedError`` carries, with the agreement's judgement on it, not a second form."""
    from fault_tolerant_handlers.core.failure import FailureRecord
    from fault_tolerant_handlers.recover.agree import cause_of

    record = FailureRecord.from_exception(ValueError("bad sample 42"), rank=1, section="train", step=37)
    cause = cause_of(PeerFailedError.from_records([record]), 0)
    assert RecoveryCause is FailureRecord and dataclasses.replace(cause, own=False, not_in_place="") == record
    assert (cause.rank, cause.kind, cause.message, cause.where, cause.step, cause.own) == (
        1, FailureKind.RAISED, "bad sample 42", "train", 37, False)
    assert cause.traceback and cause.pid and cause.host  # what the record knows, the recovery tells too


# -- the adapters' translation --------------------------------------------------------------------------
def test_ignite_events_are_registered_and_fired_on_the_failed_and_the_next_engine():
    from ignite.engine import Engine

    from fault_tolerant_handlers.core import attempts
    from fault_tolerant_handlers.ignite import FaultTolerance, FaultToleranceEvents

    failed = Engine(lambda e, b: None)
    FaultTolerance().attach(failed)
    assert isinstance(failed.state.fault_tolerance, RecoveryMetrics)
    seen = []
    for event in FaultToleranceEvents:
        failed.add_event_handler(event, lambda e, n=event.name: seen.append(("failed", n, e.state.fault_tolerance.last)))
    recoveries.announce(info())
    recoveries.announce(info(RecoveryPhase.RECOVERY_STARTED, source="checkpoint"))
    attempts.set_in_place(1)
    try:
        recoveries.announce(info(RecoveryPhase.RECOVERED, seconds=0.4, source="checkpoint"))
        nxt = Engine(lambda e, b: None)
        FaultTolerance().attach(nxt)
        nxt.add_event_handler(FaultToleranceEvents.RECOVERED,
                              lambda e: seen.append(("next", "RECOVERED", e.state.fault_tolerance.last)))
        nxt.run([0, 1], max_epochs=1)
    finally:
        attempts.set_in_place(0)
    assert [(w, n) for w, n, _ in seen] == [("failed", "FAILURE_SEEN"), ("failed", "RECOVERY_STARTED"),
                                          ("next", "RECOVERED")]
    assert seen[2][2].step == 0 and nxt.state.fault_tolerance.recoveries == 1


def test_lightning_hooks_are_called_by_name_on_callbacks_and_the_module():
    from types import SimpleNamespace

    from fault_tolerant_handlers.lightning import dispatch

    calls = []

    class Hooked:
        def on_recovered(self, trainer, pl_module, got):
            calls.append(("callback", pl_module, got))

    module = SimpleNamespace(on_recovered=lambda got: calls.append(("module", None, got)))
    trainer = SimpleNamespace(callbacks=[object(), Hooked()], lightning_module=module)
    got = info(RecoveryPhase.RECOVERED)
    dispatch(trainer, "on_recovered", got)
    assert calls == [("callback", module, got), ("module", None, got)]
