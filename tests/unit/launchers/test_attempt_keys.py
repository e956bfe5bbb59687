"""torchrun with the library imported late: the ``fth-attempt-keys`` thread deletes the gloo address
keys every peer has read (``compat_torchrun._forget_read_keys``), over a HashStore standing in for
torchrun's store."""

from __future__ import annotations

import types

import torch.distributed as dist

from fault_tolerant_handlers.core import schema
from fault_tolerant_handlers.launchers import compat_torchrun


class FlakyConnection:
    """A connection to ``store`` whose ``fail_on``-th ``delete_key`` raises once (a store call that
    timed out part-way through the deletion)."""

    def __init__(self, store: dist.Store, fail_on: int) -> None:
        self.store, self.fail_on, self.deletes, self.deadline, self.closed = store, fail_on, 0, None, False

    def call(self, method: str, *args):
        if method == "delete_key":
            self.deletes += 1
            if self.deletes == self.fail_on:
                raise RuntimeError("the store did not answer within 3.0 s")
        return getattr(self.store, method)(*args)

    def close(self) -> None:
        self.closed = True


def test_a_deletion_that_failed_part_way_is_finished_without_a_false_warning(caplog):
    """The first try deletes this rank's own key, then a store call fails; the next try must not take
    the missing own key for keys torch never wrote (a warning to import the library earlier, and the
    rest left in the store for the next attempt to read)."""
    store = dist.HashStore()
    own, other = schema.gloo_address_key(0), schema.gloo_address_key(0, "1")
    for key in (own, other):
        store.set(key, "addr")
    conn = FlakyConnection(store, fail_on=2)
    entry = compat_torchrun.AttemptKeys(conn, set(), 1)
    compat_torchrun._forget_read_keys(types.SimpleNamespace(rank=0), entry, [own, other], {None, "1"}, 2)
    assert not store.check([own]) and not store.check([other])
    assert (entry.done, entry.count, entry.conn) == ({None, "1"}, 2, conn)
    assert "cannot be found" not in caplog.text
