"""An Ignite training script shaped like PyTorch-Ignite's ``examples/cifar10/main.py`` (written for these
tests, data synthetic), with the documented lines added, run under torchrun with 2 or 4 gloo ranks (32
iterations an epoch at any world size).

    torchrun --nproc-per-node 2 user_ignite_main.py FORM OUTDIR

Like the example, ``training(local_rank, config)`` runs in every rank under ``idist.Parallel(backend)``;
it seeds torch, makes its output folder named by a timestamp taken at each call (and writes it into
``config["output_path"]``, as the example does), builds the model with
``idist.auto_model``, and hands the trainer to ``common.setup_common_training_handlers`` (a
``Checkpoint`` with a ``DiskSaver`` in that folder, ``filename_prefix="training"``, a
``PiecewiseLinear`` learning-rate schedule, ``TerminateOnNan``, a running average of the loss, the
sampler's ``set_epoch``). The lines added: a ``RestartableDataLoader`` (in ``to_save``),
``FaultTolerance().attach(trainer)`` and ``recover_in_place``.

FORM
    documented   ``with idist.Parallel(backend) as p: p.run(recover_in_place(training, max_restarts=2), config)``
                 (the form ``docs/recovering.md`` showed first)
    around       ``recover_in_place(main, max_restarts=2)(config)``, ``main`` opening ``idist.Parallel``
    plain        no ``recover_in_place`` (the reference: an uninterrupted run)

Environment: ``FOLDER`` ``every-rank`` (each rank makes its own timestamped folder, default) or ``rank-0``
(the example's: only rank 0 makes it, the other ranks keep the base folder); ``RESUME`` ``none`` (the example's
``resume_from=None``: the script loads nothing, default), ``latest`` (``latest_checkpoint(output_path)``
loaded with ``Checkpoint.load_objects``: every rank must make the same folder) or ``trainer``
(``latest_checkpoint(trainer)``, the documented line for a folder only rank 0 knows); ``FTH_INJECT`` the fault.

Each rank writes ``attempt<a>_rank<r>.json`` (pid, folder, where its trainer started and ended) and
appends every trained batch to ``batches<r>.jsonl``; rank 0 saves the final weights to ``weights.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timedelta
from pathlib import Path

import torch
import ignite.distributed as idist
from ignite.contrib.engines import common
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, PiecewiseLinear
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from fault_tolerant_handlers import RestartableDataLoader, latest_checkpoint, recover_in_place, recovery_attempt
from fault_tolerant_handlers.ignite import FaultTolerance

FORM, OUT = sys.argv[1], Path(sys.argv[2])
FOLDER = os.environ.get("FOLDER", "every-rank")
RESUME = os.environ.get("RESUME", "none")
TIMEOUT = timedelta(seconds=float(os.environ.get("PG_TIMEOUT_SEC", "20")))


def note(rank: int, **info) -> None:
    path = OUT / f"attempt{recovery_attempt()}_rank{rank}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, "pid": os.getpid(), **info}))


def training(local_rank: int, config: dict) -> None:
    rank = idist.get_rank()
    torch.manual_seed(config["seed"])

    output_path = Path(config["output_path"])
    if FOLDER == "every-rank" or rank == 0:  # as the example: a folder named by the time of this call
        now = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        output_path = output_path / f"linear_backend-{idist.backend()}-{idist.get_world_size()}_{now}"
        output_path.mkdir(parents=True, exist_ok=True)
        config["output_path"] = output_path.as_posix()  # as the example does: the config says where
    note(rank, folder=str(output_path))

    generator = torch.Generator().manual_seed(0)
    size = 128 * idist.get_world_size()
    x = torch.randn(size, 8, generator=generator)
    dataset = TensorDataset(torch.arange(size), x, x.sum(1, keepdim=True))
    sampler = DistributedSampler(dataset, num_replicas=idist.get_world_size(), rank=rank, shuffle=True, seed=0)
    loader = RestartableDataLoader(dataset, batch_size=4, sampler=sampler)  # 32 iterations per epoch and rank
    model = idist.auto_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lr_scheduler = PiecewiseLinear(optimizer, param_name="lr", milestones_values=[(0, 0.0), (8, 0.01), (64, 0.0)])

    def train_step(engine, batch):
        idx, inputs, targets = batch
        model.train()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        with open(OUT / f"batches{rank}.jsonl", "a") as f:
            f.write(json.dumps({"attempt": recovery_attempt(), "step": engine.state.iteration,
                                "idx": idx.tolist()}) + "\n")
        return {"batch loss": loss.item()}

    trainer = Engine(train_step)
    to_save = {"trainer": trainer, "model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
               "loader": loader}
    common.setup_common_training_handlers(trainer, train_sampler=sampler, to_save=to_save, save_every_iters=20,
                                          output_path=str(output_path), lr_scheduler=lr_scheduler,
                                          output_names=["batch loss"], with_pbars=False, clear_cuda_cache=False)
    FaultTolerance().attach(trainer)

    if RESUME in ("latest", "trainer"):
        path = latest_checkpoint(trainer if RESUME == "trainer" else output_path)
        note(rank, resumed_from=path)
        if path:
            Checkpoint.load_objects(to_load=to_save, checkpoint=path)

    @trainer.on(Events.STARTED)
    def started(engine):
        note(rank, start_iteration=engine.state.iteration)

    trainer.run(loader, max_epochs=config["num_epochs"])
    note(rank, done=True, iteration=trainer.state.iteration)
    if rank == 0:
        module = model.module if hasattr(model, "module") else model
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, OUT / "weights.pt")


def main(config: dict) -> None:
    with idist.Parallel(backend="gloo", timeout=TIMEOUT) as parallel:
        parallel.run(training, config)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    config = {"seed": 543, "num_epochs": 2, "output_path": str(OUT / "output")}
    if FORM == "documented":
        with idist.Parallel(backend="gloo", timeout=TIMEOUT) as parallel:
            parallel.run(recover_in_place(training, max_restarts=2), config)
    elif FORM == "around":
        recover_in_place(main, max_restarts=2)(config)
    elif FORM == "plain":
        main(config)
    else:
        raise SystemExit(f"unknown form {FORM!r}: documented, around or plain")
