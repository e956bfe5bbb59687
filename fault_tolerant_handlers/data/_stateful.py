"""The iterable-dataset path of ``RestartableDataLoader``, built on torchdata (private).

Iterable datasets keep their position inside the workers, so a restart needs the workers' state:
torchdata's ``StatefulDataLoader`` (0.11) snapshots it after every batch
(``snapshot_every_n_steps=1``) and starts new workers from a snapshot. This module runs it with the
same hardened iterator as the map-style path (``_dataloader_workers``); importing it imports
torchdata, which is why ``dataloader.py`` imports it only when an ``IterableDataset`` is iterated
with workers.
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
