"""The second witness of a silent rank on another host (``detect/witness.py``): real sockets on the
loopback interface, the address published in an in-memory store (HashStore). No process or thread."""

from __future__ import annotations

import sys
import time

import pytest
import torch.distributed as dist

from fault_tolerant_handlers.core.schema import witness_key

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the liveness helper is Linux only")

from test_probes import schema_over  # noqa: E402


def _connected(link, listener, within: float = 2.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        link.ready()
        listener.drain()
        if link.connected:
            return True
        time.sleep(0.01)
    return False


def test_a_live_host_acknowledges_every_byte_and_its_listener_takes_them():
    from fault_tolerant_handlers.detect.witness import Link, Listener

    store = dist.HashStore()
    listener = Listener("127.0.0.1")
    listener.publish(schema_over(store), 1)
    link = Link(schema_over(store), 1)
    try:
        assert _connected(link, listener)
        for k in range(20):
            link.send(float(k))
        deadline = time.monotonic() + 2.0
        while link.unacked_for(20.0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.unacked_for(20.0) == 0.0 and not link.sent  # every byte acknowledged by the kernel
        listener.drain()
        assert len(listener.peers) == 1
        link.close()
        deadline = time.monotonic() + 2.0
        while listener.peers and time.monotonic() < deadline:
            listener.drain()
            time.sleep(0.01)
        assert not listener.peers  # the watcher's close is seen and its socket closed
    finally:
        link.close()
        listener.sock.close()


def test_bytes_that_went_out_and_are_not_acknowledged_are_timed_from_the_oldest(monkeypatch):
    """What a cut link leaves in the socket: bytes sent, none acknowledged (the kernel's counts stood
    in for; a link cut for real is the multi-host tests'). Bytes held back by the peer's window
    (queued, never sent: a slow reader, not a lost host) witness nothing."""
    from fault_tolerant_handlers.detect import witness

    store = dist.HashStore()
    listener = witness.Listener("127.0.0.1")
    listener.publish(schema_over(store), 1)
    link = witness.Link(schema_over(store), 1)
    try:
        assert _connected(link, listener)
        counts = {witness.SIOCOUTQ: 0, witness.SIOCOUTQNSD: 0}
        monkeypatch.setattr(witness, "_ioctl", lambda sock, request: counts[request])
        link.send(10.0), link.send(10.2), link.send(10.4)
        counts[witness.SIOCOUTQ] = 2  # the first acknowledged, the next two not
        assert link.unacked_for(11.5) == pytest.approx(1.3) and list(link.sent) == [10.2, 10.4]
        counts[witness.SIOCOUTQNSD] = 2  # both queued but never sent: the peer's window is shut
        assert link.unacked_for(11.5) == 0.0
        counts[witness.SIOCOUTQ] = counts[witness.SIOCOUTQNSD] = 0
        assert link.unacked_for(11.5) == 0.0 and not link.sent
    finally:
        link.close()
        listener.sock.close()


def test_a_rank_with_no_listener_and_a_refused_connect_witness_nothing():
    from fault_tolerant_handlers.detect.witness import Address, Link, Listener

    store = dist.HashStore()
    silent = Link(schema_over(store), 2)  # rank 2 published no address
    silent.ready()
    assert silent.tried and silent.sock is None
    silent.send(1.0)
    assert silent.unacked_for(5.0) == 0.0
    gone = Listener("127.0.0.1")
    port = gone.address.port
    gone.sock.close()  # its helper ended: the port refuses
    schema_over(store).conn.call("set", witness_key(3), Address("127.0.0.1", port).to_json())
    refused = Link(schema_over(store), 3)
    refused.ready()
    end = time.monotonic() + 2.0
    while refused.sock is not None and time.monotonic() < end:
        refused.ready()
        time.sleep(0.01)
    assert refused.sock is None and not refused.connected
    refused.send(2.0)
    assert refused.unacked_for(9.0) == 0.0
