"""A small real DDP training with PyTorch-Ignite on CPU ranks, with a fault you choose.

    python examples/ignite_ddp.py                                  # 2 ranks, rank 1 raises at iteration 5
    python examples/ignite_ddp.py --fault rank_first               # rank 0 fails while preparing the data
    python examples/ignite_ddp.py --fault rank0_handler            # a logger that only rank 0 runs raises
    python examples/ignite_ddp.py --fault kill --fault-rank 1      # rank 1 is SIGKILLed mid-epoch
    python examples/ignite_ddp.py --fault hang --hang-timeout 5    # rank 1 hangs in time.sleep
    python examples/ignite_ddp.py --no-ft --timeout 20             # the same with stock Ignite

With ``FaultTolerance`` every rank's ``trainer.run`` raises within about a second, with the real
cause on every rank. Without it (``--no-ft``) the surviving rank sits in the gradient all_reduce
until the process-group timeout and never learns why.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import ignite.distributed as idist
import torch
from ignite.contrib.handlers import ProgressBar
from ignite.engine import Engine, Events
from torch import nn
from torch.utils.data import TensorDataset

FAULTS = ("none", "raise", "rank_first", "rank0_handler", "kill", "hang")


def build_dataset(args: argparse.Namespace) -> TensorDataset:
    """Stands for a download plus preprocessing; the first rank does it, the others read it."""
    if args.fault == "rank_first" and idist.get_rank() == 0:
        raise OSError("download failed: mirror unreachable")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def training(local_rank: int, args: argparse.Namespace) -> None:
    rank = idist.get_rank()
    if args.no_ft:
        rank_first = idist.one_rank_first
    else:
        from fault_tolerant_handlers import one_rank_first as rank_first

    with rank_first(rank=0):
        dataset = build_dataset(args)
    loader = idist.auto_dataloader(dataset, batch_size=32 * idist.get_world_size(), shuffle=True)
    model = idist.auto_model(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.01))

    def step(engine: Engine, batch) -> float:
        x, y = batch
        if rank == args.fault_rank and engine.state.iteration == args.fault_iter:
            if args.fault == "raise":
                raise ValueError(f"bad sample in batch {engine.state.iteration}")
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "hang":
                time.sleep(3600)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    if rank == 0:
        ProgressBar(persist=False).attach(trainer, output_transform=lambda loss: {"loss": loss})

        @trainer.on(Events.EPOCH_COMPLETED)
        def log_epoch(engine: Engine) -> None:  # a handler only rank 0 runs
            if args.fault == "rank0_handler":
                raise PermissionError("cannot write logs/epoch.json")

    if not args.no_ft:
        from fault_tolerant_handlers.ignite import FaultTolerance

        hang = timedelta(seconds=args.hang_timeout) if args.hang_timeout else None
        FaultTolerance(hang_timeout=hang).attach(trainer)  # on every rank
    start = time.time()
    try:
        trainer.run(loader, max_epochs=args.max_epochs)
    except Exception as exc:  # noqa: BLE001 - the example shows what each rank raised
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"[rank {rank}] trainer.run raised after {time.time() - start:.1f} s: {type(exc).__name__}: {first}",
              flush=True)
        raise
    print(f"[rank {rank}] finished {trainer.state.epoch} epochs, loss {trainer.state.output:.4f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2)")
    parser.add_argument("--fault", choices=FAULTS, default="raise")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-iter", type=int, default=5)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=None, help="seconds; enables hang detection")
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout in seconds")
    parser.add_argument("--no-ft", action="store_true", help="stock Ignite: no FaultTolerance")
    args = parser.parse_args()
    if args.fault == "hang" and not args.hang_timeout and not args.no_ft:
        parser.error("--fault hang needs --hang-timeout SECONDS (hang detection is opt-in)")
    if not 0 <= args.fault_rank < args.nproc:
        parser.error(f"--fault-rank must be in [0, {args.nproc - 1}]")
    with idist.Parallel(backend="gloo", nproc_per_node=args.nproc, timeout=timedelta(seconds=args.timeout)) as p:
        p.run(training, args)


if __name__ == "__main__":
    sys.exit(main())
