"""Lightning multi-process test program: the example's model and data, a real ``Trainer`` on 2 CPU
ranks (gloo), an injected fault, and a record of what every rank raised and when.

    LAUNCH=ddp python lightning_main.py <outdir>        (Lightning's subprocess launcher starts rank 1)
    LAUNCH=ddp_spawn python lightning_main.py <outdir>  (Lightning spawns both ranks)
    python -m torch.distributed.run --nproc-per-node=2 lightning_main.py <outdir>   (LAUNCH=torchrun)

Environment:
    FAULT        raise | rank0_callback | data | validation | none   (see examples/lightning_ddp.py)
    FAULT_RANK   rank that fails (default 1); FAULT_STEP global step (default 10)
    USE_FT       1: FaultTolerance in the callbacks; 0: stock Lightning
    OEC          1: OnExceptionCheckpoint in the callbacks too
    LINGER       seconds the failing rank stays alive after its run raised (default 4), so that the
                 other rank cannot be released by the failing process's exit
    FTH_TEST_TOP 1 in the process the test starts for ddp/ddp_spawn: drop the RANK/WORLD_SIZE/...
                 the harness sets, so that Lightning launches the ranks itself

Each rank appends JSON events to ``<outdir>/rank<r>.jsonl`` (``fault``, ``run_raised``,
``run_returned``, ``exit``); with ddp_spawn the parent writes ``parent.jsonl`` and the ranks record
through :class:`RecordingLauncher`, since their ``trainer.fit`` is not called in user code.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))

if os.environ.pop("FTH_TEST_TOP", None) == "1":  # before Lightning reads the environment
    for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(_key, None)

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher  # noqa: E402

from lightning_ddp import Fault, TinyData, TinyModel, make_trainer  # noqa: E402

LAUNCH = os.environ.get("LAUNCH", "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "ddp")
FAULT = os.environ.get("FAULT", "raise")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "10"))
USE_FT = os.environ.get("USE_FT", "1") == "1"
OEC = os.environ.get("OEC", "0") == "1"
LINGER = float(os.environ.get("LINGER", "4"))
PG_TIMEOUT = float(os.environ.get("FTH_TEST_PG_TIMEOUT", "20"))


def record(outdir: str, name: str, event: str, **fields) -> None:
    fields.update(event=event, t=time.time(), pid=os.getpid())
    with open(Path(outdir) / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")


def record_fault(outdir: str, rank: int, exc: BaseException) -> None:
    record(outdir, f"rank{rank}", "fault", exc_type=type(exc).__name__, message=str(exc))
    raise exc


def record_raised(outdir: str, name: str, exc: BaseException) -> None:
    fields = dict(raised=type(exc).__name__, message=str(exc)[:4000], tail=str(exc)[-2000:])
    for attr in ("failed_rank", "exc_type", "exc_message", "where", "step", "epoch", "remote_traceback"):
        if hasattr(exc, attr):
            fields[attr] = getattr(exc, attr)
    record(outdir, name, "run_raised", **fields)


class RecordingLauncher(_MultiProcessingLauncher):
    """ddp_spawn, test only: record what the stage raised inside each spawned rank."""

    outdir = ""

    def _wrapping_function(self, process_idx, trainer, function, args, kwargs, return_queue, global_states=None):
        name = f"rank{process_idx}"
        record(self.outdir, name, "start")
        try:
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
        except BaseException as exc:
            record_raised(self.outdir, name, exc)
            if process_idx == FAULT_RANK and FAULT != "none":
                time.sleep(LINGER)
            raise
        record(self.outdir, name, "run_returned")


def main() -> None:
    outdir = sys.argv[1]
    out = Path(outdir)
    fault = None if FAULT == "none" else Fault(FAULT, FAULT_RANK, FAULT_STEP,
                                               functools.partial(record_fault, outdir, FAULT_RANK))
    model, data = TinyModel(), TinyData(fault)
    model.fault = fault
    strategy = "ddp_spawn" if LAUNCH == "ddp_spawn" else "ddp"
    trainer = make_trainer(strategy, out=out, fault=fault, fault_tolerance=USE_FT, on_exception_checkpoint=OEC,
                           timeout=PG_TIMEOUT)
    if strategy == "ddp_spawn":
        launcher = RecordingLauncher(trainer.strategy, start_method="spawn")
        launcher.outdir = outdir
        trainer.strategy._launcher = launcher
        name = "parent"
    else:
        name = f"rank{trainer.global_rank}"
        record(outdir, name, "start")
    try:
        trainer.fit(model, datamodule=data)
    except BaseException as exc:  # noqa: BLE001
        record_raised(outdir, name, exc)
        if name == f"rank{FAULT_RANK}" and FAULT != "none":
            time.sleep(LINGER)
    else:
        record(outdir, name, "run_returned", step=trainer.global_step, epoch=trainer.current_epoch)
    # ddp: rank 0 started rank 1; wait for it so that the harness sees every rank's record
    for proc in getattr(trainer.strategy.launcher, "procs", []) if strategy == "ddp" else []:
        try:
            proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            pass
    record(outdir, name, "exit")


if __name__ == "__main__":
    main()
