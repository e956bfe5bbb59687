"""A small Lightning DDP training on 2 CPU ranks, with a fault injected on a chosen rank and step.

    python examples/lightning_ddp.py                                   # fault on rank 1 at step 10, with FaultTolerance
    python examples/lightning_ddp.py --fault rank0_callback            # a callback that only rank 0 runs raises
    python examples/lightning_ddp.py --on-exception-checkpoint         # with OnExceptionCheckpoint as well
    python examples/lightning_ddp.py --no-ft --on-exception-checkpoint --timeout 10   # stock: waits to the timeout
    python examples/lightning_ddp.py --strategy ddp_spawn

Every rank prints what ``trainer.fit`` raised and how long after the fault (with ``ddp_spawn`` the
ranks report to the parent, which prints what its ``trainer.fit`` raised). Faults:

* ``raise``: ``training_step`` raises on ``--fault-rank`` at global step ``--fault-step`` (after 0.3 s,
  so the other rank is already waiting in DDP's gradient all_reduce);
* ``rank0_callback``: a callback's ``@rank_zero_only`` block raises at that step;
* ``kill``: ``training_step`` SIGKILLs its own process on ``--fault-rank`` at that step (an OOM kill);
* ``data``: the training dataset raises on ``--fault-rank`` for the first sample of that step;
* ``validation``: ``validation_step`` raises on ``--fault-rank`` in the second validation;
* ``none``: a clean run.

Checkpoints go to ``--out/ckpts`` (``ModelCheckpoint`` every epoch, and ``on_exception.ckpt`` with
``--on-exception-checkpoint``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, Dataset

BATCH = 4
N_TRAIN = 64  # 8 batches per epoch and rank on 2 ranks
N_VAL = 16
FAULTS = ("none", "raise", "rank0_callback", "data", "validation", "kill")


def report_fault(exc: BaseException) -> None:
    """Default fault reporter: say it on stderr, then raise."""
    print(f"[rank {os.environ.get('RANK', os.environ.get('LOCAL_RANK', '?'))}] injecting {type(exc).__name__}: {exc}",
          flush=True)
    raise exc


@dataclass
class Fault:
    kind: str = "raise"
    rank: int = 1
    step: int = 10
    #: called with the exception to raise (it must raise it); picklable for ddp_spawn
    on_fault: Callable[[BaseException], None] = report_fault

    def fire(self, exc: BaseException) -> None:
        self.on_fault(exc)
        raise exc  # in case on_fault did not


class Samples(Dataset):
    def __init__(self, n: int, seed: int, fault: Optional[Fault] = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
        self.fault = fault
        self.rank = 0
        self.fetches = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        f = self.fault
        if f is not None and f.kind == "data" and self.rank == f.rank and self.fetches == f.step * BATCH:
            f.fire(ValueError(f"bad sample {i}: image has 0 channels"))
        self.fetches += 1
        return self.x[i], self.y[i]


class TinyData(pl.LightningDataModule):
    def __init__(self, fault: Optional[Fault] = None) -> None:
        super().__init__()
        self.fault = fault

    def setup(self, stage: str) -> None:
        self.train = Samples(N_TRAIN, 0, self.fault)
        self.train.rank = self.trainer.global_rank if self.trainer is not None else 0
        self.val = Samples(N_VAL, 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=BATCH, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=BATCH)


class TinyModel(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Linear(8, 1)
        self.fault: Optional[Fault] = None

    def training_step(self, batch, batch_idx):
        f = self.fault
        if f is not None and f.kind == "raise" and self.global_rank == f.rank and self.global_step == f.step:
            time.sleep(0.3)  # the other rank is in the gradient all_reduce by now
            f.fire(RuntimeError(f"CUDA-like failure at step {self.global_step}"))
        if f is not None and f.kind == "kill" and self.global_rank == f.rank and self.global_step == f.step:
            time.sleep(0.3)
            try:
                f.on_fault(ProcessLookupError(f"SIGKILL at step {self.global_step}"))  # report it, then die
            except ProcessLookupError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        f = self.fault
        if (f is not None and f.kind == "validation" and self.global_rank == f.rank and self.current_epoch == 1
                and batch_idx == 1):
            f.fire(KeyError("missing label column"))
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class RankZeroLogger(pl.Callback):
    """A callback doing rank-zero-only work (writing a log file) that fails at a given step."""

    def __init__(self, fault: Optional[Fault] = None) -> None:
        self.fault = fault

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._write(trainer.global_step)

    @rank_zero_only
    def _write(self, step: int) -> None:
        f = self.fault
        if f is not None and f.kind == "rank0_callback" and step == f.step:
            f.fire(PermissionError(f"cannot write /logs/step{step}.json"))


def make_trainer(
    strategy: str = "ddp",
    *,
    out: Path,
    fault: Optional[Fault] = None,
    fault_tolerance: bool = True,
    on_exception_checkpoint: bool = False,
    timeout: float = 20.0,
    max_epochs: int = 3,
    extra_callbacks: tuple = (),
) -> pl.Trainer:
    """A 2-rank CPU trainer with ModelCheckpoint (every epoch) and, optionally, FaultTolerance and
    OnExceptionCheckpoint."""
    callbacks: list[pl.Callback] = [RankZeroLogger(fault), *extra_callbacks]
    if fault_tolerance:
        from fault_tolerant_handlers.lightning import FaultTolerance

        callbacks.append(FaultTolerance(sync_every=4))
    callbacks.append(ModelCheckpoint(dirpath=out / "ckpts", filename="{epoch}-{step}", save_top_k=-1))
    if on_exception_checkpoint:
        callbacks.append(OnExceptionCheckpoint(dirpath=out / "ckpts"))
    start_method = {"ddp": "popen", "ddp_spawn": "spawn"}[strategy]
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(start_method=start_method, timeout=timedelta(seconds=timeout)),
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=("ddp", "ddp_spawn"), default="ddp")
    p.add_argument("--fault", choices=FAULTS, default="raise")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=10)
    p.add_argument("--on-exception-checkpoint", action="store_true", help="add OnExceptionCheckpoint")
    p.add_argument("--no-ft", action="store_true", help="stock Lightning: without FaultTolerance")
    p.add_argument("--timeout", type=float, default=20.0, help="process-group timeout, seconds (Lightning: 30 min)")
    p.add_argument("--max-epochs", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("lightning_ddp_out"))
    return p.parse_args(argv)


def _fault_file(out: Path) -> Path:
    return out / "fault_time.json"


def _record_fault(out: Path) -> Callable[[BaseException], None]:
    return functools.partial(_write_fault_time, str(_fault_file(out)))


def _write_fault_time(path: str, exc: BaseException) -> None:
    Path(path).write_text(json.dumps({"t": time.time(), "exc": f"{type(exc).__name__}: {exc}"}))
    report_fault(exc)


def main(argv=None) -> None:
    args = _parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    fault = None
    if args.fault != "none":
        fault = Fault(args.fault, args.fault_rank, args.fault_step, _record_fault(args.out))
    model, data = TinyModel(), TinyData(fault)
    model.fault = fault
    trainer = make_trainer(args.strategy, out=args.out, fault=fault, fault_tolerance=not args.no_ft,
                           on_exception_checkpoint=args.on_exception_checkpoint, timeout=args.timeout,
                           max_epochs=args.max_epochs)
    who = "parent" if args.strategy == "ddp_spawn" else f"rank {trainer.global_rank}"
    try:
        trainer.fit(model, datamodule=data)
    except BaseException as exc:  # noqa: BLE001 - a demo: say what was raised, then re-raise
        t = time.time()
        after = ""
        if _fault_file(args.out).exists():
            after = f" ({t - json.loads(_fault_file(args.out).read_text())['t']:.2f} s after the fault)"
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(f"{who}: trainer.fit raised {type(exc).__name__}: {first[:200]}{after}", flush=True)
        raise
    print(f"{who}: trainer.fit returned at epoch {trainer.current_epoch}, step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
