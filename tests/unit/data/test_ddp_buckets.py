"""``DDPBucketLayout`` on one gloo rank: the layout read after the rebuild, given to a new DDP before its
first step, its checks (the exactness itself needs 3+ ranks: ``tests/distributed/test_exact_world_size.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fault_tolerant_handlers import DDPBucketLayout
from fault_tolerant_handlers.core import compat_torch


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make(**kwargs) -> DistributedDataParallel:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return DistributedDataParallel(net, **kwargs)


def steps(ddp: DistributedDataParallel, n: int) -> None:
    for _ in range(n):
        ddp(torch.randn(2, 4)).sum().backward()


def buckets_of(ddp: DistributedDataParallel) -> list[list[int]]:
    """The parameter indices of each of the reducer's buckets, in its order (public GradBucket API)."""
    params, _ = ddp._build_params_for_reducer()
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


@pytest.mark.parametrize("static_graph", [False, True])
def test_the_rebuilt_layout_is_given_to_a_new_ddp_before_its_first_step(group, static_graph):
    old = make(static_graph=static_graph)
    layout = DDPBucketLayout(old)
    assert layout.state_dict() == {"buckets": None}  # not rebuilt yet
    steps(old, 4 if static_graph else 3)  # rebuilt after the 1st backward (the 2nd with a static graph)
    saved = layout.state_dict()
    assert saved["buckets"] == buckets_of(old) == [[3, 2, 1, 0]]
    new = make(static_graph=static_graph)
    assert buckets_of(new) == [[0, 1, 2, 3]]  # stock: the first iteration's single bucket
    DDPBucketLayout(new).load_state_dict(saved)
    assert buckets_of(new) == saved["buckets"]
    steps(new, 4 if static_graph else 3)  # it trains, rebuilds to the same layout, and says so
    assert buckets_of(new) == saved["buckets"] and DDPBucketLayout(new).state_dict() == saved


def test_a_resumed_ddp_saved_before_its_own_rebuild_saves_the_layout_it_was_given(group):
    new = make()
    holder = DDPBucketLayout(new)
    holder.load_state_dict({"buckets": [[3, 2], [1, 0]]})
    assert buckets_of(new) == [[3, 2], [1, 0]] and holder.state_dict() == {"buckets": [[3, 2], [1, 0]]}


def test_comm_hooks_are_carried_over(group):
    calls = []

    def hook(state, bucket):  # one rank: the sum is the bucket itself
        calls.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp = make()
    ddp.register_comm_hook(None, hook)
    DDPBucketLayout(ddp).load_state_dict({"buckets": [[3, 2, 1, 0]]})
    steps(ddp, 1)
    assert calls == [0]


@pytest.mark.parametrize("bad, error", [
    ({"buckets": [[0, 1, 2]]}, ValueError),         # a parameter missing: another model
    ({"buckets": [[0, 1, 2, 3, 4]]}, ValueError),
    ({"buckets": "3 2 1 0"}, ValueError),
    ({"buckets": [[True, 1, 2, 3]]}, ValueError),
])
def test_a_layout_that_does_not_fit_is_refused(group, bad, error):
    ddp = make()
    with pytest.raises(error):
        DDPBucketLayout(ddp).load_state_dict(bad)
    assert buckets_of(ddp) == [[0, 1, 2, 3]]


def test_none_leaves_the_ddp_alone_and_a_module_is_refused(group):
    ddp = make()
    reducer = ddp.reducer
    DDPBucketLayout(ddp).load_state_dict({"buckets": None})
    assert ddp.reducer is reducer
    with pytest.raises(TypeError, match="takes a torch.nn.parallel.DistributedDataParallel, got Linear"):
        DDPBucketLayout(torch.nn.Linear(2, 2))


def test_a_torch_without_a_private_name_is_named(group, monkeypatch):
    monkeypatch.delattr(dist, "_compute_bucket_assignment_by_size")
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed\._compute_bucket_assignment_by_size, which torch"):
        compat_torch.check_ddp()


def test_a_torch_whose_init_helper_ignores_the_layout_is_an_error(group, monkeypatch):
    ddp = make()
    monkeypatch.setattr(ddp, "_ddp_init_helper", lambda *a: None)  # builds nothing: the old reducer stays
    with pytest.raises(RuntimeError, match="did not build the reducer with the given buckets"):
        DDPBucketLayout(ddp).load_state_dict({"buckets": [[3, 2, 1, 0]]})
