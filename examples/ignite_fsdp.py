"""PyTorch-Ignite with a sharded model (FSDP2 ``fully_shard``) on 2 CPU ranks that survives a failure.

Each rank holds half of every weight; checkpoints are distributed (``torch.distributed.checkpoint``:
a directory per checkpoint, every rank writes its shards) through Ignite's ``Checkpoint`` with the
library's ``DCPSaver``, found by ``latest_checkpoint`` and loaded with ``load_dcp`` on every rank.

Relaunch and resume: torchrun starts the failed job again, and it goes on from the newest
distributed checkpoint at the exact next batch::

    FTH_INJECT=raise@rank=1,iteration=17 torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/ignite_fsdp.py

Recover in place (``--in-place``): the same processes re-form the process group, shard the model
again and carry on from live state: each rank's own shard of the last completed iteration, copied at
the failure into a checksummed CPU snapshot, which ``latest_checkpoint`` names and ``load_dcp`` loads
(no step computed twice; a rank whose process was lost takes its shard with it: then every rank
resumes from the newest distributed checkpoint)::

    FTH_INJECT=raise@rank=1,iteration=17 torchrun --standalone --nproc-per-node 2 examples/ignite_fsdp.py --in-place

Rank 1 raises at iteration 17 (``FTH_INJECT`` fires in the first attempt only); every rank stops
together, the next attempt resumes (relaunched: from ``checkpoint_10`` at iteration 10; in place:
from live state at iteration 16) and trains to iteration 60, and every rank prints the SHA-256 of
the final weights (gathered with ``full_tensor()``): the same as a run without ``FTH_INJECT``. Checkpoints go to ``--dir`` (``ckpts/ignite_fsdp``): remove it
to start from scratch.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset

from fault_tolerant_handlers import (RestartableDataLoader, ShardedState, latest_checkpoint, load_dcp,
                                     recover_in_place, recovery_attempt)
from fault_tolerant_handlers.ignite import DCPSaver, FaultTolerance


def weights_sha256(model: torch.nn.Module) -> str:
    """The SHA-256 of every parameter, whole (``full_tensor()`` gathers the shards: collective)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.full_tensor().detach().numpy().tobytes())
    return digest.hexdigest()


def train(ckpt_dir: str) -> str:
    """One attempt: everything is built here, so that a recovery in place can call it again."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)  # every Linear, then the whole model
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g))
    loader = RestartableDataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=0))

    def step(engine, batch):
        x, y = batch
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # FSDP's reduce-scatter: where the other rank waits when one fails
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: loader.sampler.set_epoch(e.state.epoch - 1))
    FaultTolerance().attach(trainer)  # on every rank
    # the model and optimizer as one object (torch's get_state_dict/set_state_dict), the engine, the loader
    to_save = {"app": ShardedState(model, optimizer), "trainer": trainer, "loader": loader}
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=10),
                              Checkpoint(to_save, DCPSaver(ckpt_dir), n_saved=2,
                                         global_step_transform=lambda e, _: e.state.iteration))
    path = latest_checkpoint(ckpt_dir)  # the newest complete distributed checkpoint (or live state), on every rank
    if path:
        load_dcp(to_save, path)  # every rank loads its shards
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + recovery_attempt()
    print(f"[rank {rank}] attempt {attempt}: {f'resumed from {os.path.basename(path)}' if path else 'started'} "
          f"at iteration {trainer.state.iteration}", flush=True)
    trainer.run(loader, max_epochs=3)
    digest = weights_sha256(model)
    print(f"[rank {rank}] finished at iteration {trainer.state.iteration}, weights sha256 {digest}", flush=True)
    dist.destroy_process_group()
    return digest


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-place", action="store_true", help="recover in place instead of being relaunched")
    parser.add_argument("--dir", default="ckpts/ignite_fsdp", help="checkpoint directory (default: ckpts/ignite_fsdp)")
    args = parser.parse_args()
    run = recover_in_place(train, max_restarts=2) if args.in_place else train
    run(args.dir)
