"""The Ignite adapter puts a DDP's bucket layout into a ``Checkpoint``'s ``to_save`` by itself and gives
it back after ``Checkpoint.load_objects``, on one gloo rank with a real ``Engine`` (the exactness itself
needs 3+ ranks: ``tests/distributed/test_exact_world_size.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver
from torch.nn.parallel import DistributedDataParallel

from fault_tolerant_handlers import DDPBucketLayout
from fault_tolerant_handlers.adapters.compat_ignite import reset_idist
from fault_tolerant_handlers.ignite import LAYOUT_KEY, add_bucket_layouts, find_ddp
from fault_tolerant_handlers.ignite import FaultTolerance


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    reset_idist()  # DiskSaver asked idist, which keeps its model of a distributed context otherwise


def build(tmp_path, wrapped: bool, extra: dict | None = None):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(engine, batch):
        opt.zero_grad()
        ddp(batch).sum().backward()
        opt.step()

    trainer = Engine(step)
    to_save = {"model": ddp if wrapped else net, "optimizer": opt, "trainer": trainer, **(extra or {})}
    handler = Checkpoint(to_save, DiskSaver(str(tmp_path / "ckpt"), require_empty=False), n_saved=1,
                         global_step_transform=lambda e, _: e.state.iteration)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=4), handler)
    return ddp, trainer, to_save, handler


def buckets_of(ddp: DistributedDataParallel) -> list[list[int]]:
    params, _ = ddp._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


@pytest.mark.parametrize("wrapped", [True, False], ids=["ddp-in-to_save", "module-in-to_save"])
def test_the_layout_is_saved_beside_the_model_and_given_back_after_load_objects(group, tmp_path, wrapped):
    ddp, trainer, to_save, handler = build(tmp_path, wrapped)
    FaultTolerance().attach(trainer)
    trainer.run([torch.randn(2, 4) for _ in range(4)], max_epochs=1)
    assert LAYOUT_KEY not in to_save  # the user's dict (what it loads with) is left as it is
    path = next((tmp_path / "ckpt").glob("checkpoint_4.pt"))
    saved = torch.load(path, weights_only=True)
    assert saved[LAYOUT_KEY] == {"buckets": [[3, 2, 1, 0]]} == {"buckets": buckets_of(ddp)}
    new, new_trainer, new_to_save, _ = build(tmp_path / "again", wrapped)
    assert buckets_of(new) == [[0, 1, 2, 3]]  # stock: the first iteration's single bucket
    Checkpoint.load_objects(to_load=new_to_save, checkpoint=str(path))
    assert buckets_of(new) == [[3, 2, 1, 0]] and new_trainer.state.iteration == 4


def test_an_explicit_layout_is_not_saved_twice_and_one_object_is_saved_alone(group, tmp_path):
    ddp, trainer, to_save, handler = build(tmp_path, True)
    to_save["ddp"] = DDPBucketLayout(ddp)  # the handler holds the user's dict: it sees the line
    add_bucket_layouts(trainer, [handler])
    assert handler.to_save is to_save and LAYOUT_KEY not in handler.to_save
    alone = Checkpoint({"model": ddp}, DiskSaver(str(tmp_path / "alone"), require_empty=False))
    add_bucket_layouts(trainer, [alone])
    assert list(alone.to_save) == ["model"]  # Ignite saves one object's state_dict itself, not a dict


def test_a_checkpoint_of_an_earlier_version_without_the_layout_loads(group, tmp_path):
    ddp, trainer, to_save, _ = build(tmp_path, True)
    old = {"model": ddp.module.state_dict(), "optimizer": to_save["optimizer"].state_dict(),
           "trainer": trainer.state_dict()}
    Checkpoint.load_objects(to_load=to_save, checkpoint=old)
    assert buckets_of(ddp) == [[0, 1, 2, 3]]


def test_the_ddp_of_a_model_is_found_from_the_trainers_step(group, tmp_path):
    ddp, trainer, to_save, _ = build(tmp_path, False)
    assert find_ddp(to_save.values()) is ddp
    assert find_ddp([to_save["model"]]) is None  # no engine to look in; at 1 rank no heap scan
