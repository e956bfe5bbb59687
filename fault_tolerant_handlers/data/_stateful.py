"""The iterable-dataset path of ``RestartableDataLoader`` (private): torchdata's ``StatefulDataLoader``
snapshotting every batch, run with the hardened iterator of :mod:`._workers`; imported only when an
``IterableDataset`` is iterated with workers (it imports torchdata).
"""

from __future__ import annotations

from typing import TypeVar

from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.stateful_dataloader import _StatefulMultiProcessingDataLoaderIter

from ._workers import _Hardened, construct


class StatefulWorkersIter(_Hardened, _StatefulMultiProcessingDataLoaderIter):
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
