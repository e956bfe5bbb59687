"""Live state with Ignite in one process (``IgniteLive`` in ``ignite.py``): what a failure at iteration 7
leaves is what the trainer's ``Checkpoint`` would have saved at iteration 6; loaded through
``latest_checkpoint`` and ``Checkpoint.load_objects(to_load, path)``, the run ends with the weights of
an uninterrupted one, bit for bit, with a step that draws from torch's RNG. The distributed cases
(2 ranks, raise and hang, Ignite and Lightning) are in ``tests/distributed/test_recover_in_place.py``."""

from __future__ import annotations

import os

import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver
from torch.utils.data import DataLoader, TensorDataset

from fault_tolerant_handlers import RestartableDataLoader, latest_checkpoint
from fault_tolerant_handlers.adapters import compat_ignite
from fault_tolerant_handlers.ignite import IgniteLive
from fault_tolerant_handlers.core import attempts
from fault_tolerant_handlers.data import live


@pytest.fixture
def recovering(monkeypatch):
    monkeypatch.setattr(attempts, "_running_pid", os.getpid())
    yield
    live.forget()


class Boom(Exception):
    pass


def job(ckpt, fail_at: int = 0, in_step: bool = False, plain: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    loader = (DataLoader if plain else RestartableDataLoader)(data, batch_size=4, shuffle=True,
                                                             generator=torch.Generator().manual_seed(1))

    def step(engine, batch):
        x, y = batch
        optimizer.zero_grad()
        noise = 0.01 * torch.randn_like(y)  # the step draws from torch's RNG: put back after a failure
        torch.nn.functional.mse_loss(model(x) + noise, y).backward()
        if in_step and engine.state.iteration == fail_at:
            handle = optimizer.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(Boom("inside the step")))
            try:
                optimizer.step()
            finally:
                handle.remove()
        optimizer.step()

    engine = Engine(step)
    capture = IgniteLive()
    capture.attach(engine)
    to_save = {"model": model, "optimizer": optimizer, "trainer": engine, **({} if plain else {"loader": loader})}
    engine.add_event_handler(Events.ITERATION_COMPLETED(every=1000), Checkpoint(to_save, DiskSaver(ckpt, require_empty=False)))
    if fail_at and not in_step:
        engine.add_event_handler(Events.ITERATION_STARTED(once=fail_at), lambda: (_ for _ in ()).throw(Boom("raised")))

    def failed(engine, exc):
        capture.failed()  # what FaultTolerance does at EXCEPTION_RAISED
        raise exc

    engine.add_event_handler(Events.EXCEPTION_RAISED, failed)
    return engine, model, loader, to_save


def test_a_failure_leaves_the_last_completed_iterations_state_and_resuming_from_it_is_exact(recovering, tmp_path, caplog):
    engine, model, loader, _ = job(tmp_path / "ref")
    engine.run(loader, max_epochs=2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(live.NotLive, match="no training loop"):  # its registration ended with the run
        live.collect()

    engine, model, loader, _ = job(tmp_path / "run", fail_at=17)  # in the second epoch (10 iterations each)
    with pytest.raises(Boom):
        engine.run(loader, max_epochs=2)
    captured = live.collect()
    assert captured.step == 16 and captured.state["trainer"]["iteration"] == 16
    assert captured.state["loader"]["batches_yielded"] == 6 and captured.rng is not None
    live.hold(captured)
    compat_ignite.hook_load_objects(take=live.take)  # what the recovery installs

    engine, model, loader, to_save = job(tmp_path / "run")
    path = latest_checkpoint(tmp_path / "run")
    assert path.endswith("live-state-step=16.pt")
    Checkpoint.load_objects(to_load=to_save, checkpoint=path)
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        engine.run(loader, max_epochs=2)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert "carries on from live state, iteration 16 (loaded by the script from live-state-step=16.pt): no step " \
           "computed twice" in caplog.text


def test_a_plain_dataloader_resumed_inside_an_epoch_is_not_said_to_carry_on_exactly(recovering, tmp_path, caplog):
    """A plain ``DataLoader`` (no ``state_dict``) resumed from the live state of iteration 16, inside the
    second epoch: the trainer carries on at iteration 16, but its loader draws the epoch's remaining 4
    iterations from the epoch's start. The line says so, not "no step computed twice" (which it said
    while the weights differed from an uninterrupted run's)."""
    engine, _, loader, _ = job(tmp_path, fail_at=17, plain=True)
    with pytest.raises(Boom):
        engine.run(loader, max_epochs=2)
    live.hold(live.collect())
    compat_ignite.hook_load_objects(take=live.take)

    engine, _, loader, to_save = job(tmp_path, plain=True)
    Checkpoint.load_objects(to_load=to_save, checkpoint=latest_checkpoint(tmp_path))
    with caplog.at_level("WARNING", logger="fault_tolerant_handlers"):
        engine.run(loader, max_epochs=2)
    assert "carries on from live state, iteration 16 (loaded by the script from live-state-step=16.pt): resumed at " \
           "that iteration, but the data of epoch 2 restarts from its beginning (DataLoader has no " \
           "state_dict/load_state_dict): Ignite draws its remaining 4 iterations from the start of the epoch, not " \
           "the batches an uninterrupted run trains" in caplog.text, caplog.text
    assert "no step computed twice" not in caplog.text


def test_a_failure_inside_the_optimizer_step_leaves_no_live_state(recovering, tmp_path):
    engine, _, loader, _ = job(tmp_path, fail_at=5, in_step=True)
    with pytest.raises(Boom):
        engine.run(loader, max_epochs=1)
    with pytest.raises(live.NotLive, match="inside the optimizer step of the iteration after 4"):
        live.collect()


def test_without_a_checkpoint_handler_it_says_so(recovering):
    engine = Engine(lambda e, b: (_ for _ in ()).throw(Boom("x")))
    capture = IgniteLive()
    capture.attach(engine)
    engine.add_event_handler(Events.EXCEPTION_RAISED, lambda e, exc: (capture.failed(), (_ for _ in ()).throw(exc)))
    with pytest.raises(Boom):
        engine.run([1, 2], max_epochs=1)
    with pytest.raises(live.NotLive, match="no ignite Checkpoint handler"):
        live.collect()


def fsdp_job(ckpt, fail_at: int = 0, whole: bool = True):
    """An FSDP2 model (one rank) and Adam in ``to_save`` as a ``ShardedState`` (``whole``) or as
    themselves; iteration ``fail_at`` raises."""
    from torch.distributed.fsdp import fully_shard

    from fault_tolerant_handlers import ShardedState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
    loader = RestartableDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))

    def step(engine, batch):
        x, y = batch
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x) + 0.01 * torch.randn_like(y), y).backward()
        optimizer.step()

    engine = Engine(step)
    capture = IgniteLive()
    capture.attach(engine)
    parts = {"app": ShardedState(model, optimizer)} if whole else {"model": model, "optimizer": optimizer}
    to_save = {**parts, "trainer": engine, "loader": loader}
    engine.add_event_handler(Events.ITERATION_COMPLETED(every=1000), Checkpoint(to_save, DiskSaver(ckpt, require_empty=False)))
    if fail_at:
        engine.add_event_handler(Events.ITERATION_STARTED(once=fail_at), lambda: (_ for _ in ()).throw(Boom("raised")))
    engine.add_event_handler(Events.EXCEPTION_RAISED, lambda e, exc: (capture.failed(), (_ for _ in ()).throw(exc)))
    return engine, model, loader, to_save


@pytest.mark.parametrize("whole", [True, False], ids=["ShardedState", "model-and-optimizer"])
@pytest.mark.parametrize("loads", [True, False], ids=["script-loads", "restored-at-started"])
def test_a_sharded_models_own_shard_carries_on_exactly(loads, whole, recovering, tmp_path):
    """FSDP2: what a failure at iteration 17 leaves is this rank's shard of iteration 16, a checksummed
    CPU snapshot; loaded by the script (``Checkpoint.load_objects(to_load, path)``) or, when it loads
    nothing, restored at ``STARTED`` on the new model's mesh, the run carries on at iteration 17 and
    ends with an uninterrupted run's weights, bit for bit; the model and its optimizer in ``to_save``
    as a ``ShardedState`` or as themselves. Before this, live state was refused for a sharded model."""
    import torch.distributed as dist

    from fault_tolerant_handlers.core import sharded

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine, model, loader, _ = fsdp_job(tmp_path / "ref", whole=whole)
        engine.run(loader, max_epochs=2)
        expected = [(k, v.to_local().clone()) for k, v in model.state_dict().items()]
        engine, model, loader, _ = fsdp_job(tmp_path / "run", fail_at=17, whole=whole)
        with pytest.raises(Boom):
            engine.run(loader, max_epochs=2)
        captured = live.collect()
        assert captured.step == 16 and isinstance(captured.state, sharded.Snapshot) and captured.state.verify()
        live.hold(captured)
        compat_ignite.hook_load_objects(take=live.take)  # what the recovery installs
        engine, model, loader, to_save = fsdp_job(tmp_path / "run", whole=whole)
        if loads:
            path = latest_checkpoint(tmp_path / "run")
            assert path.endswith("live-state-step=16.pt")
            Checkpoint.load_objects(to_load=to_save, checkpoint=path)
        ran = []
        engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: ran.append(e.state.iteration))
        engine.run(loader, max_epochs=2)
        assert ran == [17, 18, 19, 20]  # carried on at the failed iteration: none computed twice
        got = [(k, v.to_local()) for k, v in model.state_dict().items()]
        assert [k for k, _ in got] == [k for k, _ in expected]
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for (_, a), (_, b) in zip(got, expected))
    finally:
        from ignite import distributed as idist

        if idist.model_name() != "serial":
            idist.finalize()  # Ignite's Checkpoint saw the group: it forgets it (and destroys it)
        if dist.is_initialized():
            dist.destroy_process_group()
