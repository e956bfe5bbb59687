"""The failure state of one attempt (core/failure.py) and the one tag on an exception, as scenarios
of one attempt on one rank. No process group: the state is plain Python."""

from __future__ import annotations

import pickle
import threading

import pytest

from fault_tolerant_handlers.core.failure import (Ended, FailureKind, FailureRecord, FailureState, PeerFailedError,
                                                  TAG_ATTR, Tag, tag, tag_of)


def own_record(message: str = "bad sample 17") -> FailureRecord:
    try:
        raise ValueError(message)
    except ValueError as exc:
        return FailureRecord.from_exception(exc, rank=1, section="train", step=5)


def peer(rank: int = 0, kind: FailureKind = FailureKind.PEER_LOST) -> PeerFailedError:
    return PeerFailedError(rank, kind.value, f"rank {rank} is gone", where="a collective", origin="declared",
                           kind=kind, ended=Ended(signal=9) if kind is FailureKind.PEER_LOST else None)


def signal_cause() -> PeerFailedError:
    return PeerFailedError(1, FailureKind.RANK_SIGNALLED.value, "rank 1 received SIGTERM", origin="declared",
                           kind=FailureKind.RANK_SIGNALLED, ended=Ended(signal=15))


def test_a_healthy_attempt_has_not_failed():
    state = FailureState()
    assert not state.failing and state.cause is None


def test_a_rank_that_fails_itself_is_the_cause_and_the_job_has_failed():
    state = FailureState()
    record = own_record()
    state.failed_here(record)
    assert state.cause is record and state.cause.kind is FailureKind.RAISED
    assert state.local and state.delivered and state.failing


def test_a_peers_failure_learned_after_this_rank_failed_itself_does_not_replace_its_own_cause():
    state = FailureState()
    record = own_record()
    state.failed_here(record)
    lost = peer(0)
    assert state.peer_failed(lost) is None  # this rank raises its own error: nothing to escalate
    assert state.cause is record
    assert state.peer_error is lost  # what the watchdog knows, still readable


def test_a_peers_failure_found_while_training_is_escalated_once():
    state = FailureState()
    first, again = peer(0), peer(2)
    incident = state.peer_failed(first)
    assert incident is not None and incident.peer_error is first and not incident.acknowledged.is_set()
    assert state.cause is first.record and state.failing
    assert not state.delivered  # the main thread has not taken it yet
    assert state.peer_failed(again) is None  # already known in this incident
    assert state.cause is first.record


def test_the_main_thread_taking_a_peers_failure_acknowledges_every_escalated_incident():
    state = FailureState()
    lost = peer(0)
    incident = state.peer_failed(lost)
    state.acknowledged(lost)
    assert incident.acknowledged.is_set()


def test_after_its_own_signal_a_peers_failure_is_a_consequence_not_escalated():
    state = FailureState()
    cause = signal_cause()
    assert state.signalled(cause) is True
    assert state.signal is cause and state.local and state.delivered
    assert state.peer_failed(peer(0)) is None
    assert state.peer_error is None and state.cause is cause.record
    assert state.cause.kind is FailureKind.RANK_SIGNALLED and state.cause.ended == Ended(signal=15)
    assert state.signalled(signal_cause()) is False  # one signal is the cause; a second changes nothing
    assert state.signal is cause


def test_acknowledging_an_agreements_error_marks_that_agreements_incident_not_the_fresh_one():
    """The watchdog found a peer's failure during an agreement; the agreement delivered it; a fresh
    incident began. The main thread takes the error afterwards: the incident acknowledged is the
    agreement's, and the fresh one stays watchful (else the next failure would never be released)."""
    state = FailureState()
    lost = peer(0)
    escalated = state.peer_failed(lost)
    ended = state.agreement_ended(True, lost)
    assert ended is escalated
    tag(lost, incident=ended)
    fresh = state._incident
    assert fresh is not ended and fresh.peer_error is None and not fresh.local
    state.acknowledged(lost)
    assert ended.acknowledged.is_set() and not fresh.acknowledged.is_set()


def test_a_failure_user_code_caught_leaves_the_job_failed_but_never_blinds_the_watchdog():
    state = FailureState()
    first = peer(0)
    state.agreement_ended(True, first)  # a fail_together section raised it; the user caught it
    assert state.cause is first.record
    state.acknowledged(first)
    assert state.delivered and state.failing and state.peer_error is None
    later = peer(2)
    incident = state.peer_failed(later)
    assert incident is not None  # escalated: the main thread is told again
    assert state.cause is first.record


def test_an_agreement_in_which_nobody_failed_changes_nothing_but_the_incident():
    state = FailureState()
    before = state._incident
    assert state.agreement_ended(False) is before
    assert state._incident is not before and not state.failing and state.cause is None


def test_a_hang_found_by_the_watchdog_is_this_ranks_failure_before_its_main_thread_knows():
    state = FailureState()
    hung = FailureRecord.declared(rank=1, kind=FailureKind.RANK_HUNG, message="rank 1 hung", by=1, pid=8,
                                  host="node-a")
    state.failed_here(hung, told=False)
    assert state.local and not state.delivered
    assert state.peer_failed(peer(0)) is None  # it fails itself: a peer's failure is not escalated
    state.failed_here(own_record("HangInterrupted"))  # the main thread, interrupted, publishes its exception
    assert state.cause is hung and state.delivered


def test_concurrent_findings_of_one_failure_are_escalated_once():
    state = FailureState()
    start = threading.Barrier(8)
    escalated = []

    def find(rank):
        start.wait()
        if state.peer_failed(peer(rank)) is not None:
            escalated.append(rank)

    threads = [threading.Thread(target=find, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(escalated) == 1 and state.cause is state.peer_error.record


def test_a_peers_error_carries_one_failure_value_through_a_pickle():
    """Every attribute of ``PeerFailedError`` is read from the one record it carries; a pickle (a
    launcher shipping it between processes) keeps it whole."""
    record = own_record()
    err = PeerFailedError.from_records([record])
    assert err.record is record
    assert (err.failed_rank, err.exc_type, err.exc_message, err.section, err.step, err.kind) == \
        (1, "ValueError", "bad sample 17", "train", 5, FailureKind.RAISED)
    assert err.failed_at == record.time_ms / 1000 and err.pid == record.pid and err.remote_traceback == record.traceback
    again = pickle.loads(pickle.dumps(err))
    assert again.record == record and str(again) == str(err) and again.where == err.where


# -- the tag ----------------------------------------------------------------------------------------
def test_one_tag_carries_everything_learned_of_an_exception():
    exc = ValueError("bad sample 17")
    assert tag_of(exc) == Tag() and tag_of(None) == Tag()
    record = own_record()
    tag(exc, record=record)
    tag(exc, agreed=True)
    tag(exc, handled=True)
    assert tag_of(exc) == Tag(record=record, agreed=True, handled=True)
    assert [name for name in vars(exc) if name.startswith("_fth")] == [TAG_ATTR]


def test_a_misspelt_tag_field_is_an_error_not_a_silent_no_op():
    with pytest.raises(TypeError):
        tag(ValueError(), agred=True)


def test_an_exception_that_refuses_attributes_is_left_alone():
    class Frozen(Exception):
        def __setattr__(self, name, value):
            raise AttributeError(name)

    exc = Frozen()
    tag(exc, handled=True)
    assert tag_of(exc) == Tag()


# -- what the state machine fixes ---------------------------------------------------------------------
def test_a_signal_taken_while_an_agreement_ends_leaves_the_job_failed(monkeypatch):
    """This rank's SIGTERM is the job's cause; its reaction (thread ``fth-signals``) marks the job
    failed just as the main thread ends an agreement in which nobody failed. The job stays failed
    (so its exit does not wait on a store that may be leaving, and peers ending are expected).
    Before, the agreement wrote back the flag it had read before the signal
    (``failed_before = failed_before or failed``) and the signal was forgotten."""
    from fault_tolerant_handlers.core import session as session_mod

    session = session_mod.Session.__new__(session_mod.Session)
    session._seq = session.live_seq = 0
    session.failure = FailureState()
    cause = signal_cause()
    # the agreement found that nobody failed; the signal thread reacts before the agreement ends
    monkeypatch.setattr(session, "_agree", lambda *a: (session.failure.signalled(cause), (False, None))[1],
                        raising=False)
    session.agree("loop", "train: iteration", step=3)
    assert session.failure.signal is cause
    assert session.failure.delivered and session.failure.failing
    assert session.failure.cause is cause.record


def test_the_state_keeps_a_failure_as_data_never_the_exception_that_pins_an_attempts_frames():
    """A peer's error raised through the training loop carries a traceback (the loop's frames: its
    model, its loaders). The state keeps what it says, not the object, so a failed attempt's frames
    are freed with it (recovering in place, the next attempt starts with the same fds and threads)."""
    import gc
    import weakref

    state = FailureState()

    class Frames:  # stands for what the attempt's frames hold
        pass

    def attempt():
        held = Frames()  # noqa: F841 - a local of the frame the traceback keeps
        raise peer(0)

    try:
        attempt()
    except PeerFailedError as err:
        state.acknowledged(err)
        frames = weakref.ref(err.__traceback__.tb_next.tb_frame.f_locals["held"])
    gc.collect()
    assert frames() is None
    assert state.cause.kind is FailureKind.PEER_LOST and state.cause.rank == 0 and state.cause.ended == Ended(signal=9)
