"""A release chooses the sockets to cut from ``/proc``, then cuts them one by one. Meanwhile a
socket of the list may be closed (a gloo pair cut before it ends its owner's other pairs) and its
fd number taken by a connect in another thread: a store client's new connection. That one must
not be cut in the gloo socket's place."""

from __future__ import annotations

import os
import socket

from fault_tolerant_handlers.core import interrupts, procfs


def _connected_pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return client, accepted


def test_a_chosen_fd_taken_by_a_new_connection_before_its_turn_is_not_cut():
    server = socket.create_server(("127.0.0.1", 0))
    gloo, gloo_peer = _connected_pair(server)
    fd, inode = gloo.fileno(), os.fstat(gloo.fileno()).st_ino
    row = (gloo.getsockname()[1], server.getsockname()[1], procfs.ESTABLISHED)
    chosen = procfs.select_sockets({inode: fd}, {inode: row}, set())
    assert chosen == [fd]
    gloo.close()  # closed by its owner after the list was read
    store, store_peer = _connected_pair(server)  # a new connection takes the lowest free fd: that one
    try:
        assert store.fileno() == fd
        assert interrupts._shutdown(chosen, {fd: inode}) == 0
        store.sendall(b"ping")  # still connected both ways
        assert store_peer.recv(4) == b"ping"
        store_peer.sendall(b"pong")
        assert store.recv(4) == b"pong"
    finally:
        for s in (store, store_peer, gloo_peer, server):
            s.close()


def test_a_chosen_fd_still_the_same_socket_is_cut():
    server = socket.create_server(("127.0.0.1", 0))
    gloo, gloo_peer = _connected_pair(server)
    try:
        fd = gloo.fileno()
        assert interrupts._shutdown([fd], {fd: os.fstat(fd).st_ino}) == 1
        assert gloo_peer.recv(4) == b""  # the peer sees the connection end
    finally:
        for s in (gloo, gloo_peer, server):
            s.close()
