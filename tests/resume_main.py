"""One worker of a seeded 2-rank training that resumes from its newest checkpoint: run by torchrun.

``torchrun --standalone --nproc_per_node 2 --max-restarts 2 resume_main.py FRAMEWORK OUTDIR``

FRAMEWORK is ``ignite`` (``Checkpoint`` + ``DiskSaver`` every ``EVERY`` iterations, resumed with
``Checkpoint.load_objects``) or ``lightning`` (``ModelCheckpoint(every_n_train_steps=EVERY)``,
resumed with ``trainer.fit(..., ckpt_path=latest_checkpoint(dir))``). Both with ``FaultTolerance``
attached and ``DistributedSampler(shuffle=True, seed=0)`` over 400 samples, batch 4 per rank
(50 iterations an epoch), 3 epochs. Faults come from ``FTH_INJECT`` (first attempt only, the default),
or, for Ignite, ``TORN_SAVE=<iteration>``: rank 0 killed in the middle of writing that checkpoint, or
``HANG_IN_C=<iteration>``: rank 1 hung where no signal reaches it, or ``SWALLOW=1``: the training
step wraps its body in ``try/except Exception: pass`` and fires ``FTH_INJECT``'s injections inside it
(a user's step that swallows every error; the adapter fires none). Any number of ranks (the
sampler's replicas are torchrun's world size). ``BUCKETS=0``: Ignite: no ``DDPBucketLayout`` line in
``to_save`` (the adapter then saves the layout itself, finding the DDP from the step's closure; a
checkpoint written with the line gives the DDP nothing: an earlier version's checkpoint); Lightning:
the callback's ``on_fit_start`` does not give the layout back. Resumed from such a checkpoint, a run
at 3 ranks or more is inexact. ``FSDP=1``: the model (``HIDDEN`` 16 unless set) sharded with
FSDP2 (``fully_shard`` on each Linear, then the whole model) instead of DDP, Adam; Ignite: distributed
checkpoints (``DCPSaver``, ``load_dcp``, a ``ShardedState``); Lightning: ``ModelParallelStrategy``
(``fully_shard`` in ``configure_model``), its checkpoints one file each; rank 0 writes the full
weights (``full_tensor()``, on every rank) at the end. ``HIDDEN=<n>``: a model with a hidden layer;
``KEEP=<n>``: checkpoints kept (2); ``SAMPLES=<n>``: the data set's size (400); ``STEP_MS=<ms>``: each
training step also sleeps that long (a step of a real model's length: ``bench/goodput.py``). ``EVAL_TRAIN=1`` (Ignite):
an evaluator ``Engine`` runs over the training loader at each epoch's end (Ignite's cifar10 example).
``PERSISTENT=1``: the loader's workers are persistent, and a SIGTERM one gets is noted in
``OUTDIR/worker_sigterm.jsonl`` (with the attempt that started it).
``PY_RANDOM=1``: the training function seeds Python's ``random`` and numpy's global RNG as it starts
(as Lightning's ``seed_everything`` does in every call), and each training step adds a draw of each to
its inputs. ``LOADER=plain``: a plain ``DataLoader`` (resumed exactly only from an epoch's end). ``USER_SHAPE=1``
(Lightning): a user's shape: a validation loader and step each epoch, an epoch-stepped ``StepLR``,
``ModelCheckpoint(monitor="val_loss", save_top_k=KEEP, save_last=True)`` (at each epoch's end) instead
of one every ``EVERY`` steps.

Each attempt of each rank writes ``OUTDIR/attempt<A>_rank<R>.json`` at its start (which checkpoint
it resumed from, at which iteration) and appends the sample indices of every batch it trains to
``OUTDIR/batches<R>.jsonl``; rank 0 writes ``OUTDIR/weights.pt`` at the end. ``BENCH=1`` also
records the wall clock of the first trained step of the attempt.
"""

from __future__ import annotations

import time

T_START = time.time()  # the process's start, before the imports (the bench's breakdown)

import functools  # noqa: E402
import io
import json
import os
import random
import signal
import sys
import tempfile
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from regression_data import Regression  # noqa: E402 - beside this program

from fault_tolerant_handlers import RestartableDataLoader, latest_checkpoint, load_checkpoint  # noqa: E402

FRAMEWORK, OUT = sys.argv[1], Path(sys.argv[2])
RANK = int(os.environ["RANK"])
WORLD = int(os.environ.get("WORLD_SIZE", "2"))
BUCKETS = os.environ.get("BUCKETS", "1") == "1"
#: HIDDEN=<n>: the model is Linear(8, n), Tanh, Linear(n, 1) instead of Linear(8, 1) (whose 9 gradient
#: elements gloo happens to sum alike in either bucket layout at 4 ranks)
FSDP = os.environ.get("FSDP", "0") == "1"
HIDDEN = int(os.environ.get("HIDDEN", "16" if FSDP else "0"))
KEEP = int(os.environ.get("KEEP", "2"))  # checkpoints kept (n_saved, save_top_k)
#: With INPLACE=<max_restarts>, the run is wrapped in recover_in_place (INPLACE_REPLACE=0:
#: replace_dead=False): attempts then also count the recoveries in place (each writes its own
#: attempt<A>_rank<R>.json).
INPLACE = os.environ.get("INPLACE", "")
#: With INPLACE: SPARES=<k> launches k spare ranks (the last ones): recover_in_place(spares=k). RANK and
#: WORLD_SIZE are then read when the training function starts (a spare that takes a rank's place, and
#: the training world's size, are known only then).
SPARES = int(os.environ.get("SPARES", "0"))
USER = os.environ.get("USER_SHAPE", "0") == "1"
PY_RANDOM = os.environ.get("PY_RANDOM", "0") == "1"


class _Attempt:
    """The attempt: torchrun's restart count plus this process's recoveries in place."""

    def __int__(self) -> int:
        from fault_tolerant_handlers import recovery_attempt

        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + recovery_attempt()

    def __format__(self, spec: str) -> str:
        return format(int(self), spec)

    def __eq__(self, other: object) -> bool:
        return int(self) == other


ATTEMPT = _Attempt()
EVERY = int(os.environ.get("EVERY", "10"))
EVAL_TRAIN = os.environ.get("EVAL_TRAIN", "0") == "1"  # Ignite: an evaluator runs over the training loader
EPOCHS = int(os.environ.get("EPOCHS", "3"))
STEP_SEC = float(os.environ.get("STEP_MS", "0")) / 1000  # slept in each step, before its forward
WORKERS = int(os.environ.get("WORKERS", "2"))
PERSISTENT = os.environ.get("PERSISTENT", "0") == "1"  # the loader's workers kept between passes; SIGTERMs noted
RESUME = os.environ.get("RESUME", "1") == "1"  # 0: a restart from scratch (the bench's baseline)
PG_TIMEOUT = timedelta(seconds=float(os.environ.get("PG_TIMEOUT_SEC", "20")))
HANG = os.environ.get("FTH_HANG_TIMEOUT_SEC")
#: hang_timeout for FaultTolerance: the variable's seconds, or "auto"
HANG_TIMEOUT = None if not HANG else ("auto" if HANG.strip() == "auto" else timedelta(seconds=float(HANG)))
TORN_SAVE = int(os.environ.get("TORN_SAVE", "0"))
#: HANG_IN_C=<iteration>: Ignite's rank 1 hangs there in the first attempt where no signal reaches it
#: (the interrupting signal blocked: what a hang inside a C call looks like to the recovery).
HANG_IN_C = int(os.environ.get("HANG_IN_C", "0"))
#: SWALLOW=1 (Ignite): FTH_INJECT is taken out of the environment before the adapter reads it, and
#: fired by the training step, inside its try/except Exception: pass.
SWALLOW = os.environ.get("SWALLOW", "0") == "1"
if SWALLOW:
    from fault_tolerant_handlers.core.inject import Injector

    STEP_INJECTOR = Injector.from_env()
    os.environ.pop("FTH_INJECT", None)
#: STALL_AFTER_STEP=<rank>:<iteration> (Ignite): that rank, in the first attempt, waits after the optimizer
#: step of that iteration until its watchdog knows a peer failed (up to 30 s): the failure then reaches it
#: between the step's update and the iteration's end, deterministically.
STALL = tuple(int(v) for v in os.environ["STALL_AFTER_STEP"].split(":")) if os.environ.get("STALL_AFTER_STEP") else None
CKPT = OUT / "ckpt"
MARKS: dict[str, float] = {}  # the attempt's start-up, step by step (the bench's breakdown)


def mark(name: str) -> None:
    MARKS[name] = time.time()


def note_sigterm(attempt: int, rank: int, worker_id: int) -> None:
    """A worker's ``worker_init_fn`` (``PERSISTENT=1``): a SIGTERM it gets is noted in
    ``OUTDIR/worker_sigterm.jsonl`` (torch's last resort for a worker its shutdown waited for in vain)."""
    def noted(signum, frame):
        with open(OUT / "worker_sigterm.jsonl", "a") as f:
            f.write(json.dumps({"attempt": attempt, "rank": rank, "worker": worker_id, "pid": os.getpid()}) + "\n")
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, noted)


def make_loader() -> RestartableDataLoader:
    data = Regression(int(os.environ.get("SAMPLES", "400")))
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=RANK, shuffle=True, seed=0)
    if os.environ.get("LOADER") == "plain":
        return torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=WORKERS)
    persistent = PERSISTENT and WORKERS > 0
    return RestartableDataLoader(data, batch_size=4, sampler=sampler, num_workers=WORKERS, max_restarts=3,
                                 persistent_workers=persistent,
                                 worker_init_fn=functools.partial(note_sigterm, int(ATTEMPT), RANK) if persistent else None)


def make_model() -> torch.nn.Module:
    if not HIDDEN:
        return torch.nn.Linear(8, 1)
    return torch.nn.Sequential(torch.nn.Linear(8, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def seed_python_and_numpy() -> None:
    """``PY_RANDOM=1``: the training function starts: ``random`` and ``numpy.random`` seeded."""
    if PY_RANDOM:
        import numpy

        random.seed(0)
        numpy.random.seed(0)


def drawn(x: torch.Tensor) -> torch.Tensor:
    """``PY_RANDOM=1``: a training step's inputs plus a draw of ``random`` and one of ``numpy.random``."""
    if not PY_RANDOM:
        return x
    import numpy

    return x + 0.1 * random.random() + 0.1 * float(numpy.random.rand())


def in_memory(path: str | None) -> bool:
    """This process holds the checkpoint at ``path`` in memory (recovering in place: data.snapshots)."""
    from fault_tolerant_handlers.data import snapshots

    return path is not None and snapshots.newest(path) is not None


#: Ignite: a weak reference to each attempt's default group, in this process.
GROUPS: list = []


def world_seen() -> None:
    """The names of the world the training function sees (RANK and WORLD_SIZE read again: with
    spares, recover_in_place sets them to the training world's before the call)."""
    global RANK, WORLD
    RANK = int(os.environ["RANK"])
    WORLD = int(os.environ.get("WORLD_SIZE", "2"))


def note(info: dict) -> None:
    from fault_tolerant_handlers import spares_left

    group = dist.is_initialized()  # Lightning makes its group later, in fit
    info.update(dist_rank=dist.get_rank() if group else None, dist_world=dist.get_world_size() if group else None,
                env_world=int(os.environ["WORLD_SIZE"]),
                local_world=os.environ.get("LOCAL_WORLD_SIZE"), local_rank=os.environ.get("LOCAL_RANK"),
                spares_left=spares_left(),
                # the default groups of this process's earlier attempts that still live (each was destroyed)
                earlier_groups_alive=sum(ref() is not None for ref in GROUPS[:-1]))
    info.update(attempt=int(ATTEMPT), rank=RANK, pid=os.getpid(), t=time.time(), ckpt_files=sorted(os.listdir(CKPT)),
                started_at=T_START, marks=MARKS)
    (OUT / f"attempt{ATTEMPT}_rank{RANK}.json").write_text(json.dumps(info))


def done(loader) -> None:
    path = OUT / f"attempt{ATTEMPT}_rank{RANK}.json"
    info = json.loads(path.read_text())
    info.update(done=True, worker_restarts=getattr(loader, "restart_count", 0))
    path.write_text(json.dumps(info))


class Trace:
    def __init__(self) -> None:
        self.file = open(OUT / f"batches{RANK}.jsonl", "a")
        self.first = None

    def __call__(self, step: int, idx: torch.Tensor) -> None:
        if self.first is None:
            self.first = time.time()
            first = json.loads((OUT / f"attempt{ATTEMPT}_rank{RANK}.json").read_text())
            first["first_step_at"], first["first_step"], first["marks"] = self.first, step, MARKS
            (OUT / f"attempt{ATTEMPT}_rank{RANK}.json").write_text(json.dumps(first))
        self.file.write(json.dumps({"attempt": int(ATTEMPT), "step": step, "idx": idx.tolist(), "t": time.time()}) + "\n")
        self.file.flush()


def stall_until_a_peer_failed() -> None:
    from fault_tolerant_handlers.core.session import live_sessions

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(s.failure.peer_error is not None for s in live_sessions()):
        time.sleep(0.05)
    (OUT / f"stalled_rank{RANK}.json").write_text(json.dumps(
        {"peer_failed": any(s.failure.peer_error is not None for s in live_sessions())}))


def run_ignite() -> None:
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint
    from torch.nn.parallel import DistributedDataParallel

    from fault_tolerant_handlers.ignite import SafeDiskSaver

    class TornOnce(SafeDiskSaver):
        """With TORN_SAVE=<iteration>: rank 0 of the first attempt is SIGKILLed while writing that
        checkpoint, leaving half of it under its final name (a non-atomic write) and the start of
        DiskSaver's temporary file (an atomic one)."""

        def __call__(self, checkpoint, filename, metadata=None):
            if TORN_SAVE and ATTEMPT == 0 and RANK == 0 and filename == f"checkpoint_{TORN_SAVE}.pt":
                buf = io.BytesIO()
                torch.save(checkpoint, buf)
                data = buf.getvalue()
                with open(CKPT / filename, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                with tempfile.NamedTemporaryFile(delete=False, dir=CKPT) as tmp:
                    tmp.write(data[:100])
                os.kill(os.getpid(), signal.SIGKILL)
            super().__call__(checkpoint, filename, metadata)

    from fault_tolerant_handlers.ignite import FaultTolerance

    world_seen()
    seed_python_and_numpy()
    mark("imported")
    dynamo_at_start = "torch._dynamo" in sys.modules  # else DDP's constructor imports it (0.3-0.5 s)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    mark("process_group")
    GROUPS.append(weakref.ref(dist.group.WORLD))
    torch.manual_seed(0)
    model = make_model()
    if FSDP:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        ddp = fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mark("ddp_made")
    loader = make_loader()
    trace = Trace()

    def step(engine, batch):
        idx, x, y = batch
        trace(engine.state.iteration, idx)
        if HANG_IN_C and ATTEMPT == 0 and RANK == 1 and engine.state.iteration == HANG_IN_C:
            from fault_tolerant_handlers.recover import INTERRUPT_SIGNAL

            signal.pthread_sigmask(signal.SIG_BLOCK, {INTERRUPT_SIGNAL})
            while True:
                time.sleep(3600)
        if STEP_SEC:
            time.sleep(STEP_SEC)
        if SWALLOW:
            try:  # a user's step that swallows every error
                if STEP_INJECTOR is not None:
                    STEP_INJECTOR.maybe_fire(RANK, engine.state.iteration, engine.state.epoch)
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
            except Exception:
                pass
            return
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(drawn(x)), y).backward()
        opt.step()
        if STALL and ATTEMPT == 0 and (RANK, engine.state.iteration) == STALL:
            stall_until_a_peer_failed()

    trainer = Engine(step)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: loader.sampler.set_epoch(e.state.epoch - 1))
    FaultTolerance(hang_timeout=HANG_TIMEOUT).attach(trainer)
    if EVAL_TRAIN:  # Ignite's cifar10 example: an evaluator over the training loader at each epoch's end
        evaluator = Engine(lambda e, batch: None)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(loader))
    mark("attached")
    to_save = {"model": model, "optimizer": opt, "trainer": trainer, "loader": loader}
    if FSDP:
        from fault_tolerant_handlers import ShardedState
        from fault_tolerant_handlers.ignite import DCPSaver

        to_save = {"app": ShardedState(model, opt), "trainer": trainer, "loader": loader}
    elif BUCKETS:
        from fault_tolerant_handlers import DDPBucketLayout

        to_save["ddp"] = DDPBucketLayout(ddp)
    saver = Checkpoint(to_save, DCPSaver(CKPT) if FSDP else TornOnce(str(CKPT), require_empty=False), n_saved=KEEP,
                       global_step_transform=lambda e, _: e.state.iteration)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=EVERY), saver)
    mark("ddp")
    path = latest_checkpoint(CKPT) if RESUME else None
    mark("latest_checkpoint")
    kept = in_memory(path)  # before the load, which takes the copy
    if path and FSDP:  # every rank its shards (after a recovery in place: its live shard)
        from fault_tolerant_handlers import load_dcp

        load_dcp(to_save, path)
    elif path:  # load_checkpoint: torch.load, or this process's copy after a recovery in place
        Checkpoint.load_objects(to_load=to_save, checkpoint=load_checkpoint(path))
    mark("loaded")
    note({"resumed_from": path, "start_iteration": trainer.state.iteration, "in_memory": kept,
          "dynamo_at_start": dynamo_at_start})
    trainer.run(loader, max_epochs=EPOCHS)
    done(loader)
    weights = {k: (v.full_tensor() if FSDP else v).detach().clone() for k, v in model.state_dict().items()}
    if RANK == 0:
        torch.save(weights, OUT / "weights.pt")
    dist.destroy_process_group()


def run_lightning() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from fault_tolerant_handlers.lightning import FaultTolerance

    world_seen()
    seed_python_and_numpy()
    mark("imported")
    trace = Trace()
    if not BUCKETS:
        class FaultTolerance(FaultTolerance):  # noqa: F811 - the checkpoint's bucket layout not given back
            def on_fit_start(self, trainer, pl_module):
                pass

    class Marks(pl.Callback):
        """The start of fit, phase by phase (the bench's breakdown; the first batch's start once)."""

        def setup(self, trainer, pl_module, stage):
            mark("setup")  # after FaultTolerance's (its session: the side group, the watchdog)

        def on_fit_start(self, trainer, pl_module):
            mark("fit_start")  # the model wrapped in DDP

        def on_train_start(self, trainer, pl_module):
            mark("train_start")  # the checkpoint restored
            MARKS.pop("first_batch", None)  # an earlier attempt's, in this process

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            MARKS.setdefault("first_batch", time.time())  # the loader's workers and the first batch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = make_model()

        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            trace(self.global_step + 1, idx)
            if STEP_SEC:
                time.sleep(STEP_SEC)
            return torch.nn.functional.mse_loss(self.layer(drawn(x)), y)

        def configure_model(self):
            if FSDP:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for layer in self.layer:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.layer, mesh=mesh)

        def validation_step(self, batch, batch_idx):
            idx, x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

        def configure_optimizers(self):
            if FSDP:
                return torch.optim.Adam(self.parameters(), lr=0.01)
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            if USER:
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)}
            return opt

    if not USER:
        del Module.validation_step

    strategy = (ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, save_distributed_checkpoint=False,
                                      process_group_backend="gloo", timeout=PG_TIMEOUT) if FSDP
                else DDPStrategy(process_group_backend="gloo", timeout=PG_TIMEOUT))
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy,
        max_epochs=EPOCHS, logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[FaultTolerance(hang_timeout=HANG_TIMEOUT),
                   ModelCheckpoint(dirpath=str(CKPT), save_top_k=KEEP, monitor="val_loss", save_last=True) if USER
                   else ModelCheckpoint(dirpath=str(CKPT), every_n_train_steps=EVERY, save_top_k=KEEP, monitor="step",
                                        mode="max", save_last=True), Marks()],
    )
    path = latest_checkpoint(CKPT) if RESUME else None
    mark("latest_checkpoint")
    from fault_tolerant_handlers.data import snapshots

    # the step it resumes at (from the copy in memory without taking it: fit() takes it)
    kept = snapshots.newest(path) if path else None
    if kept is not None and not isinstance(kept, dict):  # a sharded model's live state: its own shard's snapshot
        start = kept.step
    else:
        # mmap: the step read, not the whole file (the bench's 100 MB shards: a 0.2 GB file)
        read = kept or (torch.load(path, map_location="cpu", weights_only=False, mmap=True) if path else None)
        start = read["global_step"] if read is not None else 0
    note({"resumed_from": path, "start_iteration": start, "in_memory": in_memory(path)})
    model = Module()
    val = None
    if USER:
        data = Regression(64)
        val = torch.utils.data.DataLoader(data, batch_size=4, num_workers=WORKERS,
                                          sampler=DistributedSampler(data, num_replicas=WORLD, rank=RANK, shuffle=False))
    trainer.fit(model, make_loader(), val, ckpt_path=path)
    done(trainer.train_dataloader)
    weights = {k: (v.full_tensor() if FSDP else v).detach().clone() for k, v in model.layer.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save(weights, OUT / "weights.pt")


if __name__ == "__main__":
    CKPT.mkdir(parents=True, exist_ok=True)
    if SPARES:  # every launched process, spares too: killed by pid (its process group) after the test
        (OUT / f"process_launched{RANK}.json").write_text(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0)}))
    if os.environ.get("CORRUPT_LIVE_STATE") == "1":  # the first segment of live state a rank receives
        from wire import flip_in_flight  # beside this program

        flip_in_flight(0)
    run = {"ignite": run_ignite, "lightning": run_lightning}[FRAMEWORK]
    if INPLACE:
        from fault_tolerant_handlers import recover_in_place

        # A script imports its framework at its top, before the training function runs: a replaced
        # rank's new process (a fork of the one torchrun started) then has it already.
        __import__("ignite.engine" if FRAMEWORK == "ignite" else "lightning.pytorch")
        run = recover_in_place(run, max_restarts=int(INPLACE), replace_dead=os.environ.get("INPLACE_REPLACE", "1") == "1",
                               spares=SPARES)
    result = run()
    if SPARES:  # what each launched process's call returned (a spare's: None)
        (OUT / f"returned_pid{os.getpid()}.json").write_text(json.dumps({"result": result, "pid": os.getpid()}))
