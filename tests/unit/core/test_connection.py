"""The store connection of the library's own (``schema.Connection``) when the store's host is cut
off: every call is bounded, a silent store's declaration is not held up by a call in flight, a
connect that overruns does not block the next call, and a call that overran keeps its client and
serves again once it returns (fake stores whose calls block on events: no network)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from fault_tolerant_handlers.core import schema
from fault_tolerant_handlers.core.schema import Connection, StoreCallTimeout


class BlockingStore:
    """``add`` blocks until ``release`` is set (a read on a cut link)."""

    def __init__(self, release: threading.Event, answer_at_once: bool = False) -> None:
        self.release = release
        if answer_at_once:
            release.set()

    def set_timeout(self, timeout) -> None:
        pass

    def add(self, key, amount):
        self.release.wait(10)
        return 7


def test_a_call_blocked_on_a_cut_link_returns_within_its_budget_and_keeps_its_client():
    """A call that overruns keeps its client until it returns: the calls after it fail at once
    instead of connecting anew (each new connection costs the store's server a reverse DNS lookup
    in its only thread, for every client: the store of 8 ranks stayed silent for 8 s while every
    rank's timed-out calls connected again). Once it returns, the same client serves again."""
    release = threading.Event()
    made = []
    conn = Connection(lambda: made.append(1) or BlockingStore(release), timedelta(seconds=0.2), "t")
    start = time.monotonic()
    with pytest.raises(StoreCallTimeout):
        conn.call("add", "k", 1)
    assert time.monotonic() - start < 0.2 + Connection.CALL_SLACK + 0.3
    stuck = [w for w in schema._stuck if w._thread.is_alive()]
    assert stuck, "the worker whose call overran is known as stuck (the exit cuts its connections)"
    start = time.monotonic()
    with pytest.raises(StoreCallTimeout, match="the call before this one has not returned yet"):
        conn.call("add", "k", 1)
    assert time.monotonic() - start < 0.1  # at once, and no new client
    assert len(made) == 1
    release.set()  # the blocked read returns
    deadline = time.monotonic() + 2
    while any(w.stuck for w in stuck) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(w in schema._stuck for w in stuck)
    assert conn.call("add", "k", 1) == 7  # the same worker and client serve the next call
    assert len(made) == 1
    conn.close()
    for w in stuck:
        w._thread.join(2)
    assert not any(w._thread.is_alive() for w in stuck)


def test_the_deadline_cuts_a_call_in_flight_short():
    release = threading.Event()
    conn = Connection(lambda: BlockingStore(release), timedelta(seconds=5), "t")
    conn.deadline = time.monotonic() + 0.3
    start = time.monotonic()
    with pytest.raises(StoreCallTimeout):
        conn.call("add", "k", 1)
    took = time.monotonic() - start
    assert 0.25 <= took < 1.0, took  # the deadline, not the 5.5 s budget
    release.set()
    conn.close()


def test_a_connect_that_overruns_does_not_block_the_next_call_and_only_one_runs_at_a_time():
    slow, calls = threading.Event(), []

    def factory():
        calls.append(time.monotonic())
        if len(calls) == 1:
            slow.wait(10)  # the first connect hangs (an unreachable host)
        return BlockingStore(_set())

    conn = Connection(factory, timedelta(seconds=0.2), "t")
    with pytest.raises(StoreCallTimeout):
        conn.call("add", "k", 1)
    start = time.monotonic()
    with pytest.raises(StoreCallTimeout, match="connect is still in progress"):
        conn.call("add", "k", 1)  # fails at once: no second connect while the first is under way
    assert time.monotonic() - start < 0.2 and len(calls) == 1
    assert schema._connects, "the connect under way is known (the exit waits for it)"
    slow.set()
    deadline = time.monotonic() + 2
    while schema._connects and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not schema._connects
    assert conn.call("add", "k", 1) == 7  # then a new connect serves the next call
    conn.close()


def test_unblocking_at_exit_ends_calls_in_flight_when_the_job_failed(monkeypatch):
    release = threading.Event()
    cut = []
    monkeypatch.setattr("fault_tolerant_handlers.core.interrupts.cut_connections_to", lambda ports: (cut.append(ports), release.set()))
    conn = Connection(lambda: BlockingStore(release), timedelta(seconds=5), "t")
    got = []
    caller = threading.Thread(target=lambda: got.append(conn.call("add", "k", 1)))
    caller.start()
    time.sleep(0.2)  # the call is in flight, within its budget
    start = time.monotonic()
    assert schema.unblock_stuck_calls({1234}, wait=1.0, busy_too=True) >= 1
    assert cut == [{1234}] and time.monotonic() - start < 0.5
    caller.join(2)
    assert not caller.is_alive() and got == [7]  # the cut call returned


def _set() -> threading.Event:
    e = threading.Event()
    e.set()
    return e


def test_the_exit_waits_for_a_connect_under_way_which_it_cannot_cut(monkeypatch):
    monkeypatch.setattr("fault_tolerant_handlers.core.interrupts.cut_connections_to", lambda ports: 0)

    def factory():
        time.sleep(1.0)  # c10d retrying a connect to an unreachable host: no socket to shut down
        return BlockingStore(_set())

    conn = Connection(factory, timedelta(seconds=0.2), "t")
    with pytest.raises(StoreCallTimeout):
        conn.call("add", "k", 1)  # gives up after its budget; the connect goes on in its worker
    worker = conn._worker
    schema.unblock_stuck_calls({1234}, wait=0.0, busy_too=True)
    assert not worker._thread.is_alive(), "the exit went on with a thread inside a connect"
    conn.close()


def test_the_exit_waits_for_a_connect_under_way_even_when_the_job_did_not_fail(monkeypatch):
    """A connect still within its call's budget (its worker neither stuck nor to be cut) is waited
    for too: a thread coming back from c10d while the interpreter finalizes aborts the process."""
    monkeypatch.setattr("fault_tolerant_handlers.core.interrupts.cut_connections_to", lambda ports: 0)

    def factory():
        time.sleep(0.6)
        return BlockingStore(_set())

    conn = Connection(factory, timedelta(seconds=2), "t")
    caller = threading.Thread(target=lambda: conn.call("add", "k", 1))
    caller.start()
    time.sleep(0.1)  # the call's connect is under way, well within the 2.5 s budget
    worker = conn._worker
    assert schema.unblock_stuck_calls({1234}, wait=0.0, busy_too=False) == 1
    assert not worker._thread.is_alive() or not schema._connects, "the exit went on with a thread inside a connect"
    assert not schema._connects
    caller.join(2)
    conn.close()


def test_a_connect_is_bounded_by_three_tries_of_its_timeout():
    """The port's probe may be answered late, and c10d's TCP client tries a timed-out connect once
    more: the exit's wait must cover all three."""
    go = threading.Event()
    conn = Connection(lambda: (go.wait(5), BlockingStore(_set()))[1], timedelta(seconds=1), "t")
    caller = threading.Thread(target=lambda: conn.call("add", "k", 1))
    caller.start()
    time.sleep(0.1)
    [(end, thread)] = schema._connects.values()
    assert thread is conn._worker._thread
    assert 3.8 <= end - time.monotonic() <= 4.0  # (the probe + 2 tries) x 1 s + CONNECT_SLACK
    go.set()
    caller.join(2)
    conn.close()


def test_a_connection_to_a_store_whose_host_has_exited_fails_at_once():
    """A refused port is the definitive answer of a host whose store has gone: no c10d connect,
    which would retry it for two timeouts."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=2), wait_for_workers=False)
    port = master.port
    schema.probe_store_port("127.0.0.1", port, timedelta(seconds=1))  # listening: no error
    del master
    start = time.monotonic()
    with pytest.raises(schema.StoreUnreachable, match=f"127.0.0.1:{port} is unreachable"):
        schema.probe_store_port("127.0.0.1", port, timedelta(seconds=5))
    assert time.monotonic() - start < 0.5


class CountingStore:
    def set_timeout(self, timeout) -> None:
        pass

    def add(self, key, amount):
        return 3


def test_a_periodic_loops_connection_backs_off_after_a_failed_connect(monkeypatch):
    """Many ranks starting at once on a busy store's server: a failed connect is not retried in step
    by every loop; the next connect waits a randomised, doubling backoff (calls fail at once, without
    a connect, until then); a connect that succeeds resets it."""
    monkeypatch.setattr(schema._jitter, "uniform", lambda a, b: 1.0)  # the library's own generator
    connects = []

    def factory():
        connects.append(time.monotonic())
        if len(connects) <= 2:
            raise ConnectionError("connect/validate timed out")
        return CountingStore()

    conn = Connection(factory, timedelta(seconds=0.5), "loop", backoff=True)
    with pytest.raises(ConnectionError):
        conn.call("add", "k", 0)
    with pytest.raises(StoreCallTimeout, match="backing off after a failed connect"):
        conn.call("add", "k", 0)  # within the first backoff (0.25 s): no connect
    assert len(connects) == 1
    time.sleep(schema.BACKOFF_FIRST + 0.05)
    with pytest.raises(ConnectionError):
        conn.call("add", "k", 0)  # the second connect fails: the backoff doubles
    time.sleep(schema.BACKOFF_FIRST + 0.05)
    with pytest.raises(StoreCallTimeout, match="backing off"):
        conn.call("add", "k", 0)
    time.sleep(schema.BACKOFF_FIRST + 0.1)
    assert conn.call("add", "k", 0) == 3
    assert len(connects) == 3 and connects[2] - connects[1] >= 2 * schema.BACKOFF_FIRST
    conn.close()


def test_a_connection_without_backoff_connects_again_at_the_next_call():
    connects = []

    def factory():
        connects.append(1)
        if len(connects) == 1:
            raise ConnectionError("refused")
        return CountingStore()

    conn = Connection(factory, timedelta(seconds=0.5), "main")
    with pytest.raises(ConnectionError):
        conn.call("add", "k", 0)
    assert conn.call("add", "k", 0) == 3
    conn.close()


def test_a_connect_slower_than_a_call_is_kept_when_it_ends_not_made_again():
    """Many ranks starting on a busy store's host: a connect takes longer than a call's budget. The
    call fails (bounded), but the connect goes on and its client serves the next call: the store is
    not asked for a new connection by every call of every rank, which only adds to its load."""
    made = []
    slow = threading.Event()

    def factory():
        made.append(time.monotonic())
        slow.wait(0.8)  # the connect's handshake, answered late
        return BlockingStore(threading.Event(), answer_at_once=True)

    conn = Connection(factory, timedelta(seconds=0.1), "t")
    with pytest.raises(StoreCallTimeout):
        conn.call("add", "k", 1)  # its budget (0.6 s) ends inside the connect
    time.sleep(0.6)  # the connect has ended meanwhile
    assert conn.call("add", "k", 1) == 7
    assert len(made) == 1, "the slow connect was thrown away and made again"
    conn.close()
