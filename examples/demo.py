"""Two CPU ranks (gloo): one fails, and every rank stops together with the real cause; a DataLoader
worker killed and survived; a rank SIGKILLed and recovered in place with the uninterrupted run's weights.

    python examples/demo.py            # ours, with stock beside for comparison
    python examples/demo.py --no-stock # ours only

Scenes:
  1. ``one_rank_first``: rank 0 downloads a dataset first and the download fails. Rank 1 must not
     read the half-made data, and must not wait in a barrier.
  2. ``fail_together``: rank 1 hits a bad sample while rank 0 is still busy in the same section.
  3. (stock) the same as scene 1 with ``ignite.distributed.one_rank_first``, where rank 0 catches
     the error to retry later: rank 1 waits in the barrier until the process-group timeout (5 s
     here; 30 minutes by default) and never learns why.
  4. ``RestartableDataLoader``: one of its two workers SIGKILLed after the third batch; the epoch
     goes on with the same batches, in the same order, as a pass without the kill.
  5. (stock) the same kill with ``torch.utils.data.DataLoader``: the epoch ends with an error.
  6. ``recover_in_place``: ``examples/resume_ignite.py --in-place`` under torchrun, rank 1 SIGKILLed
     at iteration 14 (``FTH_INJECT=kill@rank=1,iteration=14``): the ranks carry on from their live
     state at iteration 13 (nothing trained twice) and end with the weights of an uninterrupted run
     (the same ``train``, run by the demo's two ranks after scenes 1-3), bit for bit.
  7. (stock) the same kill, relaunched by ``torchrun --max-restarts 1``: every rank starts again in a
     new process from the newest checkpoint (``latest_checkpoint``: iteration 10), and trains
     iterations 11-13 twice.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

from fault_tolerant_handlers import PeerFailedError, RestartableDataLoader, fail_together, one_rank_first

STOCK_TIMEOUT = timedelta(seconds=5)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, PeerFailedError):
        return f"PeerFailedError: {str(exc).splitlines()[0]}"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:110]}"


def _scene(rank: int, queue, scene: str, body) -> None:
    start = time.time()
    fault_at = [None]
    try:
        body(fault_at)
        what = "finished normally"
    except Exception as exc:  # noqa: BLE001 - the demo reports whatever each rank raised
        what = _describe(exc)
        if isinstance(exc, PeerFailedError) and exc.failed_at:
            fault_at[0] = exc.failed_at
    end = time.time()
    queue.put((scene, rank, what, end - (fault_at[0] or start)))


def _rank_main(rank: int, world: int, port: int, queue, stock: bool, reference: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    # A short timeout so the stock scene ends in seconds; ours never waits for it.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=STOCK_TIMEOUT)

    def download(fault_at):
        with one_rank_first(rank=0, name="download MNIST"):
            if rank == 0:
                time.sleep(0.5)
                fault_at[0] = time.time()
                raise OSError("mirror unreachable: https://example.invalid/mnist.tar.gz")
            print(f"[rank {rank}] reading the dataset (must not happen)", flush=True)

    def train_step(fault_at):
        with fail_together("train step", step=3, epoch=0):
            if rank == 1:
                fault_at[0] = time.time()
                raise ValueError("bad sample 17: image has 0 channels")
            time.sleep(1.0)  # rank 0 is still busy when rank 1 fails; both stop when it is done

    _scene(rank, queue, "1 one_rank_first (ours)", download)
    _scene(rank, queue, "2 fail_together (ours)", train_step)

    if stock:
        import ignite.distributed as idist

        def stock_download(fault_at):
            try:
                with idist.one_rank_first(rank=0):
                    if rank == 0:
                        fault_at[0] = time.time()
                        raise OSError("mirror unreachable: https://example.invalid/mnist.tar.gz")
            except OSError:
                if rank == 0:
                    time.sleep(STOCK_TIMEOUT.total_seconds() + 2)  # rank 0 backs off before a retry
                raise

        _scene(rank, queue, "3 one_rank_first (stock Ignite)", stock_download)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - after the stock scene the gloo pair may be closed
        pass
    if reference is not None:  # scene 6's uninterrupted run: examples/resume_ignite.py's train, in these processes
        from resume_ignite import train  # beside this file

        folder, second_port = reference
        os.environ.pop("FTH_INJECT", None)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(second_port))
        train(str(Path(folder) / "ckpts"), str(Path(folder) / "weights.pt"))



class Numbers(Dataset):
    """Sample ``i`` is ``[i]``, a little slow to make (the workers have work left at the kill)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.005)
        return torch.tensor([float(i)])


def _one_epoch(loader, kill_after: int | None, pids) -> tuple[list[torch.Tensor], str]:
    """The batches of one epoch, a worker SIGKILLed after batch ``kill_after``; and how it ended."""
    batches: list[torch.Tensor] = []
    try:
        for b, batch in enumerate(loader):
            batches.append(batch)
            if b == kill_after:
                pid = pids(loader)[0]
                os.kill(pid, signal.SIGKILL)
                print(f"  (SIGKILL to DataLoader worker pid {pid} after batch {b + 1})", flush=True)
        return batches, "finished normally"
    except Exception as exc:  # noqa: BLE001 - the demo reports what the loop raised
        return batches, _describe(exc)


def _dataloader_scenes(stock: bool) -> list[tuple[str, list[str]]]:
    data = Numbers()
    reference = list(DataLoader(data, batch_size=4))  # no worker, no kill
    scenes = []
    ours = RestartableDataLoader(data, batch_size=4, num_workers=2, max_restarts=3)
    batches, how = _one_epoch(ours, 2, lambda loader: loader.worker_pids)
    same = len(batches) == len(reference) and all(torch.equal(a, b) for a, b in zip(batches, reference))
    scenes.append(("4 a DataLoader worker killed (ours: RestartableDataLoader)", [
        f"the epoch: {how}, {len(batches)} of {len(reference)} batches, sum {sum(float(b.sum()) for b in batches):g} "
        f"(without the kill: {sum(float(b.sum()) for b in reference):g}); worker restarts: {ours.restart_count}",
        "the same batches in the same order as without the kill: " + ("yes" if same else "NO")]))
    if stock:
        plain = DataLoader(data, batch_size=4, num_workers=2)
        batches, how = _one_epoch(plain, 2, lambda loader: [p.pid for p in multiprocessing.active_children()])
        scenes.append(("5 a DataLoader worker killed (stock torch DataLoader)", [
            f"the epoch: {how}", f"after {len(batches)} of {len(reference)} batches"]))
    return scenes


EXAMPLE = Path(__file__).resolve().parent / "resume_ignite.py"
#: Bounds each torchrun of scenes 6 and 7 (imports and recovery included), on a loaded machine too.
TORCHRUN_DEADLINE_SEC = 240


def _kill_named(marker: str) -> None:
    """SIGKILL, by pid, every process whose command line names ``marker`` (a folder only this demo uses):
    torchrun starts each worker in a session of its own."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    os.kill(int(entry), signal.SIGKILL)
        except OSError:
            continue


def _start_torchrun(folder: Path, inject: str | None, options: list[str],
                    extra: list[str]) -> tuple[subprocess.Popen, float]:
    folder.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTH_")}
    env["PYTHONUNBUFFERED"] = "1"
    if inject:
        env["FTH_INJECT"] = inject
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *options,
           str(EXAMPLE), "--dir", str(folder / "ckpts"), "--save-weights", str(folder / "weights.pt"), *extra]
    out = open(folder / "output.txt", "w")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), time.time()


def _finish(run: tuple[subprocess.Popen, float], folder: Path, deadline: float) -> tuple[int | None, str, float]:
    """Wait for a torchrun until ``deadline``; the exit code (``None``: killed at the deadline), output, seconds."""
    proc, began = run
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    code = proc.poll()
    # the output's last write: torchrun's own end (the runs are waited for one after the other)
    took = ((folder / "output.txt").stat().st_mtime if code is not None else time.time()) - began
    if code is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _kill_named(str(folder))
    return code, (folder / "output.txt").read_text(errors="replace"), took


def _same_weights(a: Path, b: Path) -> str:
    if not (a.exists() and b.exists()):
        return "NOT saved (see the output above)"
    wa, wb = torch.load(a), torch.load(b)
    same = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return "equal to the uninterrupted run's, bit for bit" if same else "DIFFERENT from the uninterrupted run's"


#: Rank 1 is killed as iteration 14 starts: 13 is the last iteration every rank completed.
KILLED_AT = 14


def _resumed(text: str, rank: int) -> str:
    """Where ``rank``'s second attempt resumed, and the iterations it trains twice."""
    found = re.findall(rf"\[rank {rank}\] attempt 1: resumed from (\S+) at iteration (\d+)", text)
    if not found:
        return "nothing (no second attempt)"
    name, at = found[-1][0], int(found[-1][1])
    twice = KILLED_AT - 1 - at
    return f"{name} at iteration {at}: " + (f"iterations {at + 1}-{KILLED_AT - 1} trained twice" if twice > 0 else
                                             "nothing trained twice")


def _start_recoveries(tmp: str, stock: bool) -> dict:
    """Scenes 6 and 7's torchruns, started side by side: the kill recovered in place and (stock) the
    kill relaunched (the uninterrupted run is the demo's ranks' own, in ``tmp/uninterrupted``)."""
    kill = f"kill@rank=1,iteration={KILLED_AT}"
    folders = {name: Path(tmp) / name for name in ("uninterrupted", "in_place", "relaunch")}
    runs = {"in_place": _start_torchrun(folders["in_place"], kill, ["--max-restarts", "0"], ["--in-place"])}
    if stock:
        runs["relaunch"] = _start_torchrun(folders["relaunch"], kill, ["--max-restarts", "1"], [])
    return {"folders": folders, "runs": runs, "deadline": time.time() + TORCHRUN_DEADLINE_SEC}


def _recovery_scenes(started: dict, stock: bool) -> list[tuple[str, list[str]]]:
    folders, runs, deadline = started["folders"], started["runs"], started["deadline"]
    done = {name: _finish(run, folders[name], deadline) for name, run in runs.items()}
    reference = folders["uninterrupted"] / "weights.pt"
    scenes = []
    code, text, took = done["in_place"]
    reformed = [float(x) for x in re.findall(r"re-formed ([\d.]+) s after the failure reached this rank", text)]
    scenes.append(("6 a rank SIGKILLed at iteration 14 (ours: recover_in_place)", [
        f"torchrun exited {code} after {took:.1f} s",
        f"rank 0 carried on in its process from {_resumed(text, 0)}",
        f"rank 1 (a new process, forked by its keeper) from {_resumed(text, 1)}",
        "the group re-formed " + (f"{max(reformed):.2f} s after the failure reached the ranks" if reformed else
                                  "(no recovery line)") + ", in the same torchrun attempt",
        f"final weights: {_same_weights(reference, folders['in_place'] / 'weights.pt')}"]))
    if stock:
        code, text, took = done["relaunch"]
        scenes.append(("7 the same kill, relaunched (torchrun --max-restarts 1)", [
            f"torchrun exited {code} after {took:.1f} s",
            f"every rank started again in a new process, from {_resumed(text, 0)}",
            f"final weights: {_same_weights(reference, folders['relaunch'] / 'weights.pt')}"]))
    return scenes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-stock", action="store_true", help="skip the stock comparisons (scenes 3, 5 and 7)")
    args = parser.parse_args()
    stock = not args.no_stock
    if stock:
        try:
            import ignite  # noqa: F401
        except ImportError:
            print("pytorch-ignite is not installed: skipping the stock comparison", file=sys.stderr)
            stock = False
    try:
        import ignite  # noqa: F401
        recoveries = True
    except ImportError:
        print("pytorch-ignite is not installed: skipping scenes 6 and 7 (examples/resume_ignite.py)", file=sys.stderr)
        recoveries = False
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    results: list = []
    with tempfile.TemporaryDirectory(prefix="fth-demo-") as tmp:
        reference = (str(Path(tmp) / "uninterrupted"), _free_port()) if recoveries else None
        print(f"Starting {world} CPU ranks (gloo)...", flush=True)
        context = mp.start_processes(_rank_main, args=(world, _free_port(), queue, stock, reference), nprocs=world,
                                     join=False, start_method="spawn")
        started = None
        while True:  # scenes 1 and 2 first, alone; then the torchruns of scenes 6 and 7 start beside the rest
            while not queue.empty():
                results.append(queue.get())
            if recoveries and started is None and sum(r[0][0] in "12" for r in results) >= 2 * world:
                started = _start_recoveries(tmp, stock)
            if context.join(timeout=0.1):
                break
        while not queue.empty():
            results.append(queue.get())
        if recoveries and started is None:
            started = _start_recoveries(tmp, stock)
        later = _dataloader_scenes(stock) + (_recovery_scenes(started, stock) if recoveries else [])
    for scene in sorted({r[0] for r in results}):
        print(f"\nScene {scene}")
        for _, rank, what, latency in sorted(r for r in results if r[0] == scene):
            print(f"  rank {rank}: {what}")
            print(f"          stopped {latency:.2f} s after the fault")
    for scene, lines in later:
        print(f"\nScene {scene}")
        for line in lines:
            print(f"  {line}")
    print()


if __name__ == "__main__":
    main()
