"""PyTorch-Ignite DDP on 2 CPU ranks that survives a failure: relaunched and resumed, or recovered in place.

Relaunch and resume: torchrun starts the failed job again, and it goes on from the newest checkpoint
at the exact next batch::

    FTH_INJECT=raise@rank=1,iteration=14 torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/resume_ignite.py

Recover in place (``--in-place``): the same processes re-form the process group and call ``train``
again, without a relaunch, from the ranks' live state at the last completed iteration::

    FTH_INJECT=raise@rank=1,iteration=14 torchrun --standalone --nproc-per-node 2 examples/resume_ignite.py --in-place

Rank 1 raises at iteration 14 (``FTH_INJECT`` fires in the first attempt only); every rank stops
together, and the next attempt resumes from ``checkpoint_10.pt`` at iteration 10 (in place: from
``live-state-step=13.pt``, a name ``latest_checkpoint`` gives the live state, at iteration 13, nothing
trained twice) and trains to iteration 60. Without ``FTH_INJECT`` nothing fails. Checkpoints go to ``--dir`` (``ckpts/ignite``):
remove it to start from scratch.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from fault_tolerant_handlers import (DDPBucketLayout, RestartableDataLoader, latest_checkpoint, load_checkpoint,
                                     recover_in_place, recovery_attempt)
from fault_tolerant_handlers.ignite import FaultTolerance, SafeDiskSaver


def train(ckpt_dir: str, weights: str | None = None) -> int:
    """One attempt: everything is built here, so that a recovery in place can call it again."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g))
    loader = RestartableDataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=0), num_workers=1)

    def step(engine, batch):
        x, y = batch
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # DDP's all_reduce: where the other rank waits when one fails
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: loader.sampler.set_epoch(e.state.epoch - 1))
    FaultTolerance().attach(trainer)  # on every rank
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "loader": loader,
               "ddp": DDPBucketLayout(ddp)}  # the loader: mid-epoch at the next batch; the DDP: exact at 3+ ranks
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=10),
                              Checkpoint(to_save, SafeDiskSaver(ckpt_dir, require_empty=False), n_saved=2,
                                         global_step_transform=lambda e, _: e.state.iteration))
    path = latest_checkpoint(ckpt_dir)  # the newest complete one, the same on every rank; None at first
    if path:  # load_checkpoint: torch.load, or this process's copy after a recovery in place
        Checkpoint.load_objects(to_load=to_save, checkpoint=load_checkpoint(path))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + recovery_attempt()
    print(f"[rank {rank}] attempt {attempt}: {f'resumed from {os.path.basename(path)}' if path else 'started'} "
          f"at iteration {trainer.state.iteration}", flush=True)
    trainer.run(loader, max_epochs=3)
    print(f"[rank {rank}] finished at iteration {trainer.state.iteration}", flush=True)
    if weights and rank == 0:  # the final weights, to compare runs (make demo)
        torch.save(model.state_dict(), weights)
    dist.destroy_process_group()
    return trainer.state.iteration


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-place", action="store_true", help="recover in place instead of being relaunched")
    parser.add_argument("--dir", default="ckpts/ignite", help="checkpoint directory (default: ckpts/ignite)")
    parser.add_argument("--save-weights", metavar="FILE", help="rank 0 saves the final weights there")
    args = parser.parse_args()
    run = recover_in_place(train, max_restarts=2) if args.in_place else train
    run(args.dir, args.save_weights)
