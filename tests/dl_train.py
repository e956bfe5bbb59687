"""One rank of a 2-rank training run with a RestartableDataLoader: ``python dl_train.py FRAMEWORK OUTDIR KILL``.

FRAMEWORK is ``ignite`` (an Ignite ``Engine`` over ``make_restartable(idist.auto_dataloader(...))``,
with the ranks' default start method set to spawn as under ``mp.spawn`` / ``idist.Parallel``) or
``lightning`` (``Trainer.fit`` with DDP on CPU; Lightning injects its DistributedSampler by
re-creating the loader from its init arguments). With KILL=1, rank 1 SIGKILLs one of its own
DataLoader workers from inside the training step of epoch 0, iteration 3, then keeps stepping for
0.3 s (torch's SIGCHLD handler would raise there). Each rank writes ``OUTDIR/rank<r>.json`` (its
restarts and the kill) and ``OUTDIR/weights<r>.pt``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fault_tolerant_handlers.dataloader import RestartableDataLoader, make_restartable  # noqa: E402

RANK = int(os.environ["RANK"])
FRAMEWORK, OUT, KILL = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
PG_TIMEOUT = timedelta(seconds=20)
KILL_AT = (0, 3)  # (epoch, iteration within the epoch) on rank 1
info: dict = {"rank": RANK, "kill": None}


class Regression(Dataset):
    """Sample i is a fixed function of i only: the same in every run and every worker."""

    def __len__(self) -> int:
        return 384

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        time.sleep(0.002)
        return x, x.sum(0, keepdim=True) * 0.5 + 1.0


def maybe_kill(loader, epoch: int, it: int) -> None:
    if not (KILL and RANK == 1 and (epoch, it) == KILL_AT):
        return
    pid = loader.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    info["kill"] = {"pid": pid, "t": time.time(), "epoch": epoch, "iteration": it}
    time.sleep(0.3)  # still inside the step: a SIGCHLD-raised RuntimeError would surface here


def finish(model, loader) -> None:
    info["loader_class"] = type(loader).__name__
    info["restarts"] = [dict(r.__dict__) for r in loader.restarts]
    info["restart_count"] = loader.restart_count
    (OUT / f"rank{RANK}.json").write_text(json.dumps(info, default=str))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, OUT / f"weights{RANK}.pt")


def run_ignite() -> None:
    import ignite.distributed as idist
    from ignite.engine import Engine, Events
    from torch.nn.parallel import DistributedDataParallel

    multiprocessing.set_start_method("spawn", force=True)  # what ranks started by mp.spawn get
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = make_restartable(idist.auto_dataloader(Regression(), batch_size=32, num_workers=2, shuffle=True), max_restarts=3)
    info["first_start_method"] = multiprocessing.get_start_method()

    def step(engine, batch):
        maybe_kill(loader, engine.state.epoch - 1, (engine.state.iteration - 1) % engine.state.epoch_length)
        x, y = batch
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    trainer = Engine(step)

    @trainer.on(Events.EPOCH_STARTED)
    def _(engine):
        loader.sampler.set_epoch(engine.state.epoch - 1)

    @trainer.on(Events.EPOCH_COMPLETED)
    def _(engine):  # what the Ignite adapter records
        engine.state.dataloader_restarts = loader.restart_count

    trainer.run(loader, max_epochs=2)
    info["engine_state_restarts"] = trainer.state.dataloader_restarts
    finish(model, loader)
    dist.destroy_process_group()


def run_lightning() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    pl.seed_everything(0, verbose=False)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            maybe_kill(self.trainer.train_dataloader, self.current_epoch, batch_idx)
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("dataloader_restarts", float(self.trainer.train_dataloader.restart_count), sync_dist=False)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    model = Module()
    loader = RestartableDataLoader(Regression(), batch_size=16, shuffle=True, num_workers=2, max_restarts=3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=PG_TIMEOUT),
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    used = trainer.train_dataloader
    info["logged_restarts"] = float(trainer.callback_metrics["dataloader_restarts"])
    finish(model, used)


if __name__ == "__main__":
    {"ignite": run_ignite, "lightning": run_lightning}[FRAMEWORK]()
