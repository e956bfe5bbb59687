"""One worker of the ``latest_checkpoint`` scenarios shaped like users' scripts, run by torchrun (2 ranks;
``ignite-folders`` also 4):

``torchrun --standalone --nproc-per-node 2 [--max-restarts 1] ckpt_users_main.py MODE OUTDIR``

MODE:

* ``ignite-folders``: shaped like Ignite's cifar10 example: ``recover_in_place`` around the training
  function, whose rank 0 makes a timestamped output folder (and writes it into the config) while the
  other ranks keep the base folder; the ``Checkpoint``'s ``DiskSaver`` and ``latest_checkpoint`` get
  ``config["output_path"]``. ``FTH_INJECT`` fails rank 1 in attempt 0.
* ``store-folders``: before any process group (as Lightning's ``fit`` makes it), under torchrun:
  rank 0 asks for one folder and rank 1 for another; then rank 0 alone calls it once more.
* ``ignite-best``: cifar10's pair of ``Checkpoint``s in one folder: the trainer's
  (``filename_prefix="training"``, every 5 iterations) and the best model's (``{"model": model}``,
  ``filename_prefix="best"``, scored by an evaluator at every epoch end), resumed with
  ``latest_checkpoint(trainer)``; under ``--max-restarts 1``.
* ``lightning-cli``: ``LightningCLI(run=False)`` with the default ``ModelCheckpoint`` and logger,
  ``cli.trainer.fit(..., ckpt_path=latest_checkpoint(cli.trainer))``; under ``--max-restarts 1``.
  ``lightning-default``: the same ``Trainer`` made without the CLI.

Each rank records JSON lines in ``OUTDIR/rank<R>.jsonl`` (what it got or raised, where it resumed);
rank 0 saves its final weights in ``OUTDIR/weights.pt``; ``OUTDIR/attempt<A>_rank<R>.json`` names the
process (the test's cleanup).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from regression_data import Regression  # noqa: E402 - tests/

from fault_tolerant_handlers import latest_checkpoint, recover_in_place, recovery_attempt  # noqa: E402

MODE, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
PG_TIMEOUT = timedelta(seconds=20)


def record(event: str, **fields) -> None:
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps({"event": event, "rank": RANK, "attempt": ATTEMPT, "in_place": recovery_attempt(),
                            "t": time.time(), **fields}, default=str) + "\n")


def started() -> None:
    (OUT / f"attempt{ATTEMPT}.{recovery_attempt()}_rank{RANK}.json").write_text(
        json.dumps({"pid": os.getpgid(0), "own_pid": os.getpid(), "rank": RANK}))


def ask(where, **kwargs):
    start = time.monotonic()
    try:
        path = latest_checkpoint(where, **kwargs)
    except Exception as err:
        record("asked", raised=type(err).__name__, message=str(err), seconds=time.monotonic() - start)
        raise
    record("asked", path=path, seconds=time.monotonic() - start)
    return path


def ignite_trainer(config: dict, *, best: bool):
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, DiskSaver, global_step_from_engine
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from fault_tolerant_handlers.ignite import FaultTolerance

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = Regression(80)
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)

    def step(engine, batch):
        _, x, y = batch
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        with open(OUT / f"batches{RANK}.jsonl", "a") as f:
            f.write(json.dumps([ATTEMPT, engine.state.iteration]) + "\n")

    trainer = Engine(step)
    FaultTolerance().attach(trainer)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: sampler.set_epoch(e.state.epoch - 1))
    to_save = {"trainer": trainer, "model": model, "optimizer": opt}
    saver = DiskSaver(config["output_path"], require_empty=False)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=5), Checkpoint(to_save, saver, filename_prefix="training",
                                                                              n_saved=2))
    if best:
        def evaluate(engine, batch):
            _, x, y = batch
            with torch.no_grad():
                engine.state.loss = torch.nn.functional.mse_loss(model(x), y).item()

        evaluator = Engine(evaluate)
        best_model = Checkpoint({"model": model}, DiskSaver(config["output_path"], require_empty=False),
                                filename_prefix="best", n_saved=2, score_name="test_accuracy",
                                score_function=lambda e: -e.state.loss, global_step_transform=global_step_from_engine(trainer))
        evaluator.add_event_handler(Events.COMPLETED, best_model)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: evaluator.run(DataLoader(Regression(8), batch_size=8)))
    return trainer, to_save, loader, model


def ignite_folders() -> None:
    def training(config: dict) -> None:
        started()
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
        if RANK == 0:  # as Ignite's cifar10 example: a timestamped folder, made on rank 0 only
            output_path = Path(config["output_path"]) / f"run_{time.strftime('%Y%m%d-%H%M%S')}_{recovery_attempt()}"
            output_path.mkdir(parents=True)
            config["output_path"] = str(output_path)
        from ignite.handlers import Checkpoint

        from fault_tolerant_handlers import load_checkpoint

        trainer, to_save, loader, _ = ignite_trainer(config, best=False)
        path = ask(config["output_path"])
        if path:
            Checkpoint.load_objects(to_load=to_save, checkpoint=load_checkpoint(path))
        trainer.run(loader, max_epochs=2)
        record("done", iteration=trainer.state.iteration)
        dist.destroy_process_group()

    recover_in_place(training, max_restarts=1)({"output_path": str(OUT / "output")})


def store_folders() -> None:
    started()
    try:
        ask(OUT / ("stamped" if RANK == 0 else "base"))
    except ValueError:
        pass
    if RANK == 0:
        try:
            ask(OUT / "stamped")
        except TimeoutError:
            pass


def ignite_best() -> None:
    from ignite.handlers import Checkpoint

    started()
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    trainer, to_save, loader, model = ignite_trainer({"output_path": str(OUT / "output")}, best=True)
    record("files", names=sorted(os.listdir(OUT / "output")) if (OUT / "output").is_dir() else [])
    path = ask(trainer)
    if path:
        Checkpoint.load_objects(to_load=to_save, checkpoint=path)
    record("resumed", iteration=trainer.state.iteration)
    trainer.run(loader, max_epochs=3)
    if RANK == 0:
        torch.save(model.state_dict(), OUT / "weights.pt")
    record("done", iteration=trainer.state.iteration)
    dist.destroy_process_group()


def lightning_cli() -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from fault_tolerant_handlers.lightning import FaultTolerance

    started()

    class Model(pl.LightningModule):
        def __init__(self, lr: float = 0.05):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            _, x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        def on_train_start(self):
            record("resumed", global_step=self.trainer.global_step)

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(Regression(80), batch_size=4, shuffle=True)

    defaults = {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_epochs": 3, "enable_progress_bar": False,
                "enable_model_summary": False, "default_root_dir": str(OUT), "callbacks": [FaultTolerance()]}
    if MODE == "lightning-cli":
        from lightning.pytorch.cli import LightningCLI

        torch.manual_seed(1234)  # not seed_everything: a relaunch reading attempt 0's records is issue 46 item 1
        cli = LightningCLI(Model, Data, run=False, seed_everything_default=False, args=[], trainer_defaults=defaults)
        trainer, model, data = cli.trainer, cli.model, cli.datamodule
    else:  # the same Trainer without the CLI (LightningCLI needs jsonargparse)
        torch.manual_seed(1234)
        trainer, model, data = pl.Trainer(**defaults), Model(), Data()
    path = ask(trainer)
    trainer.fit(model, datamodule=data, ckpt_path=path)
    if RANK == 0:
        torch.save(model.state_dict(), OUT / "weights.pt")
    record("done", global_step=trainer.global_step)


if __name__ == "__main__":
    {"ignite-folders": ignite_folders, "store-folders": store_folders, "ignite-best": ignite_best,
     "lightning-cli": lightning_cli, "lightning-default": lightning_cli}[MODE]()
