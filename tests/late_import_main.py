"""One worker of an Ignite DDP job under ``torchrun --max-restarts 2`` that resumes from its newest
checkpoint, with the library imported after ``init_process_group`` (``IMPORT=late``, the default: a
script that initializes the group in ``main()`` and imports the library in its training function)
or before it (``IMPORT=early``).

``torchrun --standalone --nproc-per-node 4 --max-restarts 2 late_import_main.py OUTDIR``

Any world size: ``DistributedSampler(shuffle=True, seed=0)`` over ``4 * WORLD_SIZE * EPOCH_LENGTH``
samples, batch 4 per rank (``EPOCH_LENGTH``, 5, iterations an epoch), ``EPOCHS`` (4) epochs; Ignite's
``Checkpoint`` at the end of every epoch (``OUTDIR/ckpt``), loaded at the start of an attempt. In the
first attempt rank 1 fails at iteration ``FAIL_AT`` (14: resumed at 10) (``FAULT=raise``: an
exception; ``FAULT=kill``: SIGKILL). In later attempts rank 1 starts ``STAGGER`` seconds after its
peers, so that they would read its address key of the attempt before, if it were still in the store.

Each attempt of each rank writes ``OUTDIR/attempt<A>_rank<R>.json`` at its start (with its pid),
once its process group is up (``up``), after loading the checkpoint (``resumed_at``: the iteration)
and at its end (``finished``: the iterations trained); it appends ``[attempt, iteration, sample
ids]`` of every batch it trains to ``OUTDIR/batches<R>.jsonl``.
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
FAIL_AT = int(os.environ.get("FAIL_AT", "14"))
STAGGER = float(os.environ.get("STAGGER", "1.5"))
IMPORT = os.environ.get("IMPORT", "late")
EPOCH_LENGTH, EPOCHS, BATCH = 5, 4, 4

if IMPORT == "early":
    import fault_tolerant_handlers  # noqa: F401 - before init_process_group: a store namespace per attempt


def note(**info) -> None:
    path = OUT / f"attempt{ATTEMPT}_rank{RANK}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **info, "pid": os.getpid()}))


class Samples(torch.utils.data.Dataset):
    """Sample ``i`` is ``(i, x_i)``, ``x_i`` seeded by ``i``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        return i, torch.randn(4, generator=torch.Generator().manual_seed(i))


def train() -> int:
    import fault_tolerant_handlers  # noqa: F401 - with IMPORT=late, after init_process_group, on purpose
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, DiskSaver
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from fault_tolerant_handlers import latest_checkpoint
    from fault_tolerant_handlers.ignite import FaultTolerance

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    world = dist.get_world_size()
    sampler = DistributedSampler(Samples(BATCH * world * EPOCH_LENGTH), shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    batches = open(OUT / f"batches{RANK}.jsonl", "a")

    def step(engine, batch):
        ids, x = batch
        if ATTEMPT == 0 and RANK == 1 and engine.state.iteration == FAIL_AT:
            if FAULT == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"bad batch {FAIL_AT}")
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        batches.write(json.dumps([ATTEMPT, engine.state.iteration, ids.tolist()]) + "\n")
        batches.flush()
        return loss.item()

    trainer = Engine(step)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: sampler.set_epoch(e.state.epoch - 1))
    FaultTolerance().attach(trainer)
    to_save = {"model": model, "optimizer": opt, "trainer": trainer}
    saver = Checkpoint(to_save, DiskSaver(str(OUT / "ckpt"), require_empty=False), n_saved=None,
                       global_step_transform=lambda e, _: e.state.iteration)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, saver)
    path = latest_checkpoint(OUT / "ckpt")
    if path is not None:
        Checkpoint.load_objects(to_save, torch.load(path, weights_only=False))
    note(resumed_at=trainer.state.iteration)
    trainer.run(loader, max_epochs=EPOCHS)
    batches.close()
    return trainer.state.iteration


def main() -> None:
    logging.basicConfig(level=logging.INFO)  # the library's INFO lines too (what it deleted)
    OUT.mkdir(parents=True, exist_ok=True)
    note(started=time.time())
    if ATTEMPT > 0 and RANK == 1:
        time.sleep(STAGGER)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    note(up=time.time())
    note(finished=train())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
