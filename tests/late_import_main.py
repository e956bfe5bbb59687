"""One worker of a 2-rank Ignite DDP job under ``torchrun --max-restarts 2`` that calls
``init_process_group`` in ``main()`` and imports the library only inside its training function
(a common layout): the library's per-attempt store namespace cannot apply to its groups.

``torchrun --standalone --nproc-per-node 2 --max-restarts 2 late_import_main.py OUTDIR``

In the first attempt rank 1 fails at iteration 5 (``FAULT=raise``: an exception; ``FAULT=kill``:
SIGKILL). In later attempts rank 1 starts ``STAGGER`` seconds after rank 0, so that rank 0 would
read rank 1's address key of the attempt before, if it were still in the store. Each attempt of
each rank writes ``OUTDIR/attempt<A>_rank<R>.json`` at its start (with its pid) and again at its end
(``finished``: the iterations trained).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

OUT = Path(sys.argv[-1])
RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULT = os.environ.get("FAULT", "raise")
STAGGER = float(os.environ.get("STAGGER", "1.5"))


def note(**info) -> None:
    path = OUT / f"attempt{ATTEMPT}_rank{RANK}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **info, "pid": os.getpid()}))


def train() -> int:
    import fault_tolerant_handlers  # noqa: F401 - imported after init_process_group, on purpose
    from ignite.engine import Engine
    from torch.nn.parallel import DistributedDataParallel

    from fault_tolerant_handlers.ignite import FaultTolerance

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(engine, batch):
        if ATTEMPT == 0 and RANK == 1 and engine.state.iteration == 5:
            if FAULT == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("bad batch 5")
        opt.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    trainer = Engine(step)
    FaultTolerance().attach(trainer)
    trainer.run([torch.randn(8, 4) for _ in range(20)], max_epochs=1)
    return trainer.state.iteration


def main() -> None:
    logging.basicConfig(level=logging.INFO)  # the library's INFO lines too (what it deleted)
    OUT.mkdir(parents=True, exist_ok=True)
    note(started=time.time())
    if ATTEMPT > 0 and RANK == 1:
        time.sleep(STAGGER)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    note(finished=train())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
