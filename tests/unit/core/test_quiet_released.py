"""A destroyed gloo group's event loop, quieted after a release (:func:`compat_torch.disarm_loops`)."""

from __future__ import annotations

import os
import select
import socket as socketlib

from fault_tolerant_handlers.core import compat_torch


def _sockets(*socks) -> dict[int, int]:
    return {s.fileno(): os.fstat(s.fileno()).st_ino for s in socks}


def test_a_loop_known_by_one_released_socket_has_all_its_sockets_quieted_and_keeps_their_handlers() -> None:
    """Two sockets with unread bytes wake a level-triggered loop at every wait; the loop is known by
    one of them (the other was reset, out of the TCP table); once disarmed neither wakes it, and both
    registrations, with the loop's handler pointers, are still there. Another loop is left alone."""
    one, one_peer = socketlib.socketpair()
    reset, reset_peer = socketlib.socketpair()
    other, other_peer = socketlib.socketpair()
    loop, live = select.epoll(), select.epoll()
    try:
        loop.register(one.fileno(), select.EPOLLIN)
        loop.register(reset.fileno(), select.EPOLLIN)
        live.register(other.fileno(), select.EPOLLIN)
        for peer in (one_peer, reset_peer, other_peer):
            peer.send(b"the rest of a message nobody reads")
        assert len(loop.poll(0)) == 2 and len(loop.poll(0)) == 2  # level-triggered: again and again
        inodes = _sockets(one, reset, other)
        mine = lambda: sorted(e for e in compat_torch._epoll_registrations() if e[0] in (loop.fileno(), live.fileno()))
        before = mine()
        assert compat_torch.disarm_loops({12345}, inodes) == 0  # no loop holds that socket
        assert compat_torch.disarm_loops({inodes[one.fileno()]}, inodes) == 2
        assert loop.poll(0) == []
        assert len(live.poll(0)) == 1  # not a loop of a released socket
        assert mine() == before  # same registrations, same data (the handlers)
        loop.unregister(one.fileno())  # the loop's own removal still finds them
        loop.unregister(reset.fileno())
    finally:
        for closing in (loop, live, one, one_peer, reset, reset_peer, other, other_peer):
            closing.close()
