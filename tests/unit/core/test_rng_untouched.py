"""The library never draws from, nor reseeds, the user's random generators (issue 46).

A script that seeds ``random``, ``numpy.random`` and torch the same way in every torchrun attempt
(``ignite.utils.manual_seed``, Lightning's ``seed_everything``) must get a new run id in every attempt
(the run's store keys are under it: the same id would read the attempt before's failure records as
new failures), and its own random streams must be the ones it would have without the library.
The relaunches themselves are ``tests/distributed/test_seeded_relaunch.py``."""

from __future__ import annotations

import dataclasses
import random
from datetime import timedelta

import numpy
import pytest
import torch
import torch.distributed as dist

from fault_tolerant_handlers.core import session as session_mod
from fault_tolerant_handlers.core.procfs import RankTable
from fault_tolerant_handlers.core.failure import FailureRecord

from launch import free_port


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def _states():
    return random.getstate(), numpy.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


@pytest.mark.timeout(120)
def test_a_session_and_a_failure_leave_the_users_generators_alone_and_each_session_has_its_own_run_id(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=10))
    sessions = []
    try:
        run_ids = []
        for _ in range(2):  # two attempts of a script that seeds every generator the same way
            _seed_everything(1)
            before = _states()
            session = session_mod.Session()
            sessions.append(session)
            run_ids.append(session.run_id)
            try:
                raise ValueError("bad batch")
            except ValueError as exc:
                session.report_error(exc, section="train", step=3)
                assert session.agree("section", "train", exc, step=3) is None  # this rank raises its own
            assert session.failure.delivered  # the agreement failed
            assert _states() == before, "the library drew from or reseeded a user's generator"
        assert run_ids[0] != run_ids[1], run_ids
    finally:
        for session in sessions:
            session.abandon(shared_keys=True)
        dist.destroy_process_group()


def test_a_failure_record_of_another_process_than_the_ranks_is_never_this_runs_failure():
    """A record under this run's keys published by another process than the one the run knows for
    that rank (an earlier attempt's process) is not a failure of this run."""
    s = session_mod.Session.__new__(session_mod.Session)
    s.live_seq = 0
    s.table = RankTable(0, (0, 1), (1000, 1001), ("h", "h"), (1, 1), (11, 12), 0, 2)
    try:
        raise KeyError("stale")
    except KeyError as exc:
        record = FailureRecord.from_exception(exc, rank=1, section="train", seq=0)
    assert s.stale(dataclasses.replace(record, pid=999))  # attempt 0's rank 1
    assert not s.stale(dataclasses.replace(record, pid=1001))
    assert not s.stale(dataclasses.replace(record, pid=1001, rank=5))  # not of this group: left as it was
