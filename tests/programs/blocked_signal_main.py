"""One rank of the 'a signal ends a blocked rank' tests (issue 46): ``python blocked_signal_main.py <outdir>``,
started by ``run_ranks`` or torchrun, 2 ranks.

Both ranks start the library's watchdog (``start_watchdog``: the session and its signal handlers),
then get stuck where no Python handler can run: rank 1 in a ``dist.broadcast`` from rank 0 that rank 0
never joins; rank 0 elsewhere, in ``dist.new_group`` (``BUSY=new_group``: waiting in the store for
rank 1's part of the new group, which never comes) or in a plain store ``get`` of a key nobody sets
(``BUSY=store``). Each records ``blocked`` (with its pid) just before, in ``<outdir>/rank<r>.jsonl``.
The process group's timeout is 120 s: nothing ends by itself within a test's bound.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import fault_tolerant_handlers  # noqa: F401 - before init_process_group, as the docs say for torchrun
import torch
import torch.distributed as dist

from fault_tolerant_handlers import start_watchdog


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()

    def record(event: str, **fields) -> None:
        fields.update(event=event, rank=rank, t=time.time(), pid=os.getpid())
        with open(out / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(fields) + "\n")

    start_watchdog()
    dist.barrier()
    if rank == 1:
        record("blocked", where="broadcast")
        dist.broadcast(torch.zeros(4), src=0)
    elif os.environ.get("BUSY", "new_group") == "new_group":
        record("blocked", where="new_group")
        dist.new_group([0, 1])
    else:
        from torch.distributed import distributed_c10d

        record("blocked", where="store")
        distributed_c10d._get_default_store().get("a key nobody sets")
    record("unblocked")


if __name__ == "__main__":
    main()
