"""Every use of torchdata's private API (checked against torchdata 0.11.0): torchdata's ``StatefulDataLoader``
on the hardened iterator of :mod:`.compat_dataloader`, for a ``RestartableDataLoader`` over an ``IterableDataset``
with workers; imported when one is made, and a torchdata that lacks a name below fails there, naming it."""

from __future__ import annotations

from typing import TypeVar

import torchdata
from torchdata.stateful_dataloader import StatefulDataLoader, stateful_dataloader

from .compat_dataloader import _Hardened, construct, hardened_context, lacking, len_called

_REQUIRED = (("stateful_dataloader", "_StatefulMultiProcessingDataLoaderIter"),
             ("StatefulDataLoader.__iter__", "_get_iterator"),  # overridden below
             *(("StatefulDataLoader.__init__", n) for n in ("next_iter_state", "_iterator", "_IterableDataset_len_called")))
if lacks := lacking(_REQUIRED, {"stateful_dataloader": stateful_dataloader, "StatefulDataLoader": StatefulDataLoader}):
    raise RuntimeError(f"RestartableDataLoader needs torchdata's {', '.join(lacks)}, which torchdata "
                       f"{torchdata.__version__} does not have (checked against 0.11.0)")


class StatefulWorkersIter(_Hardened, stateful_dataloader._StatefulMultiProcessingDataLoaderIter):
    """torchdata's multiprocessing iterator, hardened."""


_T_co = TypeVar("_T_co", covariant=True)


class InnerStatefulLoader(StatefulDataLoader[_T_co]):
    """The ``StatefulDataLoader`` a ``RestartableDataLoader`` drives for an iterable dataset."""

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        it = construct(StatefulWorkersIter, self, self.next_iter_state)
        self.next_iter_state = None
        return it

    def start_pass(self, outer, method: str) -> None:
        """A pass of ``outer`` (the ``RestartableDataLoader``) begins: ``len(outer)`` asked counts here too
        (torch's "samples have been fetched" warning); new workers are started with ``method``."""
        self._IterableDataset_len_called = len_called(outer)
        if not (outer.persistent_workers and self._iterator is not None):
            self.multiprocessing_context = hardened_context(method)

    def iterator(self):
        return self._iterator

    def drop_iterator(self) -> None:
        self._iterator = None
