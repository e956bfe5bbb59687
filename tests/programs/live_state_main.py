"""One rank of the live-state tests: ``python live_state_main.py <outdir>`` (started by ``launch.run_ranks``).

Runs the cases named in ``CASES`` (comma-separated, see :data:`CASES`) one after another over one gloo
group. In each, every rank trains the same model and optimizer on the same data (so that their states
are the same), then some ranks are made behind, untrusted, zeroed, replaced or diverged; the ranks
agree on a source as a recovery does (each rank's :class:`LiveReport`, gathered, and rank 0's rule,
:func:`live_state.plan_live`, run on every rank), the state is transferred, loaded into the model and
optimizer, and one more step is trained. Each rank records the agreement, what the transfer raised,
the checksums before and after, whether it was written in place, and saves the state it ended with
(``<outdir>/<case>-rank<r>.pt``) for the test to compare tensor by tensor.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
import weakref
from datetime import timedelta
from pathlib import Path

import numpy
import torch
import torch.distributed as dist

from fault_tolerant_handlers.core.errors import StateTransferError
from fault_tolerant_handlers.recover import live_state, transfer as protocol
from fault_tolerant_handlers.recover.live_state import LiveReport

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wire import flip_in_flight  # noqa: E402 - tests/wire.py

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
OUT = Path(sys.argv[1])
STEPS = 3
#: Small chunks: a few tensors per chunk and tensors cut across chunks.
CHUNK = 4096

#: case -> (optimizer, {rank: role}, options). Roles: behind (one step fewer), untrusted (one step
#: fewer, then half an update: it failed inside an optimizer step, so it reports no state, as the data
#: layer captures none then), zeroed (every tensor zeroed in place, untrusted), replaced (no state),
#: diverged (a weight nudged, same step). Options: corrupt=k flips a byte of chunk k in
#: flight (as the receivers see it); refuse puts a leaf JSON cannot carry in the source's state;
#: change alters the source's state after the agreement; unchecked leaves the agreed checksum out.
CASES = {
    "equal": ("sgd", {}, {}),
    "behind": ("sgd", {1: "behind"}, {}),
    "untrusted": ("adam", {1: "untrusted"}, {}),
    "zeroed": ("sgd", {1: "zeroed"}, {}),
    "replaced": ("adam", {1: "replaced"}, {}),
    "diverged": ("sgd", {1: "diverged"}, {}),
    "corrupt": ("sgd", {1: "behind"}, {"corrupt": 1}),
    "refused": ("sgd", {1: "behind"}, {"refuse": True}),
    "changed": ("sgd", {1: "behind"}, {"change": True}),
    "mixed": ("adam", {1: "behind", 2: "untrusted", 3: "replaced"}, {"unchecked": True}),
    "majority": ("sgd", {0: "diverged"}, {}),
    "corrupt4": ("adam", {2: "replaced", 3: "behind"}, {"corrupt": 0}),
}


def record(event: str, **fields) -> None:
    fields.update(event=event, rank=RANK, t=time.time())
    with open(OUT / f"rank{RANK}.jsonl", "a") as f:
        f.write(json.dumps(fields, default=str) + "\n")


def build(optim: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8))
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt


def train(model, opt, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def state_of(model, opt, steps: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "engine": {"iteration": steps, "epoch": 1, "metrics": {"loss": 0.25}, "tag": b"\x00run\xff"},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": numpy.random.RandomState(steps).get_state()},
            # a leaf in three slices (12 kB, chunks of 4 kB), a strided view, an empty one, a 2-byte dtype
            "extra": {"big": torch.arange(1500, dtype=torch.float64) * steps,
                      "strided": (torch.arange(12.0) * steps).view(3, 4).t(), "empty": torch.empty(0, 4),
                      "half": torch.full((5,), steps, dtype=torch.bfloat16)}}


def run_case(name: str) -> None:
    optim, roles, options = CASES[name]
    role = roles.get(RANK, "ok")
    model, opt = build(optim)
    steps = STEPS - 1 if role in ("behind", "untrusted") else STEPS
    train(model, opt, steps)
    trusted = role not in ("untrusted", "zeroed")
    random.seed(steps)
    torch.manual_seed(steps)
    with torch.no_grad():
        if role == "untrusted":  # half an optimizer step: some weights moved, the counters not
            for p in list(model.parameters())[::2]:
                p.mul_(0.5)
        elif role == "zeroed":
            for t in [*model.state_dict().values(),
                      *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]:
                t.zero_()
        elif role == "diverged":
            next(model.parameters()).view(-1)[0] += 1e-3
    state = None if role == "replaced" else state_of(model, opt, steps)
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}

    digest = protocol.checksum(state) if state is not None else None
    if state is None or not trusted:
        mine = LiveReport(RANK, -1, "", "its process was replaced" if state is None else
                          "it failed inside an optimizer step (untrusted)")
    else:
        mine = LiveReport(RANK, steps, "iteration", "", digest)
    reports = [None] * WORLD
    dist.all_gather_object(reports, mine)
    agreed = live_state.plan_live(reports, WORLD)
    if options.get("refuse") and RANK == agreed.source:
        state["engine"]["handler"] = object()
    if options.get("change") and RANK == agreed.source:  # a bug: the state moves after the agreement
        with torch.no_grad():
            state["model"]["0.bias"].add_(1)
    record("agreed", case=name, role=role, step=agreed.step, source=agreed.source, checksum=agreed.checksum,
           receivers=list(agreed.receivers), whom=agreed.whom, fallback=agreed.why or None,
           before=digest, describe=agreed.describe())

    original_recv = protocol._recv
    if "corrupt" in options and RANK in agreed.receivers:
        flip_in_flight(options["corrupt"])
    started = time.monotonic()
    try:
        state = protocol.transfer(state, agreed.source, agreed.receivers, chunk_bytes=CHUNK,
                                    checksum=None if options.get("unchecked") else agreed.checksum)
    except StateTransferError as exc:
        record("transferred", case=name, raised="StateTransferError", failures=exc.failures, source=exc.source,
               message=str(exc))
        return
    except TypeError as exc:
        record("transferred", case=name, raised="TypeError", message=str(exc))
        return
    finally:
        protocol._recv = original_recv
    seconds = time.monotonic() - started
    after = protocol.checksum(state)
    in_place = all(v.data_ptr() == pointers[k] for k, v in state["model"].items()) if role != "replaced" else None
    torch.save(state, OUT / f"{name}-rank{RANK}.pt")
    if role == "replaced":
        model, opt = build(optim)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    loaded = protocol.checksum(state_of(model, opt, state["engine"]["iteration"]))
    train(model, opt, 1, start=state["engine"]["iteration"])
    record("transferred", case=name, raised=None, after=after, loaded=loaded, in_place=in_place, seconds=seconds,
           type_model=type(state["model"]).__name__, metadata=getattr(state["model"], "_metadata", None) is not None,
           next_step=protocol.checksum(model.state_dict()))


def main() -> None:
    # torch imports torch._dynamo at the first optimizer; a group that exists then is held by it for
    # good (torch 2.13: 11 references), outlives destroy_process_group and is destroyed at the
    # interpreter's exit instead, where gloo's teardown once aborted this program (SIGABRT,
    # "terminate called without an active exception", in a CI run). Imported first, nothing holds it.
    import torch._dynamo  # noqa: F401

    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("FTH_TEST_PG_TIMEOUT", "20"))))
    group = weakref.ref(dist.group.WORLD)
    for name in os.environ["CASES"].split(","):
        run_case(name)
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    record("done", group_freed=group() is None)


if __name__ == "__main__":
    main()
