"""One worker of the recovery-events scenario, run by torchrun (2 ranks, ``--max-restarts 0``):

``torchrun --standalone --nproc-per-node 2 recovery_events_main.py FRAMEWORK OUTDIR``

The training function, wrapped in ``recover_in_place(max_restarts=2)``, trains a seeded
``Linear(8, 1)`` under DDP on gloo for 20 iterations (one epoch, 160 samples, batch 4 per rank), a
checkpoint every 5, resumed from ``latest_checkpoint`` each call. The fault comes from ``FTH_INJECT``
(the test sets ``raise@rank=1,iteration=7``). FRAMEWORK is ``ignite`` (an ``Engine`` with
``FaultTolerance`` attached, its ``FaultToleranceEvents`` handled) or ``lightning`` (a ``Trainer`` with
``FaultTolerance``, a callback defining ``on_failure_seen``/``on_recovery_started``/``on_recovered``,
the module defining ``on_recovered``, and a logger that records what it is given).

Each rank appends one JSON object per line to ``OUTDIR/rank<R>.jsonl``: ``{"via": ..., "info": ...}``
for every event its handlers and hooks saw (``via``: ``ignite``, ``callback``, ``module``,
``on_recovery``), ``{"via": "state", ...}`` with ``engine.state.fault_tolerance`` at ``RECOVERED``,
``{"via": "logger", ...}`` for every ``log_metrics`` call of the logger, ``{"via": "callback_metrics",
...}`` at the end, and ``{"via": "done", "attempt": g, "history": [...]}`` when an attempt finishes
(``recovery_history()``). ``OUTDIR/attempt<g>_rank<R>.json`` names the process (for the test's cleanup).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from regression_data import Regression  # noqa: E402 - tests/

from fault_tolerant_handlers import (RestartableDataLoader, latest_checkpoint, load_checkpoint,  # noqa: E402
                                     on_recovery, recover_in_place, recovery_attempt, recovery_history)

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ["RANK"])
CKPT = OUT / "ckpt"
EVERY = 5
PG_TIMEOUT = timedelta(seconds=20)


def record(via: str, **fields) -> None:
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps({"via": via, "rank": RANK, "attempt": recovery_attempt(), **fields}, default=str) + "\n")


def as_json(info) -> dict:
    told = dataclasses.asdict(info)
    told["cause"].update(kind=info.cause.kind, message=info.cause.message, where=info.cause.where)  # read by name
    return told


def started() -> None:
    (OUT / f"attempt{recovery_attempt()}_rank{RANK}.json").write_text(
        json.dumps({"pid": os.getpgid(0), "own_pid": os.getpid(), "rank": RANK}))


def loader() -> RestartableDataLoader:
    data = Regression(160)
    return RestartableDataLoader(data, batch_size=4, num_workers=0,
                                 sampler=DistributedSampler(data, num_replicas=2, rank=RANK, shuffle=True, seed=0))


def run_ignite() -> None:
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint
    from torch.nn.parallel import DistributedDataParallel

    from fault_tolerant_handlers.ignite import FaultTolerance, FaultToleranceEvents, SafeDiskSaver

    started()
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = loader()

    def step(engine, batch):
        _, x, y = batch
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()

    trainer = Engine(step)
    FaultTolerance().attach(trainer)
    for event in FaultToleranceEvents:
        trainer.add_event_handler(event, lambda engine, name=event.name: record(
            "ignite", event=name, info=as_json(engine.state.fault_tolerance.last)))

    @trainer.on(FaultToleranceEvents.RECOVERED)
    def metrics(engine):
        record("state", metrics=dataclasses.asdict(engine.state.fault_tolerance), iteration=engine.state.iteration)

    to_save = {"model": model, "optimizer": opt, "trainer": trainer, "loader": data}
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=EVERY),
                              Checkpoint(to_save, SafeDiskSaver(str(CKPT), require_empty=False), n_saved=2,
                                         global_step_transform=lambda e, _: e.state.iteration))
    path = latest_checkpoint(CKPT)
    if path:
        Checkpoint.load_objects(to_load=to_save, checkpoint=load_checkpoint(path))
    trainer.run(data, max_epochs=1)
    record("done", history=[as_json(i) for i in recovery_history()], iteration=trainer.state.iteration)
    dist.destroy_process_group()


def run_lightning() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import DDPStrategy

    from fault_tolerant_handlers.lightning import FaultTolerance

    started()

    class Recording(Logger):
        """Records every log_metrics call it is given (on every rank: no rank_zero_only)."""

        @property
        def name(self):
            return "recording"

        @property
        def version(self):
            return 0

        def log_hyperparams(self, params, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            record("logger", metrics={k: float(v) for k, v in metrics.items()}, step=step)

    class Seen(Callback):
        def on_failure_seen(self, trainer, pl_module, info):
            record("callback", event="FAILURE_SEEN", info=as_json(info))

        def on_recovery_started(self, trainer, pl_module, info):
            record("callback", event="RECOVERY_STARTED", info=as_json(info))

        def on_recovered(self, trainer, pl_module, info):
            record("callback", event="RECOVERED", info=as_json(info), global_step=trainer.global_step)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            _, x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def on_recovered(self, info):
            record("module", event="RECOVERED", info=as_json(info))

    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo", timeout=PG_TIMEOUT),
        max_epochs=1, logger=Recording(), log_every_n_steps=50, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=True, use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[FaultTolerance(), Seen(),
                   ModelCheckpoint(dirpath=str(CKPT), every_n_train_steps=EVERY, save_top_k=2, monitor="step",
                                   mode="max")])
    trainer.fit(Module(), loader(), ckpt_path=latest_checkpoint(CKPT))
    record("callback_metrics", metrics={k: float(v) for k, v in trainer.callback_metrics.items()})
    record("done", history=[as_json(i) for i in recovery_history()], iteration=trainer.global_step)


if __name__ == "__main__":
    CKPT.mkdir(parents=True, exist_ok=True)
    # the framework's imports at the top, as a script has them (a replaced rank's process is a fork)
    __import__("ignite.engine" if FRAMEWORK == "ignite" else "lightning.pytorch")
    on_recovery(lambda info: record("on_recovery", event=info.phase.name, info=as_json(info)))
    recover_in_place({"ignite": run_ignite, "lightning": run_lightning}[FRAMEWORK], max_restarts=2)()
