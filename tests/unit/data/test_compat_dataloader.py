"""torch's and torchdata's private DataLoader names, in ``data/compat_dataloader.py`` and
``data/compat_torchdata.py``: looked up when a ``RestartableDataLoader`` is made (torchdata's: over an
``IterableDataset`` with workers), and a torch or torchdata that lacks one is refused there, by name."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, dataloader
from torchdata.stateful_dataloader import StatefulDataLoader, stateful_dataloader

from fault_tolerant_handlers import data
from fault_tolerant_handlers.data import compat_torchdata
from fault_tolerant_handlers.dataloader import RestartableDataLoader


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize("owner, name, named", [
    (dataloader, "_MultiProcessingDataLoaderIter", r"dataloader\._MultiProcessingDataLoaderIter, "),
    (DataLoader, "_index_sampler", r"DataLoader\._index_sampler, "),
    (dataloader._MultiProcessingDataLoaderIter, "_reset", r"_MultiProcessingDataLoaderIter\._reset \(_task_info\)"),
])
def test_a_torch_without_a_private_name_the_loader_uses_is_refused_by_name_when_the_loader_is_made(
        monkeypatch, owner, name, named):
    with monkeypatch.context() as patch:
        patch.delattr(owner, name)
        with pytest.raises(RuntimeError, match=rf"RestartableDataLoader needs torch's .*{named}.*which torch \S+ does "
                                               r"not have \(checked against torch 2\.13\.0\)"):
            RestartableDataLoader(range(4), batch_size=2)
    assert list(RestartableDataLoader(range(4), batch_size=2))[1].tolist() == [2, 3]


@pytest.mark.parametrize("owner, name, named", [
    (stateful_dataloader, "_StatefulMultiProcessingDataLoaderIter",
     "stateful_dataloader._StatefulMultiProcessingDataLoaderIter"),
    (StatefulDataLoader, "__init__", r"StatefulDataLoader.__init__ \(next_iter_state\)"),
])
def test_a_torchdata_without_a_private_name_it_uses_is_refused_by_name_when_the_loader_is_made(
        monkeypatch, owner, name, named):
    try:
        with monkeypatch.context() as patch:
            patch.delattr(owner, name)
            patch.delitem(sys.modules, compat_torchdata.__name__)  # imported again, as in a fresh process
            patch.delattr(data, "compat_torchdata")
            with pytest.raises(RuntimeError, match=rf"RestartableDataLoader needs torchdata's {named}, which torchdata "
                                                   r"\S+ does not have \(checked against 0\.11\.0\)"):
                RestartableDataLoader(Stream(), batch_size=2, num_workers=1)
    finally:
        importlib.reload(compat_torchdata)
    assert RestartableDataLoader(Stream(), batch_size=2, num_workers=1).num_workers == 1


def test_the_names_an_init_sets_are_read_from_its_code():
    assert compat_torchdata.lacking(compat_torchdata._REQUIRED, {"stateful_dataloader": stateful_dataloader,
                                                                 "StatefulDataLoader": StatefulDataLoader}) == []
    assert compat_torchdata.lacking((("StatefulDataLoader.__init__", "_no"),), {"StatefulDataLoader": torch.nn.Module}) \
        == ["StatefulDataLoader.__init__ (_no)"]
