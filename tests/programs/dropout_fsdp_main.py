"""A user's Ignite + FSDP2 script whose step draws random numbers: ``examples/ignite_fsdp.py`` with
dropout in the model and noise added to each batch (``torch.randn_like``), each rank seeded apart
after the model is built (so each rank's RNG is its own), started by ``tests/distributed/test_sharded.py``.
Its final weights are an uninterrupted run's only if every rank's RNG goes on as it would have.

    FTH_INJECT=raise@rank=1,iteration=17 torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/dropout_fsdp_main.py
    FTH_INJECT=raise@rank=1,iteration=17 torchrun --standalone --nproc-per-node 2 examples/dropout_fsdp_main.py --in-place
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
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode())
        digest.update(param.full_tensor().detach().numpy().tobytes())
    return digest.hexdigest()


def train(ckpt_dir: str) -> str:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    torch.manual_seed(1 + rank)  # each rank's dropout masks and noise its own
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g))
    loader = RestartableDataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=0))

    def step(engine, batch):
        x, y = batch
        x = x + 0.01 * torch.randn_like(x)  # noise drawn in the step
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)  # dropout draws its mask here
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: loader.sampler.set_epoch(e.state.epoch - 1))
    FaultTolerance().attach(trainer)
    to_save = {"app": ShardedState(model, optimizer), "trainer": trainer, "loader": loader}
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=10),
                              Checkpoint(to_save, DCPSaver(ckpt_dir), n_saved=2,
                                         global_step_transform=lambda e, _: e.state.iteration))
    path = latest_checkpoint(ckpt_dir)
    if path:
        load_dcp(to_save, path)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + recovery_attempt()
    print(f"[rank {rank}] attempt {attempt}: {f'resumed from {os.path.basename(path)}' if path else 'started'} "
          f"at iteration {trainer.state.iteration}", flush=True)
    trainer.run(loader, max_epochs=3)
    digest = weights_sha256(model)
    print(f"[rank {rank}] finished at iteration {trainer.state.iteration}, weights sha256 {digest}", flush=True)
    dist.destroy_process_group()
    return digest


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--in-place", action="store_true")
    parser.add_argument("--dir", default="ckpts/dropout_fsdp")
    args = parser.parse_args()
    run = recover_in_place(train, max_restarts=2) if args.in_place else train
    run(args.dir)
