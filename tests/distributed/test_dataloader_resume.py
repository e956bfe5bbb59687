"""RestartableDataLoader.state_dict() / load_state_dict(): resume in a new loader, exactly.

Every case runs a seeded loader uninterrupted for three epochs (the reference), then the same
loader built afresh up to an interrupt point, takes ``state_dict()``, sends it through
``torch.save`` / ``torch.load(weights_only=True)`` (what a checkpoint does), loads it into a third
loader built afresh, and checks that what that loader yields from there is exactly the rest of the
reference: over workers (0, 2, 2 persistent) x interrupt points (epoch start, inside the epoch,
the last batch, past the end of the epoch). Workers started here are killed by pid after each test.
"""

from __future__ import annotations

import io
import os
import signal
import time

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from dl_stress import MapData, StreamData, kill_children
from fault_tolerant_handlers.data.loader import RestartableDataLoader

N, BATCH, EPOCHS = 96, 4, 3  # 24 batches an epoch (DistributedSampler: 12 per rank)


@pytest.fixture(autouse=True)
def _reap():
    try:
        yield
    finally:
        kill_children()


def build(kind: str, workers: str) -> RestartableDataLoader:
    kw = dict(num_workers=0 if workers == "0" else 2, persistent_workers=workers == "2p", max_restarts=5)
    data = MapData(N, delay=0.0005)
    if kind == "shuffle":
        return RestartableDataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3), **kw)
    if kind == "distributed":
        sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
        return RestartableDataLoader(data, batch_size=BATCH, sampler=sampler, **kw)
    if kind == "batch-sampler":
        bs = BatchSampler(RandomSampler(data, generator=torch.Generator().manual_seed(5)), batch_size=3, drop_last=False)
        return RestartableDataLoader(data, batch_sampler=bs, **kw)
    if kind == "iterable":
        return RestartableDataLoader(StreamData(N, delay=0.0005), batch_size=BATCH, **kw)
    raise ValueError(kind)


def start_epoch(loader, epoch: int):
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)  # as Ignite's EPOCH_STARTED / Lightning's fit loop do
    return iter(loader)


def batches(it, limit=None) -> list[list[int]]:
    out = []
    for batch in it:
        out.append(torch.as_tensor(batch).reshape(-1).tolist())
        if limit is not None and len(out) == limit:
            break
    return out


def through_checkpoint(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["loader"]


def reference(kind: str, workers: str) -> list[list[list[int]]]:
    loader = build(kind, workers)
    return [batches(start_epoch(loader, e)) for e in range(EPOCHS)]


def resumed(kind: str, workers: str, epoch: int, k: int, kill_after: int | None = None) -> tuple[list, list]:
    """Batches of epoch ``epoch`` from batch ``k`` on, and of the later epochs, after a resume."""
    first = build(kind, workers)
    for e in range(epoch):
        batches(start_epoch(first, e))
    it = start_epoch(first, epoch)
    taken = batches(it, limit=k) if k else []
    assert len(taken) == k
    state = through_checkpoint(first.state_dict())
    del it, first
    kill_children()

    second = build(kind, workers)
    second.load_state_dict(state)
    again = second.state_dict()  # lazy: nothing happened yet
    assert again["epoch"] == state["epoch"] and again["epoch_finished"] == state["epoch_finished"]
    assert state["epoch_finished"] or again["batches_yielded"] == state["batches_yielded"]
    it = start_epoch(second, epoch)
    rest = []
    if kill_after is not None:
        rest = batches(it, limit=kill_after)
        os.kill(second.worker_pids[0], signal.SIGKILL)
        time.sleep(0.05)
    rest += batches(it)
    later = [batches(start_epoch(second, e)) for e in range(epoch + 1, EPOCHS)]
    if kill_after is not None:
        assert second.restart_count == 1, second.restarts
    return rest, later


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["0", "2", "2p"])
@pytest.mark.parametrize("kind", ["shuffle", "distributed", "batch-sampler"])
def test_map_style_resume_equals_the_uninterrupted_epochs(kind, workers):
    ref = reference(kind, workers)
    length = len(ref[1])
    for epoch, k in [(0, 0), (1, 1), (1, 7), (1, length - 1), (2, 5)]:
        rest, later = resumed(kind, workers, epoch, k)
        assert rest == ref[epoch][k:], f"{kind}/{workers}: epoch {epoch} resumed at batch {k} differs"
        assert later == ref[epoch + 1:], f"{kind}/{workers}: the epochs after the resumed one differ"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", ["0", "2"])
def test_snapshot_after_the_last_batch_starts_the_next_epoch(workers):
    ref = reference("shuffle", workers)
    first = build("shuffle", workers)
    batches(start_epoch(first, 0))
    it = start_epoch(first, 1)
    batches(it, limit=len(ref[1]))  # every batch taken, StopIteration not yet seen (Ignite's case)
    state = through_checkpoint(first.state_dict())
    assert state["epoch"] == 1 and state["epoch_finished"] is True
    del it, first
    second = build("shuffle", workers)
    second.load_state_dict(state)
    assert second.state_dict()["epoch"] == 1
    assert batches(start_epoch(second, 2)) == ref[2]  # the generator is where the first loader left it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", ["2", "2p"])
def test_worker_killed_after_a_resume_is_still_exact(workers):
    ref = reference("distributed", workers)
    rest, later = resumed("distributed", workers, 1, 3, kill_after=2)
    assert rest == ref[1][3:] and later == ref[2:]


@pytest.mark.timeout(60)
def test_snapshot_taken_after_a_worker_restart_is_exact():
    ref = reference("shuffle", "2")
    loader = build("shuffle", "2")
    it = start_epoch(loader, 0)
    head = batches(it, limit=4)
    os.kill(loader.worker_pids[0], signal.SIGKILL)
    # the restart comes when the loader sees the death or needs a batch the dead worker owed (it may
    # have finished its batches in flight before the kill landed)
    while loader.restart_count == 0 and len(head) < len(ref[0]) - 2:
        head += batches(it, limit=1)
    assert loader.restart_count == 1 and head == ref[0][:len(head)]
    state = through_checkpoint(loader.state_dict())
    assert state["epoch"] == 0 and state["batches_yielded"] == len(head)
    other = build("shuffle", "2")
    other.load_state_dict(state)
    assert batches(iter(other)) == ref[0][len(head):] and batches(iter(other)) == ref[1]


@pytest.mark.timeout(60)
def test_shuffle_without_generator_resumes_its_epoch_and_leaves_the_global_rng_alone():
    def make():
        return RestartableDataLoader(MapData(N, 0), batch_size=BATCH, shuffle=True, num_workers=2)

    torch.manual_seed(11)
    ref = batches(iter(make()))
    torch.manual_seed(11)
    first = make()
    it = iter(first)
    head = batches(it, limit=5)
    state = through_checkpoint(first.state_dict())
    assert state["global_rng"] is not None
    torch.manual_seed(99)
    before = torch.get_rng_state()
    second = make()
    second.load_state_dict(state)
    rest = batches(iter(second))
    assert head + rest == ref
    # the global RNG was only borrowed for the sampler's first draw, and given back unchanged
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("workers", ["2", "2p"])
def test_iterable_dataset_resumes_through_torchdata(workers):
    ref = reference("iterable", workers)
    for epoch, k in [(0, 3), (1, 10)]:
        rest, later = resumed("iterable", workers, epoch, k)
        assert sorted(sum(rest, [])) == sorted(sum(ref[epoch][k:], [])), f"{workers}: resumed at {k}"
        assert rest == ref[epoch][k:]
        assert later == ref[epoch + 1:]


def _peek_then_train(loader, epoch):
    """PyTorch's DDP tutorial at each epoch's start: the batch size from a peek, then the epoch."""
    peek = next(iter(loader))
    assert len(peek) == (3 if isinstance(loader.batch_sampler, BatchSampler) and loader.batch_size is None else BATCH)
    return batches(start_epoch(loader, epoch))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, workers", [("distributed", "0"), ("distributed", "2"), ("distributed", "2p"),
                                           ("batch-sampler", "0"), ("batch-sampler", "2p")])
def test_a_peek_at_a_restored_loader_leaves_its_position(kind, workers, caplog):
    """``next(iter(loader))`` after ``load_state_dict`` (the tutorial's peek at each epoch's start)
    takes the restored pass's first batch and drops it: torch's loader starts the epoch over at the
    next iter(), so this one starts the restored position over, and trains exactly the rest of the
    epoch (before: batch 0 of a new pass, silently). Later peeks are ordinary passes."""
    caplog.set_level("INFO", logger="fault_tolerant_handlers")
    uninterrupted = build(kind, workers)
    ref = [_peek_then_train(uninterrupted, e) for e in range(EPOCHS)]  # a peek draws a RandomSampler's order
    first = build(kind, workers)
    _peek_then_train(first, 0)
    next(iter(first))
    it = start_epoch(first, 1)
    batches(it, limit=5)
    state = through_checkpoint(first.state_dict())
    del it, first
    kill_children()
    second = build(kind, workers)
    second.load_state_dict(state)
    assert _peek_then_train(second, 1) == ref[1][5:]
    assert _peek_then_train(second, 2) == ref[2]
    assert "this iter() resumes at batch 5 again" in caplog.text and "WARNING" not in caplog.text, caplog.text


@pytest.mark.timeout(60)
def test_a_restored_pass_that_moved_on_is_not_given_back(caplog):
    """Only a peek gives the position back: a pass that took two batches, one whose progress was
    saved by state_dict(), or one that reached the end of its data leaves the next iter() a new pass."""
    ref = reference("shuffle", "0")
    first = build("shuffle", "0")
    it = iter(first)
    batches(it, limit=5)
    state = through_checkpoint(first.state_dict())
    length = len(ref[0])

    def loaded(st=state):
        loader = build("shuffle", "0")
        loader.load_state_dict(st)
        return loader

    def dropped_after(k):
        """What a loader never restored gives: pass 0 dropped after k batches, then pass 1 (a
        RandomSampler draws from its generator once more at the end of its data: a pass dropped
        before draws other numbers for the next one)."""
        loader = build("shuffle", "0")
        assert batches(iter(loader), limit=k) == ref[0][:k]
        return batches(iter(loader))

    two = loaded()
    assert batches(iter(two), limit=2) == ref[0][5:7]
    assert batches(iter(two)) == dropped_after(7)  # the next pass (no batch of pass 0 again)
    saved = loaded()
    peek = iter(saved)
    next(peek)
    after = saved.state_dict()  # a checkpoint holds batch 6 as the next: it stands
    del peek
    assert after["batches_yielded"] == 6 and batches(iter(saved)) == dropped_after(6)
    last = loaded({**state, "batches_yielded": length - 1})
    assert batches(iter(last), limit=1) == ref[0][-1:]  # Ignite's epoch_length: no StopIteration seen
    assert batches(iter(last)) == dropped_after(length)
    assert "WARNING" not in caplog.text, caplog.text


@pytest.mark.timeout(60)
def test_a_peek_at_a_restored_iterable_loader_is_reported(caplog):
    """An IterableDataset's position cannot be told from the end of its data: a WARNING names the
    batch the peek took the restored pass from, and what the next pass does."""
    first = build("iterable", "2")
    it = iter(first)
    batches(it, limit=5)
    state = through_checkpoint(first.state_dict())
    del it, first
    kill_children()
    second = build("iterable", "2")
    second.load_state_dict(state)
    next(iter(second))
    rest = batches(iter(second))
    assert len(rest) == N // BATCH
    assert ("the pass restored by load_state_dict at batch 5 of pass 1 was dropped after 1 batch(es)" in caplog.text
            and "starts a new pass at batch 0, not at batch 5" in caplog.text), caplog.text


def test_restart_messages_name_the_pass_and_the_sampler_epoch():
    """The loader counts iter() calls, not training epochs: its messages say pass, and name the
    sampler's set_epoch (the training loop's epoch) when there is one."""
    from fault_tolerant_handlers.data.loader import WorkerRestart

    record = WorkerRestart(4, 8, 1, 4242, "SIGKILL", -9, "killed by SIGKILL", 0.0, sampler_epoch=2)
    assert record.describe() == "batch 8 of pass 5 (set_epoch(2)): worker 1 (pid 4242) killed by SIGKILL"
    assert "epoch 4" not in record.describe()


def test_state_is_small_plain_and_checked():
    loader = build("distributed", "0")
    it = start_epoch(loader, 0)
    batches(it, limit=2)
    state = loader.state_dict()
    assert state == {**state, "version": 1, "kind": "map", "epoch": 0, "batches_yielded": 2, "epoch_finished": False,
                     "sampler_epoch": 0, "generators": [], "global_rng": None}
    fresh = RestartableDataLoader(MapData(8), batch_size=2)
    assert fresh.state_dict()["epoch"] == -1 and fresh.state_dict()["epoch_finished"] is True
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['batches_yielded'"):
        fresh.load_state_dict({"version": 1, "kind": "map", "epoch": 0, "epoch_finished": False})
    with pytest.raises(ValueError, match="version 7 is not supported"):
        fresh.load_state_dict({**state, "version": 7})
    with pytest.raises(ValueError, match="'iterable'-style loader"):
        fresh.load_state_dict({**state, "kind": "iterable"})
    with pytest.raises(ValueError, match="batches_yielded=-3 must be an int >= 0"):
        fresh.load_state_dict({**state, "batches_yielded": -3})
    with pytest.raises(TypeError, match="expected a dict"):
        fresh.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="1 generator state"):
        fresh.load_state_dict({**state, "generators": [torch.Generator().get_state()]})
        iter(fresh)
    short = RestartableDataLoader(MapData(8), batch_size=2)
    short.load_state_dict({**state, "batches_yielded": 5})
    with pytest.raises(ValueError, match="the sampler now gives only 4 batches"):
        iter(short)


def test_ignite_mid_epoch_resume_warns_when_the_loader_would_start_over():
    from ignite.engine import Engine
    from torch.utils.data import DataLoader

    from fault_tolerant_handlers.ignite import check_mid_epoch_resume

    def engine_at(iteration, loader):
        engine = Engine(lambda e, b: None)
        engine.load_state_dict({"iteration": iteration, "epoch_length": 24, "max_epochs": 3})
        engine.state.dataloader = loader
        return engine

    plain = DataLoader(MapData(N, 0), batch_size=BATCH)
    with pytest.warns(RuntimeWarning, match=r"iteration 30 \(batch 6 of epoch 2.*restarts from its beginning \(DataLoader has no state_dict"):
        check_mid_epoch_resume(engine_at(30, plain))
    fresh = build("shuffle", "0")  # left out of to_load
    with pytest.warns(RuntimeWarning, match=r"next iter\(\) starts at batch 0 \(a new pass over the data\), not the batches an "
                                             r"uninterrupted run trains\. Was it left out"):
        check_mid_epoch_resume(engine_at(30, fresh))
    loaded = build("shuffle", "0")
    source = build("shuffle", "0")
    batches(iter(source))
    it = iter(source)
    batches(it, limit=6)
    loaded.load_state_dict(source.state_dict())
    assert check_mid_epoch_resume(engine_at(30, loaded)) is None  # where the engine is: silent
    assert check_mid_epoch_resume(engine_at(48, plain)) is None  # an epoch boundary: nothing to resume
    elsewhere = build("shuffle", "0")
    elsewhere.load_state_dict(source.state_dict())
    with pytest.warns(RuntimeWarning, match=r"starts at batch 6, not the batches an uninterrupted run trains\. Was it left out"):
        check_mid_epoch_resume(engine_at(33, elsewhere))  # restored, but not where the engine is


def test_ignite_resume_is_silent_when_an_evaluator_also_iterates_the_training_loader():
    """Ignite's cifar10 example shape: ``train_evaluator.run(train_loader)`` at each epoch end, a
    checkpoint (trainer and loader) every few iterations. The loader counts the evaluator's passes
    too, so its pass number is not the trainer's epoch; the loader was restored where the trainer
    resumes, and nothing is said."""
    from ignite.engine import Engine, Events

    from fault_tolerant_handlers.ignite import check_mid_epoch_resume

    saved = {}

    def run(loader, max_epochs, load=None):
        trainer, evaluator = Engine(lambda e, b: None), Engine(lambda e, b: None)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: evaluator.run(loader))

        @trainer.on(Events.ITERATION_COMPLETED(every=10))
        def save():
            saved["checkpoint"] = through_checkpoint({"trainer": trainer.state_dict(), "loader": loader.state_dict()})

        if load is not None:
            trainer.load_state_dict(load["trainer"])
            loader.load_state_dict(load["loader"])
        trainer.state.dataloader = loader
        return trainer, check_mid_epoch_resume(trainer) if load is not None else trainer.run(loader, max_epochs)

    run(build("shuffle", "0"), max_epochs=2)  # iterations 1-48, one evaluation pass after each epoch
    checkpoint = saved["checkpoint"]
    assert checkpoint["trainer"]["iteration"] == 40 and checkpoint["loader"]["epoch"] == 2  # 3rd pass: epoch 2
    trainer, warning = run(build("shuffle", "0"), max_epochs=3, load=checkpoint)
    assert trainer.state.iteration == 40 and warning is None
