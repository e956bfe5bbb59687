"""A training function that cannot be called twice (run by torchrun, 2 ranks, under recover_in_place).

``torchrun --standalone --nproc-per-node 2 --max-restarts 0 inplace_unsafe_main.py OUTDIR``

It calls ``init_process_group`` only the first time (a global remembers it): the call after a
recovery finds no process group. Rank 1 raises at iteration 3 of the first attempt
(``FTH_INJECT``), so the job recovers once and must then end with ``RecoveryError`` on every rank.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ignite.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fault_tolerant_handlers import recover_in_place  # noqa: E402
from fault_tolerant_handlers.ignite import FaultTolerance  # noqa: E402

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
INITIALIZED = False  # the bug: a second call of train() skips init_process_group


def train() -> None:
    global INITIALIZED
    (OUT / f"attempt0_rank{RANK}.json").write_text(json.dumps({"pid": os.getpid()}))
    if not INITIALIZED:
        dist.init_process_group("gloo", timeout=timedelta(seconds=20))
        INITIALIZED = True
    engine = Engine(lambda e, b: dist.all_reduce(torch.ones(1)))
    FaultTolerance().attach(engine)
    engine.run(range(10), max_epochs=1)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ["FTH_INJECT"] = "raise@rank=1,iteration=3"
    recover_in_place(train, max_restarts=2)()
