"""A replacement's Lightning logger versions, read from the (unauthenticated) store at ``RE_FORM``
(``adapters.take_logger_versions``): a valid value pins the first attempt's version and keeps its
``metrics.csv`` rows; a value out of range, not JSON, or naming a class that is not one of Lightning's
numbered loggers is ignored, and the keys after the first gap are not read."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

pytest.importorskip("lightning")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from fault_tolerant_handlers import adapters  # noqa: E402
from fault_tolerant_handlers.adapters import LoggerVersion  # noqa: E402
from fault_tolerant_handlers.core.phases import RecoveryState  # noqa: E402
from fault_tolerant_handlers.core.schema import logger_version_key  # noqa: E402


@pytest.fixture
def store():
    yield dist.HashStore()
    adapters.forget_logger_versions(RecoveryState())


def test_a_replacement_takes_rank_0s_version_and_its_rows(store, tmp_path):
    root = tmp_path / "lightning_logs"
    (root / "version_0").mkdir(parents=True)
    (root / "version_0" / "metrics.csv").write_text("epoch,step,train_loss\n0,4,2.3\n")
    (root / "version_1").mkdir()  # a folder the next free version would skip to
    store.set(logger_version_key(0), LoggerVersion("lightning.pytorch", "CSVLogger", str(root), 0).to_json())
    adapters.take_logger_versions(RecoveryState(rank=0, world_size=2, store=store))
    assert CSVLogger(str(tmp_path)).version == 0
    assert adapters.kept_metrics == {os.path.join(str(root), "version_0"): b"epoch,step,train_loss\n0,4,2.3\n"}
    adapters.forget_logger_versions(RecoveryState())
    assert CSVLogger(str(tmp_path)).version == 2  # after the recovery: the next free version again


@pytest.mark.parametrize("value", [
    LoggerVersion("lightning.pytorch", "CSVLogger", "/r", 2**31).to_json(),  # out of range
    LoggerVersion("lightning.pytorch", "Logger", "/r", 0).to_json(),  # not a numbered logger
    LoggerVersion("os", "CSVLogger", "/r", 0).to_json(),  # not Lightning's namespace
    b"\x80\x04not json",
    b"{" * 10_000,  # over the size limit
])
def test_a_bad_value_is_ignored(store, value):
    store.set(logger_version_key(0), value)
    store.set(logger_version_key(2), LoggerVersion("lightning.pytorch", "CSVLogger", "/r", 0).to_json())  # after a gap
    adapters.take_logger_versions(RecoveryState(rank=0, world_size=2, store=store))
    assert adapters.logger_versions == []
