"""The store on a host of its own: the loss of training rank 0's host is recovered by a spare.

Without it, torchrun's agent on the rendezvous host (node-a, which also holds training rank 0) serves
the store every rank talks to, and losing node-a ends every rank
(``test_multihost_recover.py::test_a_lost_store_host_is_not_recovered_in_place_and_the_survivor_ends_at_once``).
Here the store has its own host, node-s (``Rig(..., store_host=True)``: it runs only
``python -m fault_tolerant_handlers.launchers.store_host``, no torchrun), and every host's torchrun
uses the static rendezvous at it (``--rdzv-backend static --rdzv-endpoint node-s:29400 --node-rank
i``): the workers' ``MASTER_ADDR`` is node-s. (torchrun's c10d rendezvous with ``is_host=false`` on
every agent does not do it: its agent rank 0 still serves the workers' store, on node-a.)

3 training-capable hosts x 1 rank, as ``test_multihost_spares.py``: ``multihost_recover_main.py``
with ``SPARES=1`` (``recover_in_place(max_restarts=2, spares=1)`` around ``resume_main.py``'s seeded
Ignite training: 150 iterations, ``FaultTolerance`` attached). node-a holds launched rank 0, node-b
launched rank 1, node-c launched rank 2: the spare.

* node-a dies whole (every process of its pid namespace SIGKILLed) once both training ranks are past
  iteration 15: the spare on node-c takes rank 0's place, receives rank 1's live state, and the job
  carries on at the failed step (nothing trained twice); the final weights are an uninterrupted 2-rank
  run's, bit for bit; rank 1 and the spare end their calls normally; the store host serves on;
* node-a's link goes down (``long``): the same takeover, and node-a's rank, alive but cut off from
  the store, ends naming why and never trains again;
* node-s dies whole (``long``): what the layout does not buy: every rank ends within seconds, none
  recovers in place, and no rank is blamed: each raises ``StoreLost`` naming the store's address (at
  setup each rank told whether its connection to the store leads to its own host: none did).

The time from the fault to the first step trained after it, on each training rank, is measured and
printed, and bounded only loosely (a timed assertion would be a flaky one on 2 shared cores). The
reference (an uninterrupted 2-rank run on one host) is ``test_multihost_spares.reference``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hosts
from test_multihost_recover import Run
from test_multihost_spares import assert_cut_off_ranks_ended, assert_spares_took, reference, run_spares

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(hosts.unavailable() is not None, reason=str(hosts.unavailable())),
    pytest.mark.timeout(300),
]
LAUNCHED = 3  # node-a, node-b, node-c: 1 rank each
TRAINING = 2  # the last launched rank (node-c's) is the spare


def assert_spare_took_rank_0(run: Run, ref: Path) -> dict[int, float]:
    """node-a's rank 0 was lost and the spare (launched rank 2, node-c) took its place and its roles (it
    decides the recovery and writes the final weights), its live state sent by rank 1, as
    :func:`~test_multihost_spares.assert_spares_took` checks; the store host served to the end."""
    assert run.store_alive_at_end, f"the store host ended before the run did\n{run.describe()}"
    assert "serves the job's c10d store on 10.231.0.254:29400" in run.log("node-s"), run.log("node-s")
    took = assert_spares_took(run, ref, lost_host=0)
    assert "[rank 1] rank 0 was lost with no keeper to replace it: spare launched rank 2 takes its place (0 spares " \
           "left after it)" in run.log("node-b"), run.describe()
    return took


def test_a_lost_host_of_rank_0_is_replaced_by_the_spare_when_the_store_has_a_host_of_its_own(tmp_path,
                                                                                             tmp_path_factory):
    ref = reference(tmp_path_factory)
    run = run_spares(tmp_path, "kill_host", fault_host=0, store_host=True)
    assert_spare_took_rank_0(run, ref)


@pytest.mark.long
def test_a_cut_link_of_rank_0_is_replaced_by_the_spare_and_the_cut_off_rank_never_trains_again(tmp_path,
                                                                                                tmp_path_factory):
    """node-a's link goes down: node-a's rank, alive and cut off from the store (on node-s) and from
    rank 1, trained nothing after the fault, raised ``PeerFailedError`` with the note and the log
    line saying why it was not recovered in place, and its process ended by itself, exiting 1."""
    ref = reference(tmp_path_factory)
    run = run_spares(tmp_path, "cut_link", fault_host=0, store_host=True)
    assert_spare_took_rank_0(run, ref)
    assert_cut_off_ranks_ended(run, lost_host=0)
    raised = run.event(0, "run_raised")
    assert raised["exc_type"] == "StoreLost" and raised["failed_rank"] is None, raised  # not itself, not rank 1


@pytest.mark.long
def test_a_lost_store_host_ends_every_rank_at_once_blaming_no_rank(tmp_path):
    """node-s dies whole: what the layout does not buy. Both training ranks and the spare lose the
    store every agreement lives in: no rank recovers in place or trains again, each training rank
    raises ``PeerFailedError`` of kind ``StoreLost`` naming the store's address and no rank (before,
    it named rank 0, whose host lived), with the note saying why, and every process ends within 20 s
    (not after the 60 s recovery join timeout)."""
    run = run_spares(tmp_path, "kill_store_host", fault_host=0, store_host=True, after_fault=40)
    assert run.fault_at is not None, run.describe()
    for rank in range(TRAINING):
        raised = run.event(rank, "run_raised")
        assert raised is not None and raised["raised"] == "PeerFailedError", f"rank {rank}: {raised}\n{run.describe()}"
        assert raised["exc_type"] == "StoreLost" and raised["failed_rank"] is None, f"rank {rank}: {raised}"
        assert "the c10d store at 10.231.0.254:29400, on a host of no rank's, " in raised["message"], raised["message"]
        assert any(n.startswith("fault-tolerant-handlers: not recovered in place: the c10d store was lost (every "
                                "recovery is agreed on in it), on a host no rank runs on") for n in raised["notes"]), \
            raised["notes"]
        assert [c["attempt"] for c in run.all(rank, "attempt")] == [0], run.describe()
        print(f"rank {rank}: raised {raised['exc_type']} {raised['t'] - run.fault_at:.2f} s after the fault: "
              f"{raised['message'][:200]}")
    assert not run.all(2, "attempt"), f"the spare trained\n{run.describe()}"
    for rank in range(LAUNCHED):
        assert rank in run.ended_at and run.ended_at[rank] - run.fault_at < 20, run.describe()
        print(f"launched rank {rank}: ended {run.ended_at[rank] - run.fault_at:.2f} s after the fault: "
              f"{(run.event(rank, 'exit') or {}).get('how')}")
