"""A keeper's training child cuts stuck store connections at its exit; the sockets it inherited
from the keeper are the keeper's too, and must survive it."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from fault_tolerant_handlers.core import interrupts


def test_a_forked_child_cutting_store_connections_spares_those_it_inherited():
    """The keeper holds a store client of its own (made before ``recover_in_place``, as a script
    that counts the store's keys does). Its training child ends with a store call stuck, so its
    exit cuts its connections to the store's port: the keeper's client must still work after."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("before", "1")
    pid = os.fork()
    if pid == 0:  # the training child, as the keeper starts it
        code = 1
        try:
            interrupts.spare_inherited_sockets()
            interrupts.cut_connections_to({server.port})
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    client.set("after", "2")
    assert client.get("before") == b"1" and client.get("after") == b"2"
