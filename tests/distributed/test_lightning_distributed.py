"""Lightning: ``Trainer(callbacks=[FaultTolerance()])`` on 2 real gloo CPU ranks (real ``Trainer``, real DDP).

For each launcher (``ddp``: Lightning's subprocess launcher; ``ddp_spawn``; ``torchrun``) and kind of
fault, every rank raises within 5 s of the fault: the failing rank its own exception, the other
``PeerFailedError`` with the failing rank, exception, message, traceback, global step and epoch,
also with ``OnExceptionCheckpoint`` and ``ModelCheckpoint`` in the callbacks. Afterwards the last
checkpoint ``ModelCheckpoint`` wrote loads, no checkpoint was written after the fault, and
``on_exception.ckpt`` holds the trained state. The failing rank stays alive after its run raised
(``LINGER``), so the other rank cannot be released by the failing process's exit, only by the
callback. The same scenarios with stock Lightning wait to the (short) process-group timeout and
lose the cause. Programs: ``tests/lightning_main.py`` (rank program), ``examples/lightning_ddp.py``
(model, data, fault injection).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from launch import ROOT, PROGRAMS, run_ranks

HERE = PROGRAMS
SCRIPT = HERE / "lightning_main.py"
MAX_LATENCY_SEC = 5.0
FAULT_STEP = 10  # epoch 1 (8 batches per epoch and rank): after the epoch-0 checkpoint

pytestmark = pytest.mark.timeout(120)

# fault kind -> (failing rank, exception type, message prefix, global step, epoch in the report)
FAULTS = {
    "raise": (1, "RuntimeError", "CUDA-like failure at step 10", 11, 1),  # in the batch of global_step 10: step 11
    "rank0_callback": (0, "PermissionError", "cannot write /logs/step10.json", 10, 1),
    "data": (1, "ValueError", "bad sample ", 10, 1),
    "validation": (1, "KeyError", "'missing label column'", 16, 1),
}


def _run(tmp_path, launch, fault, *, use_ft=True, oec=True, linger="3", **kw):
    env = dict(FAULT=fault, FAULT_RANK=str(FAULTS.get(fault, (1,))[0]), FAULT_STEP=str(FAULT_STEP),
               USE_FT="1" if use_ft else "0", OEC="1" if oec else "0", LINGER=linger)
    if launch == "torchrun":
        kw["launcher"] = ["-m", "torch.distributed.run", "--nproc-per-node=2"]
    else:
        env.update(LAUNCH=launch, FTH_TEST_TOP="1")
    kw.setdefault("deadline", 60)
    results = run_ranks(1, "", tmp_path, script=SCRIPT, env=env, result_ranks=2, **kw)
    return results, tmp_path / "lightning_main-1"


def _assert_failed_together(results, fault):
    bad, exc_type, message, step, epoch = FAULTS[fault]
    fault_event = results[bad].event("fault")  # the fault fired, on the rank it was meant for
    assert fault_event["exc_type"] == exc_type and message.strip("'") in fault_event["message"]
    for r in results:
        seen = r.event("run_raised")
        assert not r.has("run_returned"), r.events
        latency = seen["t"] - fault_event["t"]
        assert 0 <= latency < MAX_LATENCY_SEC, (r.rank, latency)
        if r.rank == bad:
            assert seen["raised"] == exc_type, seen
            assert message.strip("'") in seen["message"], seen
        else:
            assert seen["raised"] == "PeerFailedError", {k: v for k, v in seen.items() if k != "remote_traceback"}
            assert seen["failed_rank"] == bad
            assert seen["exc_type"] == exc_type
            assert seen["exc_message"].startswith(message)
            assert (seen["step"], seen["epoch"]) == (step, epoch)
            assert f"rank {bad} failed in 'train' (epoch {epoch}, iteration {step})" in seen["message"]
            assert "Traceback of rank" in seen["message"] and exc_type in seen["remote_traceback"]


def _assert_checkpoints(outdir: Path, *, on_exception: bool):
    """The last good checkpoint (end of epoch 0) loads; nothing was written after the fault;
    ``on_exception.ckpt``, when asked for, is complete and holds the trained state."""
    from lightning_ddp import TinyModel  # the example's model (imports Lightning: only here)

    ckpts = outdir / "ckpts"
    written = sorted(p.name for p in ckpts.glob("epoch=*.ckpt"))
    assert written == ["epoch=0-step=8.ckpt"], written
    last_good = torch.load(ckpts / written[-1], weights_only=False, map_location="cpu")
    assert (last_good["epoch"], last_good["global_step"]) == (0, 8)
    model = TinyModel.load_from_checkpoint(ckpts / written[-1], map_location="cpu")
    assert torch.equal(model.net.weight, last_good["state_dict"]["net.weight"])
    assert (ckpts / "on_exception.ckpt").exists() == on_exception
    if on_exception:
        saved = torch.load(ckpts / "on_exception.ckpt", weights_only=False, map_location="cpu")
        assert saved["global_step"] >= 8, saved["global_step"]  # the ranks' state, not an untrained model
        TinyModel.load_from_checkpoint(ckpts / "on_exception.ckpt", map_location="cpu")


@pytest.fixture(autouse=True, scope="module")
def _examples_on_path():
    sys.path.insert(0, str(ROOT / "examples"))
    yield
    sys.path.remove(str(ROOT / "examples"))


@pytest.mark.parametrize(
    "launch, fault, oec",
    [
        ("ddp", "raise", True),
        pytest.param("ddp", "rank0_callback", True, marks=pytest.mark.long),  # suite time: Ignite's rank0_handler runs
        pytest.param("ddp_spawn", "raise", True, marks=pytest.mark.long),  # suite time: ddp_spawn in test_spawn_report.py
        pytest.param("ddp_spawn", "validation", False, marks=pytest.mark.long),  # suite time
        ("torchrun", "data", False),
    ],
)
def test_every_rank_raises_with_the_cause(launch, fault, oec, tmp_path):
    results, outdir = _run(tmp_path, launch, fault, oec=oec)
    _assert_failed_together(results, fault)
    _assert_checkpoints(outdir, on_exception=oec)
    if launch == "ddp_spawn":
        # the parent's trainer.fit raises the ranks' error, with the cause, not a masking one
        parent = [json.loads(e) for e in (outdir / "parent.jsonl").read_text().splitlines()]
        raised = [e for e in parent if e["event"] == "run_raised"]
        assert raised and raised[0]["raised"] == "ProcessRaisedException", parent
        assert FAULTS[fault][2].strip("'") in raised[0]["tail"], raised[0]["tail"]


@pytest.mark.long  # stock Lightning's behaviour, not the library's: make test-long
@pytest.mark.parametrize("launch", ["ddp", "ddp_spawn"])
def test_stock_lightning_waits_to_the_timeout_and_loses_the_cause(launch, tmp_path):
    """Stock Lightning 2.6.6 with OnExceptionCheckpoint (4 s process-group timeout): the failing
    rank sits in the checkpoint barrier while the other waits in the gradient all_reduce, until the
    timeout; the other rank never reports the real error."""
    # ddp_spawn: the failing rank must outlive the timeout, or its exit would release the other rank
    results, outdir = _run(tmp_path, launch, "raise", use_ft=False, oec=True, pg_timeout=4.0,
                           linger="5" if launch == "ddp_spawn" else "1", deadline=40, expect_hang=True)
    fault_event = results[1].event("fault")
    peer = [e for e in results[0].events if e["event"] in ("run_raised", "run_returned")]
    assert peer, results[0].events  # it did stop, at the timeout
    # it waited for the timeout (4 s from when it entered the all_reduce, shortly before the fault)
    assert peer[0]["t"] - fault_event["t"] >= 2.5, peer[0]["t"] - fault_event["t"]
    assert FAULTS["raise"][2] not in peer[0].get("message", "")
    assert peer[0]["raised"] != "PeerFailedError"
    if launch == "ddp_spawn":
        # and the parent, which holds only the untrained model, wrote it as on_exception.ckpt
        saved = torch.load(outdir / "ckpts" / "on_exception.ckpt", weights_only=False, map_location="cpu")
        assert saved["global_step"] == 0


def test_clean_run_completes_on_every_rank(tmp_path):
    results, outdir = _run(tmp_path, "ddp", "none", oec=True)
    for r in results:
        assert r.event("run_returned")["epoch"] == 3, r.stderr[-3000:]
        assert not r.has("run_raised")
    assert results[0].returncode == 0, results[0].stderr[-3000:]
    names = sorted(p.name for p in (outdir / "ckpts").glob("*.ckpt"))
    assert names == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt"], names


# -- a single process: no process group, nothing to coordinate ---------------------------------------


def test_single_device_is_a_no_op_and_two_instances_keep_their_state(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fault_tolerant_handlers.lightning import FaultTolerance
    from lightning_ddp import Fault, TinyData, TinyModel

    first, second = FaultTolerance(), FaultTolerance(sync_every=None, name="finetune")
    assert first.state_key != second.state_key
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[first, second, ModelCheckpoint(dirpath=tmp_path)])
    trainer.fit(TinyModel(), datamodule=TinyData())
    assert not first.guard.active
    ckpt = torch.load(next(tmp_path.glob("*.ckpt")), weights_only=False)
    assert ckpt["callbacks"][first.state_key] == {"batches": 16}
    assert ckpt["callbacks"][second.state_key] == {"batches": 16}

    restored = FaultTolerance(name="finetune")
    restored.load_state_dict({"failures_seen": 2})  # written by version 0.1: still loads
    assert restored.state_dict() == {"batches": 0}
    with pytest.raises(ValueError, match=r"state_dict\['batches'\] must be a non-negative int"):
        restored.load_state_dict({"batches": -1})

    # a fault on a single device: Lightning's own path, the exception unchanged
    model = TinyModel()
    model.fault = Fault("raise", rank=0, step=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[FaultTolerance()], enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="CUDA-like failure at step 2"):
        trainer.fit(model, datamodule=TinyData())


@pytest.mark.parametrize(
    "kwargs, error",
    [({"sync_every": 0}, ValueError), ({"hang_timeout": "5m"}, TypeError), ({"name": ""}, TypeError),
     ({"name": 123}, TypeError)],
)
def test_bad_arguments(kwargs, error):
    from fault_tolerant_handlers.lightning import FaultTolerance

    with pytest.raises(error):
        FaultTolerance(**kwargs)


def test_the_failing_ranks_own_on_exception_collective_is_released_too(tmp_path):
    """A callback of the user's whose ``on_exception`` runs an ``all_reduce`` (``ddp``, rank 1 raises
    at step 10, a 30 s process-group timeout): both ranks enter it after the failure. Rank 1, the
    failing rank, must leave its own collective as surely as rank 0 does, not wait the 30 s
    timeout once rank 0 has gone (it did, 1 run in 4)."""
    results, _ = _run(tmp_path, "ddp", "exc_collective", oec=False, pg_timeout=30.0, deadline=50)
    fault_event = results[1].event("fault")
    for r in results:
        assert r.has("user_exc_handler"), (r.rank, r.events)
        seen = r.event("run_raised")
        assert seen["t"] - fault_event["t"] < MAX_LATENCY_SEC, (r.rank, seen["t"] - fault_event["t"], r.events)
    assert results[1].event("run_raised")["raised"] == "RuntimeError"
    assert results[0].event("run_raised")["raised"] == "PeerFailedError"
