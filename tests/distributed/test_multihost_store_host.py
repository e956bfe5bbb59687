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
  recovers in place (their message still names rank 0 as the store's host: the watchdog's
  ``StoreLossProbe`` takes the store for rank 0's whatever the layout).

The time from the fault to the first step trained after it, on each training rank, is measured and
printed, and bounded only loosely (a timed assertion would be a flaky one on 2 shared cores). The
reference (an uninterrupted 2-rank run on one host) is ``test_multihost_spares.reference``'s.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import hosts
from hosts import Rig
from launch import read_events
from test_multihost_recover import MAIN, NOT_RECOVERED, Run, json_lines
from test_multihost_spares import ENV, reference

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(hosts.unavailable() is not None, reason=str(hosts.unavailable())),
    pytest.mark.timeout(300),
]
LAUNCHED = 3  # node-a, node-b, node-c: 1 rank each
TRAINING = 2  # the last launched rank (node-c's) is the spare


def run_store_host(workdir: Path, fault: str = "none", *, fault_host: int = 0, after_fault: float = 60.0,
                   deadline: float = 200.0) -> Run:
    """Run ``multihost_recover_main.py`` on 3 simulated hosts (1 rank each, the last a spare) and the
    store host node-s; inject ``fault`` (``kill_host``, ``cut_link``, ``kill_store_host``: node-s, or
    ``none``) at host ``fault_host`` once both training ranks are ready. The run lasts until every
    launched rank that did not die with its host has recorded its exit and every such rank's process
    has ended (or ``after_fault`` s after the fault, or ``deadline``); then every process and namespace
    is removed."""
    out = workdir / f"store-host-{fault}-{fault_host}"
    out.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + deadline
    with Rig(LAUNCHED, out, store_host=True) as rig:
        run = Run(out, fault, None, rig)
        rig.start([str(MAIN), str(out)], env={**ENV, "SPARES": "1"})
        pids: dict[int, int] = {}  # launched rank -> pid on the machine of the process torchrun started
        while time.monotonic() < end:
            run.watch(LAUNCHED, pids)
            if run.fault_at is None and fault != "none" and len(pids) == LAUNCHED \
                    and all(run.event(r, "ready") for r in range(TRAINING)):
                if fault == "kill_store_host":
                    rig.kill_store_host()
                else:
                    getattr(rig, fault)(fault_host)
                run.fault_at = time.time()
                end = min(end, time.monotonic() + after_fault)
            expected = [r for r in range(LAUNCHED) if not (fault == "kill_host" and r == fault_host)]
            if (fault == "none" or run.fault_at is not None) and len(run.ended_at) == LAUNCHED \
                    and all(run.event(r, "exit") for r in expected):
                break
            if fault == "kill_store_host" and run.fault_at is not None and len(run.ended_at) == LAUNCHED:
                break  # with their store gone, the agents may be left blocked
            time.sleep(0.05)
        run.agents_at_end = {h.name: h.proc.poll() if h.proc is not None else None for h in rig.hosts}
        run.store_alive_at_end = rig.store.proc.poll() is None and not rig.store.killed
        rig.close()
        for rank in range(LAUNCHED):
            run.events[rank] = read_events(out, rank)
    return run


def assert_spare_took_rank_0(run: Run, ref: Path) -> dict[int, float]:
    """Launched rank 1 (node-b) recovered in place in its own process; the spare (launched rank 2,
    node-c) never trained in attempt 0 and trained rank 0 in attempt 1, its state sent by rank 1;
    attempt 1 carried on from the live state of the last completed step (none trained twice), trained
    the uninterrupted run's batches from there, and the final weights (written by rank 0: the spare)
    are the uninterrupted run's; the store host served to the end; every training rank's first step
    of attempt 1 came within 20 s of the fault (a sanity bound). Returns, per training rank, the
    seconds from the fault to that step."""
    assert run.fault_at is not None, run.describe()
    assert [run.host_of(r) for r in range(LAUNCHED)] == ["node-a", "node-b", "node-c"], run.describe()
    assert run.store_alive_at_end, f"the store host ended before the run did\n{run.describe()}"
    assert "serves the job's c10d store on 10.231.0.254:29400" in run.log("node-s"), run.log("node-s")
    keeper1 = run.event(1, "start")["pid"]
    calls1 = run.all(1, "attempt")
    assert [c["attempt"] for c in calls1] == [0, 1] and calls1[0]["pid"] == calls1[1]["pid"], \
        f"rank 1: {calls1}\n{run.describe()}"
    assert all(c["ppid"] == keeper1 for c in calls1), calls1
    assert [c["attempt"] for c in run.all(0, "attempt")] == [0], f"node-a's rank trained again\n{run.describe()}"
    spare_calls = run.all(2, "attempt")
    assert [c["attempt"] for c in spare_calls] == [1], f"the spare: {spare_calls}\n{run.describe()}"
    for rank in (1, 2):
        assert run.event(rank, "exit") is not None and run.event(rank, "exit")["how"] == "returned", run.describe()
    took: dict[int, float] = {}
    start = None
    for rank in range(TRAINING):
        seen = run.tries(rank)
        assert set(seen) == {0, 1} and seen[1]["done"] and not seen[0].get("done"), f"rank {rank}: {seen}"
        last = seen[1]
        if start is None:
            start = last["start_iteration"]
        assert last["start_iteration"] == start and last["first_step"] == start + 1, last
        assert Path(last["resumed_from"]).name == f"live-state-step={start}.pt", last
        assert last["in_memory"], last  # the spare's was sent to it
        assert (last["dist_rank"], last["dist_world"], last["spares_left"]) == (rank, TRAINING, 0), last
        got = run.trained(rank)
        want = [(e["step"], e["idx"]) for e in json_lines(ref / f"batches{rank}.jsonl")]
        before = [(e["step"], e["idx"]) for e in got if e["attempt"] == 0]
        after = [(e["step"], e["idx"]) for e in got if e["attempt"] == 1]
        assert before == want[:len(before)], f"rank {rank}: attempt 0's batches"
        # nothing trained twice: attempt 1 starts after the last step every rank completed (rank 1 may
        # have begun the next one, in which the failure reached it)
        assert before[-1][0] - start in (0, 1), (before[-1][0], start)
        assert after == want[start:], f"rank {rank}: attempt 1's batches"
        took[rank] = last["first_step_at"] - run.fault_at
    assert run.tries(0)[1]["pid"] == spare_calls[0]["pid"] != run.tries(0)[0]["pid"]
    final, expected = torch.load(run.out / "weights.pt"), torch.load(ref / "weights.pt")
    assert set(final) == set(expected)
    for key in expected:
        assert torch.equal(final[key], expected[key]), f"{key} differs from the uninterrupted 2-rank run's"
    b, c = run.log("node-b"), run.log("node-c")
    assert "[rank 1] rank 0 was lost with no keeper to replace it: spare launched rank 2 takes its place (0 spares " \
           "left after it)" in b, run.describe()
    line = next((line for line in c.splitlines() if "took the place of lost rank 0" in line), None)
    assert line is not None, run.describe()
    assert "spare launched rank 2 on host node-c took the place of lost rank 0 (launched rank 0 on host node-a)" in line
    reformed = float(line.split("): ")[-1].split(" s from the failure")[0])
    assert 0 < reformed < 20, line
    print(f"{line}\nfault at {run.fault_at:.2f}: first step of attempt 1 (iteration {start + 1}) "
          + ", ".join(f"rank {r} +{t:.2f} s" for r, t in took.items()) + f"; agents at the end: {run.agents_at_end}")
    assert all(0 < t < 20 for t in took.values()), took
    return took


def test_a_lost_host_of_rank_0_is_replaced_by_the_spare_when_the_store_has_a_host_of_its_own(tmp_path,
                                                                                             tmp_path_factory):
    ref = reference(tmp_path_factory)
    run = run_store_host(tmp_path, "kill_host")
    assert_spare_took_rank_0(run, ref)


@pytest.mark.long
def test_a_cut_link_of_rank_0_is_replaced_by_the_spare_and_the_cut_off_rank_never_trains_again(tmp_path,
                                                                                                tmp_path_factory):
    """node-a's link goes down: node-a's rank, alive and cut off from the store (on node-s) and from
    rank 1, trained nothing after the fault, raised ``PeerFailedError`` with the note and the log
    line saying why it was not recovered in place, and its process ended by itself, exiting 1."""
    ref = reference(tmp_path_factory)
    run = run_store_host(tmp_path, "cut_link")
    assert_spare_took_rank_0(run, ref)
    raised = run.event(0, "run_raised")
    assert raised is not None and raised["raised"] == "PeerFailedError", f"{raised}\n{run.describe()}"
    note = [n for n in raised["notes"] if n.startswith("fault-tolerant-handlers: not recovered in place: ")]
    logged = [m.group(2) for m in NOT_RECOVERED.finditer(run.log("node-a")) if int(m.group(1)) == 0]
    assert note and logged and note[0].endswith(logged[0]), f"logged {logged}, noted {note}\n{run.describe()}"
    assert [c["attempt"] for c in run.all(0, "attempt")] == [0], run.describe()
    assert 0 in run.ended_at and run.event(0, "exit")["how"] == "SystemExit: 1", run.describe()
    spare_first = run.tries(0)[1]["first_step_at"]
    old = [e for e in run.trained(0) if e["attempt"] == 0]
    assert old and all(e["t"] < run.fault_at < spare_first for e in old), "node-a's rank trained after the fault"
    print(f"node-a's rank: raised {raised['exc_type']} naming rank {raised['failed_rank']} "
          f"{raised['t'] - run.fault_at:.2f} s after the fault, its process ended "
          f"{run.ended_at[0] - run.fault_at:.2f} s after; not recovered in place: {logged[0]}")


@pytest.mark.long
def test_a_lost_store_host_ends_every_rank_at_once(tmp_path):
    """node-s dies whole: what the layout does not buy. Both training ranks and the spare lose the
    store every agreement lives in: no rank recovers in place or trains again, each training rank
    raises ``PeerFailedError`` with the note saying why, and every process ends within 20 s (not
    after the 60 s recovery join timeout)."""
    run = run_store_host(tmp_path, "kill_store_host", after_fault=40)
    assert run.fault_at is not None, run.describe()
    for rank in range(TRAINING):
        raised = run.event(rank, "run_raised")
        assert raised is not None and raised["raised"] == "PeerFailedError", f"rank {rank}: {raised}\n{run.describe()}"
        assert any(n.startswith("fault-tolerant-handlers: not recovered in place: ") for n in raised["notes"]), raised
        assert [c["attempt"] for c in run.all(rank, "attempt")] == [0], run.describe()
        print(f"rank {rank}: raised {raised['exc_type']} naming rank {raised['failed_rank']} "
              f"{raised['t'] - run.fault_at:.2f} s after the fault: {raised['message'][:200]}; notes {raised['notes']}")
    assert not run.all(2, "attempt"), f"the spare trained\n{run.describe()}"
    for rank in range(LAUNCHED):
        assert rank in run.ended_at and run.ended_at[rank] - run.fault_at < 20, run.describe()
        print(f"launched rank {rank}: ended {run.ended_at[rank] - run.fault_at:.2f} s after the fault: "
              f"{(run.event(rank, 'exit') or {}).get('how')}")
