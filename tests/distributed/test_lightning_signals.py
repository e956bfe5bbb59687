"""SIGTERM to the ranks of a real Lightning ``ddp`` training (2 gloo CPU ranks, Lightning's subprocess
launcher: rank 1 is rank 0's child), sent from outside by this test as a scheduler would.

Lightning puts its own SIGTERM handler in front of the library's (it broadcasts from rank 0 and
sets ``trainer.received_sigterm``; the loop then raises ``SIGTERMException`` at the next batch).
In every case Lightning's handler runs, the signalled rank's ``fit`` raises within
:data:`RAISE_BOUND` with its report, and its process ends within :data:`END_BOUND` (the interpreter's
own exit takes 1-3 s on the loaded 2-core machine); the process-group timeout is 60 s, so a rank
waiting on a collective or on the lost store cannot end within the bound by a timeout:

* rank 1 alone, both alive: rank 0 raises ``PeerFailedError: RankSignalled: rank 1 ... received
  SIGTERM``; rank 1's own ``fit`` raises the same (its broadcast to rank 0 broke because of its
  own signal, not because of rank 0);
* rank 0 SIGKILLed (the store's host), then rank 1 SIGTERMed at once: rank 1 raises ``PeerLost:
  rank 0 ... killed by SIGKILL`` and ends, never waiting on the lost store;
* rank 0 SIGTERMed (Lightning's launcher forwards it to rank 1: a preemption of the whole job):
  Lightning's own stop runs on both ranks, ``SIGTERMException`` at the next batch with
  ``OnExceptionCheckpoint`` writing its checkpoint, nothing released, also with steps longer than
  the watchdog's record grace.

Every process is killed by PID at the end (``run_ranks``; rank 1 is in rank 0's session). About
25 s each on the loaded machine: the default suite runs the first, ``make test-long`` every one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from pathlib import Path

import pytest

from launch import PROGRAMS, run_ranks

pytestmark = pytest.mark.timeout(150)

#: Seconds from the signal to the signalled rank's ``fit`` raising.
RAISE_BOUND = 3.0
#: Seconds from the signal to the signalled rank's process being gone.
END_BOUND = 15.0
#: Seconds from rank 1's SIGTERM to rank 0 raising ``PeerFailedError`` naming it.
PEER_BOUND = 1.5
PG_TIMEOUT = 60.0


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _signalled(tmp_path: Path, act, step_sleep: float = 0.2) -> dict:
    """Run the training; once both ranks are a few steps in, ``act(pids)`` sends the signals.
    Returns the signal's time, when each rank's process was gone, and every rank's events and output."""
    out = tmp_path / "lightning_main-1"
    env = dict(LAUNCH="ddp", FTH_TEST_TOP="1", FAULT="none", USE_FT="1", OEC="1", ITER_EVENTS="1",
               STEP_SLEEP=str(step_sleep), SIGTERM_EVENTS="1", OWN_OUTPUT="1", RERAISE="1", LINGER="0")
    done: dict = {}

    def run() -> None:
        try:
            done["results"] = run_ranks(1, "", tmp_path, script=PROGRAMS / "lightning_main.py", env=env,
                                        result_ranks=2, deadline=90, pg_timeout=PG_TIMEOUT, wait_sessions=True)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            done["error"] = err

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    pids: dict[int, int] = {}
    try:
        while runner.is_alive() and not pids:
            ev = {r: _events(out / f"rank{r}.jsonl") for r in (0, 1)}
            if all(sum(e["event"] == "iteration_completed" for e in ev[r]) >= 4 for r in (0, 1)):
                pids = {r: [e for e in ev[r] if e["event"] == "start"][-1]["pid"] for r in (0, 1)}
            time.sleep(0.05)
        assert pids, f"the training did not get going: {done}"
        fds = {r: os.pidfd_open(pid) for r, pid in pids.items()}
        t_signal = act(pids)
        ended = {}
        for r, fd in fds.items():
            select.select([fd], [], [], 60)
            ended[r] = time.time()
            os.close(fd)
    finally:
        runner.join(120)
    if "error" in done:
        raise done["error"]
    return dict(t=t_signal, ended=ended, pids=pids,
                events={r: _events(out / f"rank{r}.jsonl") for r in (0, 1)},
                output={r: (out / f"rank{r}.out").read_text(errors="replace") for r in (0, 1)},
                out=out)


def _one(events: list[dict], name: str) -> dict:
    found = [e for e in events if e["event"] == name]
    assert found, f"no {name!r} event in {[e['event'] for e in events if e['event'] != 'iteration_completed']}"
    return found[-1]


def _assert_lightning_handler_ran(events: list[dict], t: float) -> None:
    start = _one(events, "lightning_sigterm_start")
    assert start["t"] >= t - 0.01
    _one(events, "lightning_sigterm_end")


def test_sigterm_to_one_rank_while_both_run(tmp_path):
    def act(pids):
        t = time.time()
        os.kill(pids[1], signal.SIGTERM)
        return t

    run = _signalled(tmp_path, act)
    t, pid1 = run["t"], run["pids"][1]
    mine = _one(run["events"][1], "run_raised")
    _assert_lightning_handler_ran(run["events"][1], t)
    assert (mine["raised"], mine["exc_type"], mine["failed_rank"]) == ("PeerFailedError", "RankSignalled", 1), mine
    assert mine["t"] - t < RAISE_BOUND, mine["t"] - t
    assert f"rank 1 (pid {pid1} on " in run["output"][1] and "received SIGTERM" in run["output"][1]
    assert run["ended"][1] - t < END_BOUND, run["ended"][1] - t
    peer = _one(run["events"][0], "run_raised")
    assert (peer["raised"], peer["exc_type"], peer["failed_rank"]) == ("PeerFailedError", "RankSignalled", 1), peer
    assert f"rank 1 (pid {pid1} on " in peer["message"] and "received SIGTERM" in peer["message"]
    assert peer["t"] - t < PEER_BOUND, peer["t"] - t


@pytest.mark.long  # make test-long
def test_sigterm_after_the_store_host_was_killed(tmp_path):
    def act(pids):
        os.kill(pids[0], signal.SIGKILL)
        t = time.time()
        os.kill(pids[1], signal.SIGTERM)
        return t

    run = _signalled(tmp_path, act)
    t, pid0 = run["t"], run["pids"][0]
    _assert_lightning_handler_ran(run["events"][1], t)
    mine = _one(run["events"][1], "run_raised")
    assert (mine["raised"], mine["exc_type"], mine["failed_rank"]) == ("PeerFailedError", "PeerLost", 0), mine
    assert f"rank 0 (pid {pid0} on " in mine["message"] and "killed by SIGKILL" in mine["message"]
    assert mine["t"] - t < RAISE_BOUND, mine["t"] - t
    assert f"rank 0 (pid {pid0} on " in run["output"][1] and "lost: killed by SIGKILL" in run["output"][1]
    assert run["ended"][1] - t < END_BOUND, run["ended"][1] - t
    assert not any(e["event"] == "run_raised" for e in run["events"][0])  # rank 0 was killed mid-training


@pytest.mark.long  # make test-long
@pytest.mark.parametrize("step_sleep", [0.2, 1.5])
def test_sigterm_to_the_whole_job_runs_lightnings_stop(tmp_path, step_sleep):
    """SIGTERM to rank 0, which Lightning's handler forwards to rank 1: a preemption of the job. With
    1.5 s steps, the peers' records are read (0.3 s grace) and an agreement (every 4 steps) starts a
    new incident long before the next batch, where Lightning stops: neither makes it a failure."""
    def act(pids):
        t = time.time()
        os.kill(pids[0], signal.SIGTERM)
        return t

    run = _signalled(tmp_path, act, step_sleep)
    t = run["t"]
    for r in (0, 1):
        events = run["events"][r]
        _assert_lightning_handler_ran(events, t)
        taken = _one(events, "on_exception")
        assert taken["exc_type"] == "SIGTERMException", taken
        raised = _one(events, "run_raised")
        assert raised["raised"] == "SIGTERMException", raised
        assert raised["t"] - t < RAISE_BOUND + step_sleep, raised["t"] - t  # at the next batch
        assert run["ended"][r] - t < END_BOUND + step_sleep, run["ended"][r] - t
        assert f"rank {r} (pid {run['pids'][r]} on " in run["output"][r] and "received SIGTERM" in run["output"][r]
    # OnExceptionCheckpoint wrote the trained state (its barrier ran on unreleased collectives)
    import torch

    saved = torch.load(run["out"] / "ckpts" / "on_exception.ckpt", weights_only=False, map_location="cpu")
    assert saved["global_step"] >= 4, saved["global_step"]
