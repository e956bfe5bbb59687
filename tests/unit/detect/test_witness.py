"""The second witness of a silent rank on another host (``detect/witness.py``): real sockets on the
loopback interface, the address published in an in-memory store (HashStore). No process or thread."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fault_tolerant_handlers.core.schema import Connection, Schema, witness_key

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the liveness helper is Linux only")


def schema_over(store: dist.Store) -> Schema:
    return Schema(Connection(lambda: dist.PrefixStore("fth/test", store), timedelta(seconds=1), "test"), 4)


def _connected(link, listener, within: float = 2.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        link.ready(time.monotonic())
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
    """What a cut link leaves in the socket: bytes gone out, none acknowledged (the kernel's counts
    stood in for; a link cut for real is the next test's). A byte is timed from when it was seen gone
    out: one this host could not send (its own link down) is not waiting yet, nor are bytes held back
    by the peer's window (a slow reader, not a lost host)."""
    from fault_tolerant_handlers.detect import witness

    store = dist.HashStore()
    listener = witness.Listener("127.0.0.1")
    listener.publish(schema_over(store), 1)
    link = witness.Link(schema_over(store), 1)
    try:
        assert _connected(link, listener)
        counts = {}
        monkeypatch.setattr(witness, "_ioctl", lambda sock, request: counts[request])

        def kernel(queued: int, unsent: int) -> None:
            counts[witness.SIOCOUTQ], counts[witness.SIOCOUTQNSD] = queued, unsent

        kernel(1, 0), link.send(10.0)  # out at once
        kernel(2, 0), link.send(10.2)
        kernel(3, 1), link.send(10.4)  # queued, not sent
        kernel(2, 1)  # the first acknowledged
        assert link.unacked_for(11.5) == pytest.approx(1.3) and list(link.sent) == [10.2, None]
        kernel(2, 0)  # the last went out at last
        assert link.unacked_for(11.6) == pytest.approx(1.4) and list(link.sent) == [10.2, 11.6]
        kernel(0, 0)
        assert link.unacked_for(12.0) == 0.0 and not link.sent
        kernel(1, 1), link.send(13.0)
        kernel(2, 2), link.send(13.2)  # the peer's window is shut: nothing goes out
        assert link.unacked_for(20.0) == 0.0 and list(link.sent) == [None, None]
    finally:
        link.close()
        listener.sock.close()


def test_a_rank_with_no_listener_or_a_refused_port_witnesses_nothing_and_a_replaced_helper_is_found_again():
    """No address published (its helper has no listener), or its port refused (its helper ended):
    the link witnesses nothing and looks the address up again at most every WITNESS_RETRY; a helper
    that replaced the old one (a new watchdog) published its new port, and the link connects to it."""
    from fault_tolerant_handlers.core.config import WITNESS_RETRY
    from fault_tolerant_handlers.detect.witness import Address, Link, Listener

    store = dist.HashStore()
    silent = Link(schema_over(store), 2)  # rank 2 published no address
    silent.ready(0.0)
    assert silent.sock is None and silent.retry_at == WITNESS_RETRY.total_seconds()
    silent.send(1.0)
    assert silent.unacked_for(5.0) == 0.0
    gone = Listener("127.0.0.1")
    port = gone.address.port
    gone.sock.close()  # its helper ended: the port refuses
    schema_over(store).conn.call("set", witness_key(3), Address("127.0.0.1", port).to_json())
    link = Link(schema_over(store), 3)
    link.ready(0.0)
    end = time.monotonic() + 2.0
    while link.sock is not None and time.monotonic() < end:
        link.ready(0.1)
        time.sleep(0.01)
    assert link.sock is None and not link.connected
    link.send(2.0)
    assert link.unacked_for(9.0) == 0.0
    again = Listener("127.0.0.1")  # the helper that replaced it
    try:
        again.publish(schema_over(store), 3)
        link.ready(1.0)
        assert link.sock is None  # not before WITNESS_RETRY
        link.ready(WITNESS_RETRY.total_seconds())
        assert link.sock is not None
        end = time.monotonic() + 2.0
        while not link.connected and time.monotonic() < end:
            link.ready(6.0)
            again.drain()
            time.sleep(0.01)
        assert link.connected
    finally:
        link.close()
        again.sock.close()


def _netns_unavailable() -> str | None:
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and ip (network namespaces)"
    return None


@pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))
def test_a_link_cut_for_real_leaves_what_went_out_unacknowledged_and_once_back_it_is_acknowledged():
    """node-a and node-b, network namespaces on a bridge as ``tests/hosts.py`` makes them (this
    process enters each in turn to open its socket). node-b's link up, every byte node-a sends is
    acknowledged at once; cut (``ip link set eth0 down``), what goes out waits, timed from the first
    byte after the cut; back up, it is acknowledged."""
    from fault_tolerant_handlers.detect import witness

    libc = ctypes.CDLL(None, use_errno=True)
    tag = f"fthmh{os.getpid()}xw"  # the rig's prefix: tests/hosts.py removes it if this process dies
    a, b, br = tag + "a", tag + "b", tag + "br"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    def enter(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            assert libc.setns(fd, 0x40000000) == 0, ctypes.get_errno()  # CLONE_NEWNET
        finally:
            os.close(fd)

    home = f"/proc/self/fd/{os.open('/proc/self/ns/net', os.O_RDONLY)}"
    listener = link = None
    try:
        for ns in (a, b, br):
            ip("netns", "add", ns)
        ip("-n", br, "link", "add", "br0", "type", "bridge")
        ip("-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate((a, b)):
            ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", br)
            ip("-n", br, "link", "set", f"p{i}", "master", "br0")
            ip("-n", br, "link", "set", f"p{i}", "up")
            ip("-n", ns, "addr", "add", f"10.233.0.{i + 1}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
        store = dist.HashStore()
        enter(f"/var/run/netns/{b}")
        listener = witness.Listener("10.233.0.2")
        listener.publish(schema_over(store), 1)
        enter(f"/var/run/netns/{a}")
        link = witness.Link(schema_over(store), 1)
        link.ready(0.0)  # its socket made in node-a
        enter(home)
        assert _connected(link, listener)
        for _ in range(5):
            link.send(time.monotonic())
            time.sleep(0.05)
            listener.drain()
            assert link.unacked_for(time.monotonic()) < 0.05
        ip("-n", b, "link", "set", "eth0", "down")
        cut = time.monotonic()
        while time.monotonic() - cut < 1.2:
            link.send(time.monotonic())
            time.sleep(0.2)
        waited = link.unacked_for(time.monotonic())
        assert 1.0 <= waited <= time.monotonic() - cut, waited
        ip("-n", b, "link", "set", "eth0", "up")
        back = time.monotonic()
        while link.unacked_for(time.monotonic()) and time.monotonic() - back < 10:
            time.sleep(0.05)
            listener.drain()
        assert link.unacked_for(time.monotonic()) == 0.0 and link.connected
    finally:
        enter(home)
        for end in (link, listener):
            if end is not None:
                (end.close if end is link else end.sock.close)()
        for ns in (a, b, br):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
