"""A helper process forked from a rank (the liveness process) never collects what it inherited: a gloo
process group left in a reference cycle would be destroyed by the child's first collection, and gloo's
destructor waits there, holding the GIL, for threads a forked child does not have (a DataLoader worker
hung so; the liveness process would stop beating: a false alarm). Here an object whose destructor writes
a byte stands for the group (the real group: ``tests/distributed/test_dataloader.py``)."""

import gc
import os

from fault_tolerant_handlers.core import procfs


class Cycle:
    def __init__(self, fd: int, tag: bytes) -> None:
        self.fd, self.tag, self.me = fd, tag, self

    def __del__(self) -> None:
        os.write(self.fd, self.tag)


def test_the_child_collects_its_own_cycles_never_the_inherited_ones():
    read, write = os.pipe()
    gc.disable()  # the inherited cycle stays uncollected until the fork
    try:
        Cycle(write, b"i")
        pid = procfs.fork()
        if pid == 0:
            try:
                gc.collect()  # what it inherited: frozen
                Cycle(write, b"c")
                gc.collect()  # its own: collected
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert not gc.isenabled()  # the parent's collector as the caller left it
        gc.collect()  # the parent collects its own cycle
    finally:
        gc.enable()
        os.close(write)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.read() == b"ci"  # the child: its own only; then the parent's


def test_the_collector_of_both_is_enabled_after_when_it_was_before():
    read, write = os.pipe()
    pid = procfs.fork()
    if pid == 0:
        os.write(write, b"1" if gc.isenabled() else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        assert pipe.read() == b"1"
    assert gc.isenabled()
