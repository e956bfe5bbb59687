"""One worker of a job that seeds every random generator the same way in every torchrun attempt, as
the frameworks' own examples do, and resumes from its newest checkpoint (issue 46).

``torchrun --standalone --nproc-per-node 2 --max-restarts 3 seeded_relaunch_main.py FRAMEWORK OUTDIR``
(or 4 ranks: the data grows with the world size, 5 iterations an epoch at any)

``FRAMEWORK``:

* ``ignite``: ``idist.Parallel``, ``ignite.utils.manual_seed(seed + rank)``, ``idist.auto_model`` /
  ``auto_optim`` / ``auto_dataloader``, ``setup_common_training_handlers`` (its ``Checkpoint`` every 5
  iterations, its ``set_epoch``), ``FaultTolerance().attach(trainer)``, ``latest_checkpoint``;
* ``plain``: ``init_process_group``, ``random.seed(1)`` and ``torch.manual_seed(1)``, DDP, a snapshot
  on rank 0 at each epoch's end (as PyTorch's DDP tutorial), ``start_watchdog()``, one
  ``fail_together`` section per epoch, ``latest_checkpoint`` / ``load_checkpoint``;
* ``lightning``: ``seed_everything(1)``, ``Trainer(strategy="ddp", callbacks=[FaultTolerance(),
  ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])``, ``fit(ckpt_path=latest_checkpoint(...))``;
* ``fabric``: ``seed_everything(1)`` before ``start_watchdog()``, a ``DistributedSampler`` of its own,
  ``fabric.save`` at each epoch's end,
  ``fabric.load(latest_checkpoint(...))``, one ``fail_together`` section per epoch.

Every one: ``Linear(4, 1)`` over ``DistributedSampler(shuffle=True)`` batches of 4 (5 iterations an
epoch, ``EPOCHS`` epochs), deterministic otherwise. ``FAULTS`` lists ``attempt:rank:iteration``
(comma-separated): in attempt ``TORCHELASTIC_RESTART_COUNT`` that rank raises at that iteration
(1-based over the whole run); with ``EXIT_LINGER`` it then spends that many seconds in an exit hook
(a logger's flush). Each rank writes ``OUTDIR/attempt<A>_rank<R>.json`` (``resumed_at``:
the iteration resumed from; ``finished``) and, at the end, ``OUTDIR/final_rank<R>.pt`` (the weights).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import fault_tolerant_handlers  # noqa: F401 - before init_process_group: a store namespace per attempt
import torch
import torch.distributed as dist

FRAMEWORK, OUT = (sys.argv[1], Path(sys.argv[2])) if __name__ == "__main__" else ("", Path("."))
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "2"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULTS = {(int(a), int(r)): int(i) for a, r, i in (f.split(":") for f in os.environ.get("FAULTS", "").split(",") if f)}
EPOCH_LENGTH, EPOCHS, BATCH = 5, int(os.environ.get("EPOCHS", "5")), 4
STEP_TIME = float(os.environ.get("STEP_TIME", "0.05"))  # the watchdog's time to read what it would read
CKPT = OUT / "ckpt"


def note(**info) -> None:
    path = OUT / f"attempt{ATTEMPT}_rank{RANK}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **info, "pid": os.getpid()}))


def maybe_fail(iteration: int) -> None:
    time.sleep(STEP_TIME)
    if FAULTS.get((ATTEMPT, RANK)) == iteration:
        raise ValueError(f"bad batch at iteration {iteration} (attempt {ATTEMPT})")


class Samples(torch.utils.data.Dataset):
    def __init__(self, world: int = WORLD) -> None:
        self.world = world

    def __len__(self) -> int:
        return BATCH * self.world * EPOCH_LENGTH

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), torch.randn(1, generator=g)


def finish(model: torch.nn.Module) -> None:
    model = getattr(model, "module", model)  # DDP's
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, OUT / f"final_rank{RANK}.pt")


def ignite_training(local_rank: int, config: dict) -> None:
    import ignite.distributed as idist
    from ignite.contrib.engines import common
    from ignite.engine import Engine
    from ignite.handlers import Checkpoint
    from ignite.utils import manual_seed

    from fault_tolerant_handlers import latest_checkpoint
    from fault_tolerant_handlers.ignite import FaultTolerance

    manual_seed(config["seed"] + idist.get_rank())  # as every Ignite example
    model = idist.auto_model(torch.nn.Linear(4, 1))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05))
    loader = idist.auto_dataloader(Samples(), batch_size=BATCH * idist.get_world_size(), shuffle=True)

    def step(engine, batch):
        maybe_fail(engine.state.iteration)
        x, y = batch
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    trainer = Engine(step)
    FaultTolerance().attach(trainer)
    to_save = {"trainer": trainer, "model": model, "optimizer": optimizer}
    common.setup_common_training_handlers(trainer, train_sampler=loader.sampler, to_save=to_save,
                                          save_every_iters=EPOCH_LENGTH, output_path=str(CKPT), with_pbars=False)
    path = latest_checkpoint(CKPT)
    if path is not None:
        Checkpoint.load_objects(to_load=to_save, checkpoint=torch.load(path, weights_only=False))
    note(resumed_at=trainer.state.iteration)
    trainer.run(loader, max_epochs=EPOCHS)
    finish(model)


def run_ignite() -> None:
    import ignite.distributed as idist

    with idist.Parallel(backend="gloo") as parallel:
        parallel.run(ignite_training, {"seed": 543})


def run_plain() -> None:
    from datetime import timedelta

    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from fault_tolerant_handlers import fail_together, latest_checkpoint, load_checkpoint, start_watchdog

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    random.seed(1)
    torch.manual_seed(1)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = DistributedSampler(Samples(), shuffle=True)
    loader = DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    start_watchdog()
    first = 0
    path = latest_checkpoint(CKPT)
    if path is not None:
        snapshot = load_checkpoint(path, weights_only=True)
        model.module.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        first = snapshot["epochs_run"]
    note(resumed_at=first * EPOCH_LENGTH)
    for epoch in range(first, EPOCHS):
        sampler.set_epoch(epoch)
        with fail_together("train", epoch=epoch):
            for i, (x, y) in enumerate(loader):
                maybe_fail(epoch * EPOCH_LENGTH + i + 1)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
        if RANK == 0:
            CKPT.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epochs_run": epoch + 1},
                       CKPT / f"snapshot_{epoch + 1}.pt")
    finish(model.module)
    dist.destroy_process_group()


def run_lightning() -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from fault_tolerant_handlers import latest_checkpoint
    from fault_tolerant_handlers.lightning import FaultTolerance

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            maybe_fail(self.trainer.global_step + 1)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    L.seed_everything(1)
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[FaultTolerance(), ModelCheckpoint(dirpath=CKPT, every_n_epochs=1, save_top_k=-1)])
    loader = DataLoader(Samples(), batch_size=BATCH, shuffle=True)
    path = latest_checkpoint(CKPT)
    note(resumed_at=None if path is None else int(torch.load(path, weights_only=False)["global_step"]))
    trainer.fit(model, loader, ckpt_path=path)
    finish(model.layer)


def run_fabric() -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from fault_tolerant_handlers import fail_together, latest_checkpoint, start_watchdog

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(1)
    layer = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.05))
    # Not fabric.setup_dataloaders: its loader calls set_epoch with the number of its own iter() calls
    # in this process, which starts at 0 in every attempt (a resumed run would shuffle as epoch 0).
    sampler = torch.utils.data.DistributedSampler(Samples(), shuffle=True, seed=1)
    loader = DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler)
    start_watchdog()
    state = {"model": model, "optimizer": optimizer, "epochs_run": 0}
    path = latest_checkpoint(CKPT)
    if path is not None:
        fabric.load(path, state)
    first = state["epochs_run"]
    note(resumed_at=first * EPOCH_LENGTH)
    for epoch in range(first, EPOCHS):
        sampler.set_epoch(epoch)
        with fail_together("train", epoch=epoch):
            for i, (x, y) in enumerate(loader):
                maybe_fail(epoch * EPOCH_LENGTH + i + 1)
                optimizer.zero_grad()
                fabric.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
        state["epochs_run"] = epoch + 1
        fabric.save(CKPT / f"epoch_{epoch + 1}.ckpt", state)
    finish(layer)


if __name__ == "__main__":
    if (ATTEMPT, RANK) in FAULTS and os.environ.get("EXIT_LINGER"):  # a slow exit hook (a logger's flush)
        import atexit

        atexit.register(time.sleep, float(os.environ["EXIT_LINGER"]))
    OUT.mkdir(parents=True, exist_ok=True)
    note(started=time.time())
    {"ignite": run_ignite, "plain": run_plain, "lightning": run_lightning, "fabric": run_fabric}[FRAMEWORK]()
    note(finished=True)
