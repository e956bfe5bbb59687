"""Sharded state (``DTensor``: FSDP2 ``fully_shard``) in every path that reads, copies, saves or loads
state, and distributed checkpoints (directories) in ``latest_checkpoint`` / ``load_checkpoint``.

A one-rank gloo group (made for these tests, destroyed after); the live-state checksum of a
``DTensor`` runs in a child process: before the fix it ended the interpreter with SIGSEGV (a
``DTensor``'s ``data_ptr()`` is 0, read through ctypes).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fault_tolerant_handlers import ShardedState, latest_checkpoint, load_checkpoint, load_dcp
from fault_tolerant_handlers.core import sharded
from fault_tolerant_handlers.data import snapshots

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        idist = sys.modules.get("ignite.distributed")
        if idist is not None and idist.model_name() != "serial":
            idist.finalize()  # Ignite's saver saw the group: it forgets it (and destroys it)
        if dist.is_initialized():
            dist.destroy_process_group()


def _sharded_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


CHECKSUM = """
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from fault_tolerant_handlers.recover import transfer
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = fully_shard(torch.nn.Linear(4, 4))
try:
    transfer.checksum({"w": model.state_dict()["weight"]})
except TypeError as err:
    print("refused:", err)
print("alive")
"""


def test_checksum_of_a_dtensor_is_refused_not_a_segfault():
    proc = subprocess.run([sys.executable, "-c", CHECKSUM], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # before: -11 (SIGSEGV)
    assert "refused: state['w'] is a DTensor (sharded: placements (S(0))" in proc.stdout, proc.stdout
    assert "alive" in proc.stdout


def no_numpy(self):
    raise RuntimeError("Numpy is not available")  # torch without numpy installed


def test_a_snapshots_checksum_is_crc32_of_its_bytes_without_numpy(monkeypatch):
    import zlib

    payload = torch.arange(1000, dtype=torch.int64).view(torch.uint8)
    expected = zlib.crc32(bytes(payload.tolist()), zlib.crc32(b'{"m": 1}'))  # the format: CRC-32 of manifest, then payload
    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    snap = sharded.Snapshot(0, 1, b'{"m": 1}', payload).seal()
    assert snap.checksum == expected and snap.verify()
    assert sharded.Snapshot(0, 1, b"", torch.empty(0, dtype=torch.uint8)).compute_checksum() == 0
    payload[5] ^= 1
    assert not snap.verify()


def test_a_tensors_bytes_are_read_in_place_as_numpy_read_them_and_no_reader_needs_numpy(monkeypatch):
    """``sharded.memory`` gives the bytes ``numpy().tobytes()`` gave; the readers that used numpy (a
    shard received from a copy, its manifest; the CRC-32 of the RNG states in a rank's report) give
    the same bytes and CRC without it."""
    import zlib

    from fault_tolerant_handlers.core.phases import Captured, RecoveryState
    from fault_tolerant_handlers.recover import live_state
    from fault_tolerant_handlers.recover.live_state import LivePlan

    rng = (torch.get_rng_state(), [torch.arange(16, dtype=torch.uint8)])
    leaves = [rng[0], torch.arange(40, dtype=torch.float64)[3:17], torch.tensor([1, -2], dtype=torch.int32)]
    before = [t.numpy().tobytes() for t in leaves]
    rng_crc = zlib.crc32(rng[1][0].numpy().tobytes(), zlib.crc32(before[0]))
    snap = sharded.take_snapshot({"w": torch.arange(6.0)}, 22, 1, rng=rng)
    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert [bytes(sharded.memory(t)) for t in leaves] == before and bytes(sharded.memory(torch.empty(0))) == b""
    with pytest.raises(TypeError, match="not a contiguous CPU tensor"):
        sharded.memory(torch.arange(6).view(2, 3).t())
    plan = LivePlan(22, "step", "", shards=(1, 0, snap.checksum))
    captured, why = live_state._unwire(live_state._wire(snap, None), 1, plan, snap.checksum, 0)
    assert why == "" and captured.state.manifest == snap.manifest and captured.state.checksum == snap.checksum
    live = Captured(22, "step", {"w": torch.ones(2)}, None, rng)
    monkeypatch.setattr(live_state.hooks, "run", lambda hook, _: RecoveryState(live=live))
    held = live_state.Held(lambda **_: RecoveryState())
    held.collect(0)
    assert held.report.rng == f"{rng_crc:08x}" + "0" * 16  # torch's; no Python or numpy states recorded


def test_sharded_find_names_the_path(group):
    model = _sharded_model()
    assert sharded.find({"model": model.state_dict()})[0] == "state['model']['0.weight']"
    assert "DTensor" in sharded.find(dict(model.named_parameters()))[1]
    assert sharded.find({"w": torch.ones(2), "n": [1, {"x": torch.zeros(1)}]}) is None
    assert sharded.find(dict(torch.nn.Linear(2, 2).named_parameters())) is None


def test_snapshot_refuses_sharded_state_at_warning(group, monkeypatch, caplog):
    monkeypatch.setattr(snapshots, "enabled", lambda: True)
    monkeypatch.setattr(snapshots, "_warned_sharded", False)
    model = _sharded_model()
    with caplog.at_level(logging.WARNING):
        assert snapshots.keep("ckpt/checkpoint_10.pt", {"model": model.state_dict()}) is False
    assert snapshots.newest("ckpt/checkpoint_10.pt") is None
    assert "checkpoint['model']['0.weight'] is a DTensor" in caplog.text
    assert snapshots.keep("ckpt/checkpoint_10.pt", {"model": torch.nn.Linear(2, 2).state_dict()}) is True
    snapshots.forget()


def test_safe_disk_saver_refuses_a_sharded_model(group, tmp_path):
    pytest.importorskip("ignite")
    from fault_tolerant_handlers.ignite import SafeDiskSaver

    model = _sharded_model()
    with pytest.raises(TypeError, match="DTensor.*DCPSaver"):
        SafeDiskSaver(tmp_path, require_empty=False)({"model": model.state_dict()}, "checkpoint_10.pt")
    assert not list(tmp_path.glob("*.pt"))


def test_dcp_saver_round_trip_and_discovery(group, tmp_path):
    pytest.importorskip("ignite")
    from fault_tolerant_handlers.ignite import DCPSaver

    model = _sharded_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    to_save = {"app": ShardedState(model, optimizer), "counter": _Counter(7)}
    saver = DCPSaver(tmp_path)
    saver({k: v.state_dict() for k, v in to_save.items()}, "checkpoint_10.pt")
    saver.remove("checkpoint_10.pt")  # Checkpoint asks before the next save: done after it
    saver({k: v.state_dict() for k, v in to_save.items()}, "checkpoint_20.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_20"]
    saver({k: v.state_dict() for k, v in to_save.items()}, "checkpoint_20.pt")  # the same name again: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_20"]  # nothing left of the old one
    path = latest_checkpoint(tmp_path)
    assert path == str(tmp_path / "checkpoint_20")
    expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    fresh = _sharded_model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)  # never stepped: its state is made to load into
    counter = _Counter(0)
    load_dcp({"app": ShardedState(fresh, fresh_opt), "counter": counter}, path)
    assert counter.n == 7
    for key, value in fresh.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[key]), key
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
    with pytest.raises(IsADirectoryError, match="load_dcp"):
        load_checkpoint(path)


class _Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def _dcp_dir(path: Path, mtime: int, *, metadata: bool = True, meta_pt: bool | None = None) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(path), no_dist=True)
    if not metadata:
        (path / ".metadata").unlink()
    if meta_pt:
        torch.save({"global_step": 1}, path / "meta.pt")
    for p in [path, *path.iterdir()]:
        os.utime(p, ns=(mtime, mtime))
    return path


def test_latest_checkpoint_finds_complete_distributed_checkpoints_beside_files(tmp_path):
    base = time.time_ns()
    torch.save({"w": torch.ones(1)}, tmp_path / "checkpoint_10.pt")
    os.utime(tmp_path / "checkpoint_10.pt", ns=(base, base))
    _dcp_dir(tmp_path / "checkpoint_20", base + 10**9)
    (tmp_path / "lightning_logs").mkdir()  # not a checkpoint: not named
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint_20")
    _dcp_dir(tmp_path / "checkpoint_30", base + 2 * 10**9, metadata=False)  # its write did not finish
    _dcp_dir(tmp_path / "tmp-checkpoint_40", base + 3 * 10**9)  # DCPSaver's, not yet renamed
    with pytest.warns(RuntimeWarning) as record:
        assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint_20")
    text = "\n".join(str(w.message) for w in record)
    assert "skipping checkpoint_30: no .metadata" in text and "skipping tmp-checkpoint_40: a temporary directory" in text
    assert "lightning_logs" not in text


def test_latest_checkpoint_lightning_sharded_directories(tmp_path):
    base = time.time_ns()
    _dcp_dir(tmp_path / "epoch=0-step=10.ckpt", base, meta_pt=True)
    _dcp_dir(tmp_path / "epoch=0-step=20.ckpt", base + 10**9, meta_pt=False)  # meta.pt is written last
    with pytest.warns(RuntimeWarning, match="skipping epoch=0-step=20.ckpt: no meta.pt"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "epoch=0-step=10.ckpt")
    # the same modification time: the larger step
    _dcp_dir(tmp_path / "epoch=0-step=30.ckpt", base + 2 * 10**9, meta_pt=True)
    _dcp_dir(tmp_path / "epoch=0-step=40.ckpt", base + 2 * 10**9, meta_pt=True)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "epoch=0-step=40.ckpt")


def test_lightning_strategies_that_restore_themselves_are_named():
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from fault_tolerant_handlers.adapters import compat_lightning

    assert compat_lightning.restores_itself(DDPStrategy()) == ""
    for strategy in (ModelParallelStrategy(), FSDPStrategy()):
        why = compat_lightning.restores_itself(strategy)
        assert type(strategy).__name__ in why and "load_model_state_dict" in why, why
    # live state of each rank's own shard: ModelParallelStrategy only (FSDPStrategy's is refused)
    assert [compat_lightning.model_parallel(s) for s in (ModelParallelStrategy(), FSDPStrategy(), DDPStrategy())] \
        == [True, False, False]


# -- live state of a sharded model: each rank's own shard, a checksummed CPU snapshot ----------------------

class _Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    model(torch.randn(3, 4, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _local_bytes(state: dict) -> list:
    _, leaves, tensors = sharded._describe(state)
    return [(leaf["path"], t.contiguous().reshape(-1).view(torch.uint8).clone()) for leaf, t in zip(leaves, tensors)]


def _captured_at(model, optimizer, step: int):
    from fault_tolerant_handlers.data import live

    live.capture_now(lambda: live.Captured(step, "iteration", {"app": ShardedState(model, optimizer).state_dict(),
                                                                 "counter": {"n": step}}, None, None))


def test_a_sharded_models_live_state_is_its_shard_copied_checksummed_and_loaded_back_exactly(group, tmp_path):
    """At the failure, a sharded model's live state is this rank's shard copied into a checksummed CPU
    snapshot (what the next attempt resumes from, whatever the failed attempt's tensors become); the
    next attempt's ``latest_checkpoint`` names it and ``load_dcp`` loads it into a fresh FSDP2 model and
    optimizer, on their mesh, bit for bit; both then train on identically. Before this, live state
    was refused for a sharded model (the recovery resumed from its newest checkpoint)."""
    from fault_tolerant_handlers.data import live

    model = _sharded_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in (1, 2):
        _train(model, optimizer, step)
    _captured_at(model, optimizer, 2)
    expected = _local_bytes(ShardedState(model, optimizer).state_dict())
    _train(model, optimizer, 3)  # the failed attempt's tensors change: the snapshot is a copy
    captured = live.collect()
    assert isinstance(captured.state, sharded.Snapshot) and captured.state.verify() and captured.step == 2
    live.hold(captured)
    try:
        path = latest_checkpoint(tmp_path)
        assert Path(path).name == "live-state-step=2.pt"
        torch.manual_seed(1)
        fresh = _sharded_model()
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
        counter = _Counter()
        load_dcp({"app": ShardedState(fresh, fresh_optimizer), "counter": counter}, path)
        assert counter.n == 2
        loaded = ShardedState(fresh, fresh_optimizer).state_dict()
        assert all(type(v).__name__ == "DTensor" for v in loaded["model"].values())
        assert [(p, b.tolist()) for p, b in _local_bytes(loaded)] == [(p, b.tolist()) for p, b in expected]
        assert live.take(path) is None  # handed over once
    finally:
        live.forget()
    reference = _sharded_model()  # trained to step 2 again, uninterrupted
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in (1, 2, 3):
        _train(reference, reference_optimizer, step)
    _train(fresh, fresh_optimizer, 3)
    assert [(p, b.tolist()) for p, b in _local_bytes(ShardedState(fresh, fresh_optimizer).state_dict())] == \
        [(p, b.tolist()) for p, b in _local_bytes(ShardedState(reference, reference_optimizer).state_dict())]


def test_a_sharded_snapshot_whose_bytes_changed_is_never_loaded(group, tmp_path):
    """A byte of the held snapshot flipped after the failure: the rank reports no live state, naming
    ``SnapshotChecksumError`` (rank 0's plan then names it, and every rank resumes from its checkpoint);
    flipped after the agreement, loading it raises ``SnapshotChecksumError`` and hands nothing over.
    A snapshot loaded without a sharded model to take its mesh from is refused, naming ``load_dcp``."""
    from fault_tolerant_handlers.core.phases import RecoveryState
    from fault_tolerant_handlers.data import live
    from fault_tolerant_handlers.recover.live_state import Held

    model = _sharded_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optimizer, 1)
    _captured_at(model, optimizer, 1)
    held = Held(lambda **changes: RecoveryState(**changes))
    live._captured.state.payload[5] ^= 1
    held.collect(0)
    assert held.captured is None and held.report.step == -1 and not held.report.shard
    assert held.report.why.startswith("SnapshotChecksumError: its shard of iteration 1 does not have its checksum")

    _captured_at(model, optimizer, 1)
    held.collect(0)
    assert held.report.shard and held.report.step == 1 and len(held.report.checksum) == 8
    snapshot = held.captured.state
    live.hold(held.captured)
    try:
        path = latest_checkpoint(tmp_path)
        with pytest.raises(TypeError, match="no sharded model is among the objects.*load_dcp"):
            live.take(path, [_Counter()])
        snapshot.payload[5] ^= 1
        with pytest.raises(sharded.SnapshotChecksumError, match="does not have its checksum"):
            load_dcp({"app": ShardedState(model, optimizer)}, path)
        assert live.held() is held.captured  # not handed over
    finally:
        live.forget()


@pytest.mark.parametrize("forge, why", [
    (lambda leaf: {**leaf, "placements": [["X"]]}, "placements do not rebuild it: KeyError"),
    (lambda leaf: {**leaf, "placements": [["S", "zero"]]}, "placements do not rebuild it"),
    (lambda leaf: {**leaf, "global_shape": "8"}, "placements do not rebuild it"),
    (lambda leaf: {key: value for key, value in leaf.items() if key != "mesh"}, "was sharded on a mesh None"),
], ids=["placement-kind", "shard-dim", "global-shape", "no-mesh"])
def test_a_shards_forged_placements_or_mesh_are_refused_by_name(group, forge, why):
    """The manifest of a ``DTensor`` comes from a peer: what rebuilds it on the mesh is checked too."""
    import json

    model = _sharded_model()
    snap = sharded.take_snapshot(model.state_dict(), 1, 0)
    mesh = next(model.parameters()).device_mesh
    manifest = json.loads(snap.manifest)
    manifest["leaves"][0] = forge(manifest["leaves"][0])
    forged = sharded.Snapshot(0, 1, json.dumps(manifest).encode(), snap.payload).seal()
    with pytest.raises(sharded.ManifestError, match=why):
        sharded.restore(forged, mesh=mesh)
    assert type(sharded.restore(snap, mesh=mesh)["0.weight"]).__name__ == "DTensor"
