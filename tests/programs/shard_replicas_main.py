"""One rank of the shard-replica test: ``python shard_replicas_main.py <outdir>`` (``launch.run_ranks``).

An FSDP2 model (``fully_shard`` on every Linear, then the whole model; Adam) trains ``STEPS`` steps on
gloo with :class:`ShardReplicas` (hosts from ``HOSTS``, comma-separated, one per rank; ``PARTNERS``
copies). After each optimizer step the state (the model's and optimizer's ``state_dict()``, DTensor
values; the step; the RNG state) is handed to ``ShardReplicas.step`` with the RNG states, and each
step starts with ``ShardReplicas.wait_home()`` (the previous copy acknowledged). After the last step
each rank waits (bounded) until it holds every held rank's copy of that step, then records:

* ``own``: its local shards (``DTensor.to_local()``), saved to ``own-rank<r>.pt``;
* ``held``: each copy it holds (rank, step, checksum ok), each rebuilt (:func:`restore`) and saved as
  local shards to ``copy-of<r>-by<me>.pt``, and rebuilt as DTensors on its mesh, whose local shards
  must equal those;
* ``reloaded``: its own snapshot of the last step loaded back into the model and optimizer after one
  more step moved them (``load_state_dict``), and whether the local shards are the snapshot's again;
* ``flipped``: one byte of a held copy flipped; what :func:`restore` raised and what ``held()`` says;
* ``stopped``: the threads and counters after ``stop()``, and ``kept``: what ``abort()`` hands a
  failure's capture (its own two newest snapshots, the two newest copies of each rank it holds).

With ``PAUSE=<s>``, every rank pauses that long after step 2's copy was acknowledged (a long
evaluation; ``REPLICA_TIMEOUT=<s>``, the replicas group's timeout, 30 s by default).

With ``KILL=1`` (2 ranks), instead: once rank 0 holds rank 1's copy of the last step, rank 1 SIGKILLs
itself; rank 0 hands 5 more snapshots to ``ShardReplicas.step`` (its partner dead: the send fails or
blocks) and records how long each call took, then saves the copy it still holds of rank 1
(``after-death-copy-of1.pt``) and stops (``died``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import read_events  # noqa: E402 - tests/launch.py

from fault_tolerant_handlers.core.sharded import SnapshotChecksumError, _describe, restore
from fault_tolerant_handlers.data.replicas import ShardReplicas

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
OUT = Path(sys.argv[1])
STEPS = 4
BOUND_SEC = 60


def local_shards(state) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor in ``state``, a ``DTensor`` as its local shard (for comparing)."""
    _, leaves, tensors = _describe(state)
    return [(leaf["path"], t) for leaf, t in zip(leaves, tensors)]


def record(event: str, **fields) -> None:
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps({"event": event, **fields}) + "\n")


def state(model, optim, step):
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": step, "rng": torch.get_rng_state()}


def train_step(model, optim, step):
    g = torch.Generator().manual_seed(1000 * step + RANK)  # each rank its own data
    loss = model(torch.randn(8, 16, generator=g)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()


def plain(shards):
    return [(p, t.clone()) for p, t in shards]


def partner_dies(replicas, model, optim) -> None:
    signal_file = OUT / "rank0-holds-rank1"
    if RANK == 1:
        end = time.monotonic() + BOUND_SEC
        while not signal_file.exists() and time.monotonic() < end:
            time.sleep(0.05)
        record("dying", pid=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
    signal_file.touch()
    end = time.monotonic() + BOUND_SEC
    while time.monotonic() < end and not any(e["event"] == "dying" for e in read_events(OUT, 1)):
        time.sleep(0.05)
    pid = [e for e in read_events(OUT, 1) if e["event"] == "dying"][0]["pid"]
    while time.monotonic() < end and Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        time.sleep(0.05)
    calls = []
    for step in range(STEPS + 1, STEPS + 6):  # training goes on (the same state: the model's peer is gone)
        start = time.perf_counter()
        replicas.step(state(model, optim, step), step)
        calls.append(time.perf_counter() - start)
        time.sleep(0.2)
    flushed = replicas.flush(timedelta(seconds=BOUND_SEC))
    own_step = replicas.own().step  # this rank's own snapshots go on being sealed
    copy = replicas.copy_of(1)
    torch.save(plain(local_shards(restore(copy))), OUT / "after-death-copy-of1.pt")
    stopping = time.monotonic()
    replicas.stop(timedelta(seconds=BOUND_SEC))  # the receiver sees rank 1 gone at the group's timeout (30 s)
    record("died", stop_seconds=time.monotonic() - stopping, calls=calls, flushed=flushed, own_step=own_step,
           copy_step=copy.step, held=[[h.rank, h.step, h.checksum_ok] for h in replicas.held()],
           threads_alive=[t.name for t in replicas._threads if t.is_alive()], errors=replicas.stats.errors,
           replaced=replicas.stats.replaced)
    os._exit(0)  # the default group's peer is dead: no barrier, no teardown to wait for


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def main() -> None:
    import torch._dynamo  # noqa: F401 - imported before any group (see live_state_main.main)

    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FTH_TEST_PG_TIMEOUT", "20"))))
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    hosts = os.environ["HOSTS"].split(",") if os.environ.get("HOSTS") else None
    replicas = ShardReplicas(hosts, partners=int(os.environ.get("PARTNERS", "1")),
                             timeout=timedelta(seconds=float(os.environ.get("REPLICA_TIMEOUT", "30"))))
    record("partners", to=list(replicas.to), holds=replicas.holds)
    taken, home = [], []
    for step in range(1, STEPS + 1):
        home.append(replicas.wait_home())  # as a step starts: the previous step's copy acknowledged
        if step == 3 and os.environ.get("PAUSE"):
            time.sleep(float(os.environ["PAUSE"]))
        train_step(model, optim, step)
        start = time.perf_counter()
        replicas.step(state(model, optim, step), step, (torch.get_rng_state(), None))
        taken.append(time.perf_counter() - start)
    home.append(replicas.wait_home())
    own_state = state(model, optim, STEPS)
    torch.save(plain(local_shards(own_state)), OUT / f"own-rank{RANK}.pt")
    record("own", step=STEPS, leaves=len(local_shards(own_state)),
           dtensors=sum(type(v).__name__ == "DTensor" for v in own_state["model"].values()),
           step_seconds=taken, home=home, late=replicas.stats.late)
    end = time.monotonic() + BOUND_SEC
    while time.monotonic() < end and not all(
            (c := replicas.copy_of(r)) is not None and c.step == STEPS for r in replicas.holds):
        time.sleep(0.05)
    held = replicas.held()
    for r in replicas.holds:
        copy = replicas.copy_of(r)
        rebuilt = restore(copy)
        torch.save(plain(local_shards(rebuilt)), OUT / f"copy-of{r}-by{RANK}.pt")
        on_mesh = restore(copy, mesh=mesh)
        same = all(torch.equal(a.to_local() if hasattr(a, "to_local") else a, b)
                   for (_, a), (_, b) in zip(local_shards(on_mesh), local_shards(rebuilt)))
        kinds = sorted({type(v).__name__ for v in on_mesh["model"].values()})
        record("held_copy", rank=r, step=copy.step, on_mesh_same=same, model_kinds=kinds)
    record("held", held=[[h.rank, h.step, h.checksum_ok] for h in held])
    if os.environ.get("KILL"):
        partner_dies(replicas, model, optim)
        return

    flushed = replicas.flush(timedelta(seconds=BOUND_SEC))  # its own last snapshot sealed and sent
    own = replicas.own()  # this rank's sealed snapshot of the last step
    train_step(model, optim, STEPS + 1)  # the model moves on
    moved = not all(torch.equal(a, b) for (_, a), (_, b) in zip(local_shards(state(model, optim, 0)),
                                                                 torch.load(OUT / f"own-rank{RANK}.pt")))
    back = restore(own, mesh=mesh)
    model.load_state_dict(back["model"])
    optim.load_state_dict(back["optim"])
    reloaded = all(torch.equal(a, b) for (_, a), (_, b) in zip(local_shards(state(model, optim, 0))[:-1],
                                                                torch.load(OUT / f"own-rank{RANK}.pt")[:-1]))
    record("reloaded", step=own.step, moved=moved, same=reloaded, flushed=flushed)

    copy = replicas.copy_of(replicas.holds[0])
    copy.payload[copy.payload.numel() // 2] ^= 0x10
    try:
        restore(copy)
        raised = None
    except SnapshotChecksumError as e:
        raised = f"{type(e).__name__}: {e}"
    record("flipped", rank=copy.rank, raised=raised, held=[[h.rank, h.step, h.checksum_ok] for h in replicas.held()])

    replicas.stop(timedelta(seconds=BOUND_SEC))
    kept = [[s.rank, s.step] for s in replicas.abort()]  # what a failure's capture would take now
    record("stopped", threads_alive=[t.name for t in replicas._threads if t.is_alive()], kept=kept,
           sent=replicas.stats.sent, received=replicas.stats.received, replaced=replicas.stats.replaced,
           refused=replicas.stats.refused, errors=replicas.stats.errors)
    dist.barrier()
    dist.destroy_process_group()
    record("done")


if __name__ == "__main__":
    main()
