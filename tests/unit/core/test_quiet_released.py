"""A destroyed gloo group's released sockets, quieted in their event loop (:func:`compat_torch.disarm_loop_sockets`)."""

from __future__ import annotations

import os
import select
import socket as socketlib

from fault_tolerant_handlers.core import compat_torch


def test_a_disarmed_registration_keeps_its_handler_and_stops_waking_its_loop() -> None:
    """A destroyed group's socket with unread bytes wakes a level-triggered loop at every wait; once
    disarmed it does not, and the registration (with the loop's handler pointer) is still there."""
    here, there = socketlib.socketpair()
    loop = select.epoll()
    try:
        loop.register(here.fileno(), select.EPOLLIN)
        there.send(b"the rest of a message nobody reads")
        assert loop.poll(0) and loop.poll(0)  # level-triggered: again and again
        before = [e for e in compat_torch._epoll_registrations() if e[1] == here.fileno() and e[0] == loop.fileno()]
        inode = os.fstat(here.fileno()).st_ino
        assert compat_torch.disarm_loop_sockets({here.fileno()}, {here.fileno(): inode + 1}) == 0  # not that socket
        assert compat_torch.disarm_loop_sockets({here.fileno()}, {here.fileno(): inode}) == 1
        assert loop.poll(0) == []
        after = [e for e in compat_torch._epoll_registrations() if e[1] == here.fileno() and e[0] == loop.fileno()]
        assert len(before) == 1 and after == before  # same inode, same data (the handler)
        loop.unregister(here.fileno())  # the loop's own removal still finds it
    finally:
        loop.close()
        here.close()
        there.close()
