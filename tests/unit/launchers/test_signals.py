"""The signal handler with a real signal sent to this process and a fake session over a HashStore:
the record is published before the previous handler runs, which still runs."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fault_tolerant_handlers.launchers import reports, signals
from fault_tolerant_handlers.core.procfs import PeerPidProbe
from fault_tolerant_handlers.core.failure import Ended, FailureRecord, FailureState
from fault_tolerant_handlers.core.schema import Connection, Schema
from fault_tolerant_handlers.core.procfs import RankTable

# The reaction runs in the signal thread when it wakes before the main thread's handler: a failure
# there (an assertion, pytest.fail) fails the test, not a warning beside a pass.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


class FakeSession:
    rank, host, group = 1, "node-a", None
    table = RankTable(1, (0, 1), (7, 8), ("node-a", "node-a"))

    def __init__(self, store):
        self.store = store
        self.schema = Schema(self.connection("main", timedelta(seconds=1)), 2)
        self.consumed = 0
        self.delivered = frozenset()
        self.failure = FailureState()
        self.same_host_probe = PeerPidProbe([], by=1, host="node-a")
        self.pg_store = None

    def connection(self, name, timeout):
        return Connection(lambda: dist.PrefixStore("fth/t", self.store), timeout, name)

    def failure_report(self, wait):
        return self.failure.peer_error  # nothing being explained in these scenarios

    def peer_records(self, schema, indices):  # no agreement has ended in these scenarios
        return [r for r in (schema.read(i) for i in indices) if r is not None and r.rank != self.rank]


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in signals.SIGNALS}
    # none during the test: the test's watch wakes its own thread, not a watch an earlier test left
    # installed (whose thread, its handler never entered, took this test's main thread as blocked)
    old_fd = signal.set_wakeup_fd(-1)
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    signal.set_wakeup_fd(old_fd)


def _releases(monkeypatch):
    """The functions that called ``release_process_groups``, whichever thread they ran in: the
    reaction (``_react``), or the signal thread's check of a main thread that looks blocked
    (``_unblock``: a main thread more than ``MAIN_STUCK_WAIT`` late to its handler on a loaded
    machine stands at the same instruction, and is released as one blocked in C)."""
    callers = []
    monkeypatch.setattr(signals, "release_process_groups",
                        lambda store: callers.append(sys._getframe(1).f_code.co_name) or "nothing")
    return callers


def _deliver(sig):
    os.kill(os.getpid(), sig)
    for _ in range(100):  # the handler runs in this (main) thread at the next bytecode
        time.sleep(0.01)


def test_signal_is_published_then_the_users_handler_runs(restore_signals, monkeypatch):
    released = []
    monkeypatch.setattr(signals, "release_process_groups", lambda store: released.append(True) or "nothing")
    seen = []
    store = dist.HashStore()
    session = FakeSession(store)

    def users_handler(signum, frame):
        # by now the peers can read it
        records = [session.schema.read(i) for i in session.schema.new_indices(0, session.schema.count())]
        seen.append((signum, [(r.exc_type, r.rank, r.exc_message) for r in records]))

    signal.signal(signal.SIGTERM, users_handler)
    watch = signals._Watch(session)
    watch.install()
    assert signal.getsignal(signal.SIGTERM) == watch._handler
    _deliver(signal.SIGTERM)
    assert seen and seen[0][0] == signal.SIGTERM
    kinds = seen[0][1]
    assert len(kinds) == 1 and kinds[0][:2] == ("RankSignalled", 1) and "received SIGTERM" in kinds[0][2]
    assert watch.kind == "cause" and session.failure.local
    assert released == [True]  # a Python handler runs next: this rank's collectives were released


def test_sigint_still_raises_keyboard_interrupt_and_reacts_once(restore_signals, monkeypatch):
    monkeypatch.setattr(signals, "release_process_groups", lambda store: "nothing")
    session = FakeSession(dist.HashStore())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    watch = signals._Watch(session)
    watch.install()
    with pytest.raises(KeyboardInterrupt):
        _deliver(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        _deliver(signal.SIGINT)
    assert session.schema.count() == 1  # one record, whatever the number of signals


def test_a_signal_after_a_peers_failure_publishes_nothing(restore_signals, monkeypatch):
    released = _releases(monkeypatch)
    store = dist.HashStore()
    session = FakeSession(store)
    try:
        raise ValueError("bad sample 17")
    except ValueError as exc:
        session.schema.publish(FailureRecord.from_exception(exc, rank=0, section="train"))
    calls = []
    signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))
    watch = signals._Watch(session)
    watch.install()
    _deliver(signal.SIGTERM)
    assert calls == [signal.SIGTERM]
    assert watch.done.is_set() and watch.kind == "consequence" and session.schema.count() == 1
    assert "_react" not in released  # a consequence leaves the collectives to the failure's path


def _signalled_peer(store, name, at_ms):
    session = FakeSession(store)
    session.schema.publish(FailureRecord.declared(rank=0, kind="RankSignalled", by=0, pid=4242, host="node-a",
                                                  message=f"rank 0 (pid 4242 on node-a) received {name}",
                                                  time_ms=at_ms, ended=Ended(signal=signal.Signals[name])))
    return session


def test_a_signal_every_rank_received_at_once_is_each_ranks_own(restore_signals, monkeypatch):
    """Ctrl-C in a terminal: rank 0's record of the same SIGINT at the same moment does not make
    rank 1 a consequence; it publishes its own."""
    monkeypatch.setattr(signals, "release_process_groups", lambda store: "nothing")
    session = _signalled_peer(dist.HashStore(), "SIGINT", int(time.time() * 1000))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    watch = signals._Watch(session)
    watch.install()
    with pytest.raises(KeyboardInterrupt):
        _deliver(signal.SIGINT)
    assert watch.kind == "cause" and session.schema.count() == 2
    assert session.schema.read(2).exc_message.startswith("rank 1 (pid ") and session.schema.read(2).rank == 1


def test_a_launchers_sigterm_after_a_signalled_peer_left_is_a_consequence(restore_signals, monkeypatch):
    """Rank 0 was SIGTERMed by the user and exited; the launcher's SIGTERM reaches rank 1 after
    rank 0's linger: a consequence, nothing published."""
    released = _releases(monkeypatch)
    session = _signalled_peer(dist.HashStore(), "SIGTERM", int((time.time() - signals.CAUSE_LINGER) * 1000))
    calls = []
    signal.signal(signal.SIGTERM, lambda s, f: calls.append(s))
    watch = signals._Watch(session)
    watch.install()
    _deliver(signal.SIGTERM)
    assert calls == [signal.SIGTERM] and watch.done.is_set() and watch.kind == "consequence"
    assert session.schema.count() == 1 and "_react" not in released


def test_an_ignored_signal_stays_ignored(restore_signals):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch = signals._Watch(FakeSession(dist.HashStore()))
    watch.install()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


@pytest.mark.parametrize("previous", ["default", "users"])
def test_at_exit_only_a_rank_that_failed_itself_ignores_sigterm_and_only_where_its_action_was_the_default(
        restore_signals, monkeypatch, previous):
    """The exit hook is registered where SIGTERM's action was the default; it ignores SIGTERM after this
    rank's own failure only (a launcher's SIGTERM during teardown would end it with -15)."""
    hooked = []
    monkeypatch.setattr(signals.atexit, "register", hooked.append)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous == "default" else (lambda signum, frame: None))
    signals._Watch(FakeSession(dist.HashStore())).install()
    assert hooked == ([reports.ignore_sigterm_if_failed] if previous == "default" else [])
    monkeypatch.setattr(reports, "own_failure", None)
    reports.ignore_sigterm_if_failed()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # a healthy rank: SIGTERM still ends it
    monkeypatch.setattr(reports, "own_failure", FailureRecord.from_exception(ValueError("bad sample 17"), rank=1,
                                                                             section="train"))
    reports.ignore_sigterm_if_failed()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_not_installed_outside_the_main_thread(restore_signals, monkeypatch):
    monkeypatch.setattr(signals, "_watch", None)
    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=signals.install, args=(FakeSession(dist.HashStore()),))
    t.start()
    t.join()
    assert signals._watch is None and signal.getsignal(signal.SIGTERM) == before


class _Os:
    """``os`` for the signals module, with ``kill`` recorded instead of sent (SIGTERM's default would
    end the test process)."""

    def __init__(self):
        self.killed = []

    def getpid(self):
        return os.getpid()

    def kill(self, pid, signum):
        self.killed.append(signum)


def _in_front(watch, calls):
    """A framework's handler installed after the session's, chaining to it (as Lightning's does)."""
    def framework(signum, frame):
        calls.append(signum)
        watch._handler(signum, frame)

    signal.signal(signal.SIGTERM, framework)


@pytest.mark.parametrize("framework_in_front", [True, False])
def test_a_handler_put_in_front_decides_what_sigterm_does(restore_signals, monkeypatch, framework_in_front):
    monkeypatch.setattr(signals, "release_process_groups", lambda store: "nothing")
    fake_os = _Os()
    monkeypatch.setattr(signals, "os", fake_os)
    monkeypatch.setattr(signals, "CAUSE_LINGER", 0.0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    session = FakeSession(dist.HashStore())
    watch = signals._Watch(session)
    watch.install()
    calls = []
    if framework_in_front:
        _in_front(watch, calls)
        _deliver(signal.SIGTERM)
        assert calls == [signal.SIGTERM] and fake_os.killed == []  # the framework's handler says what SIGTERM does
    else:
        watch._handler(signal.SIGTERM, None)  # as delivered: SIG_DFL was the previous handler
        assert fake_os.killed == [signal.SIGTERM]  # its default still ends the process
    assert watch.kind == "cause" and session.schema.count() == 1
    own = watch.cause
    assert own is not None and own.exc_type == "RankSignalled" and own.failed_rank == 1


@pytest.mark.parametrize("framework_in_front, age", [(True, 0.0), (True, 0.8), (True, 5.0), (False, 0.0), (False, 0.6)])
def test_a_peer_signalled_at_the_same_moment_is_the_same_preemption(restore_signals, monkeypatch,
                                                                   framework_in_front, age):
    monkeypatch.setattr(signals, "release_process_groups", lambda store: "nothing")
    monkeypatch.setattr(signals, "os", _Os())
    monkeypatch.setattr(signals, "CAUSE_LINGER", 0.0)
    session = FakeSession(dist.HashStore())
    record = FailureRecord.declared(rank=0, kind="RankSignalled", message="rank 0 (pid 7 on node-a) received SIGTERM",
                                    by=0, pid=7, host="node-a", ended=Ended(signal=signal.SIGTERM))
    record = dataclasses.replace(record, time_ms=record.time_ms - int(age * 1000))
    session.schema.publish(record)
    signal.signal(signal.SIGTERM, lambda s, f: None)
    watch = signals._Watch(session)
    watch.install()
    if framework_in_front:
        _in_front(watch, [])
    _deliver(signal.SIGTERM)
    together = age <= (signals.SIGNALLED_TOGETHER if framework_in_front else signals.SAME_DELIVERY)
    # signalled with the job (a preemption: its own record too), or ended after the peer's signal
    assert watch.kind == ("cause" if together else "consequence"), watch.kind
    assert session.schema.count() == (2 if together else 1)


class _StoreGoneSession(FakeSession):
    """Rank 1 on node-b; the store (and rank 0) on node-a, which now refuses connections."""

    def __init__(self, store_host_ids, store_rank=0):
        super().__init__(dist.HashStore())
        self.table = RankTable(1, (0, 1), (4242, 77), ("node-a", "node-b"), host_ids=tuple(store_host_ids))
        self.store_rank = store_rank  # None: a store on a host of its own
        self.store_address = ("10.0.0.9", 29400)

    def connection(self, name, timeout):
        def refused():
            raise signals.StoreUnreachable("the store at 10.0.0.1:29500 is unreachable: [Errno 111] Connection refused")
        return Connection(refused, timeout, name)


def test_a_sigterm_from_another_host_after_the_store_host_died_names_the_store_host():
    """torchrun's agent SIGTERMs rank 1 when its rendezvous store (on node-a) is gone, before rank 1's
    broken collective is explained: the store refusing connections names rank 0, not rank 1's signal."""
    found = signals._Watch._records(_StoreGoneSession([11, 22]))
    assert found is not None and found.failed_rank == 0 and found.exc_type == "PeerLost"
    assert found.exc_message == ("rank 0 (pid 4242 on node-a) lost: its host, which holds the c10d store, no longer "
                                 "accepts connections ([Errno 111] Connection refused)")
    assert signals._Watch._records(_StoreGoneSession([11, 11])) is None  # same host: the pid check decides


def test_a_sigterm_after_a_store_on_a_host_of_its_own_died_names_no_rank():
    """The store runs on a host no rank runs on: its loss is nobody's, and blaming rank 0 (whose host
    lives) would be a wrong culprit; with spares, a spare would be called for a rank that lives."""
    found = signals._Watch._records(_StoreGoneSession([11, 22], store_rank=None))
    assert found is not None and found.failed_rank is None and found.kind.value == "StoreLost"
    assert found.exc_message == ("the c10d store at 10.0.0.9:29400, on a host of no rank's, is lost: it no longer "
                                 "accepts connections ([Errno 111] Connection refused)")
