"""One rank of the 'a rank finishes first' tests: ``python leave_first_main.py <outdir>``, started by
torchrun (on one host, or one per simulated host).

Every rank trains ``STEPS`` steps of a real DDP model in a loop of its own, watched by the library
(``start_watchdog``, beating every step), and records ``trained``. Then the ranks other than 0 record
``leaving`` and end their script normally (exit code 0: the interpreter's exit stops their
watchdogs), while rank 0 goes on alone for ``STAY`` seconds (work of its own, an evaluation or an
export: no collective), still beating, and records ``stayed``; or ``raised`` with what reached its
main thread.

Environment: ``STEPS`` (default 10), ``STAY`` seconds (default 6).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fault_tolerant_handlers import start_watchdog

STEPS = int(os.environ.get("STEPS", "10"))
STAY = float(os.environ.get("STAY", "6"))


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FTH_TEST_PG_TIMEOUT", "60"))))
    rank = dist.get_rank()

    def record(event: str, **fields) -> None:
        fields.update(event=event, rank=rank, t=time.time(), pid=os.getpid())
        with open(out / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(fields) + "\n")

    record("start")
    watchdog = start_watchdog()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        watchdog.beat(step)
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(0.05)
    record("trained", steps=STEPS)
    if rank != 0:
        record("leaving")
        return
    try:
        end = time.monotonic() + STAY
        step = STEPS
        while time.monotonic() < end:  # rank 0's own work: no collective, its watchdog still on
            watchdog.beat(step)
            with torch.no_grad():
                model.module(torch.randn(16, 8))
            time.sleep(0.1)
            step += 1
    except BaseException as exc:  # noqa: BLE001 - what the watchdog raised into this rank
        record("raised", raised=type(exc).__name__, message=str(exc)[:2000])
        raise
    record("stayed", seconds=STAY)


if __name__ == "__main__":
    main()
