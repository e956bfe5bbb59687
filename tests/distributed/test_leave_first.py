"""A rank that finishes first is not a lost rank.

Rank 1 ends its loop and its script normally (exit code 0) while rank 0, its watchdog still on,
works on alone for 6 s (``tests/programs/leave_first_main.py``: an evaluation or an export of its
own, as rank-0-only work after training is). Under torchrun the agent reaps a worker at once, so
rank 0 sees only that rank 1's process is gone, with no exit status, and a second later that its
heartbeat stopped. Before the left mark (``left/<rank>``, written when a watchdog stops cleanly,
at the interpreter's exit too) rank 0 declared rank 1 lost ("process is gone (exit status not
visible from this process)") and its work was ended by a false alarm.

On one host (the pid probe and the same-host heartbeat) and across two simulated hosts (``long``:
the heartbeat alone, nothing else can see the other host's process).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import hosts
from launch import read_events, run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "programs" / "leave_first_main.py"
STAY = 6.0  # three times the heartbeat limit (2 s)


def _assert_rank_0_stayed(events: dict[int, list[dict]], output: str) -> None:
    names = {r: [e["event"] for e in ev] for r, ev in events.items()}
    assert "leaving" in names.get(1, []), (names, output[-3000:])
    assert "raised" not in names.get(0, []), ([e for e in events[0] if e["event"] == "raised"], output[-3000:])
    assert "stayed" in names.get(0, []), (names, output[-3000:])
    left_at = next(e["t"] for e in events[1] if e["event"] == "leaving")
    stayed_at = next(e["t"] for e in events[0] if e["event"] == "stayed")
    assert stayed_at - left_at >= STAY - 1.0, (left_at, stayed_at)  # rank 0 really worked on alone
    assert " lost: " not in output and "declared" not in output.lower(), output[-3000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_finished_first_under_torchrun_are_not_declared_lost(world, tmp_path):
    """At 4 ranks, ranks 1-3 leave together: rank 0 watches rank 1's heartbeat and every pid."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "--max-restarts",
                "0", "--monitor-interval", "0.1"]
    results = run_ranks(1, "", tmp_path, script=SCRIPT, launcher=launcher, result_ranks=world, deadline=120,
                        env={"STAY": str(STAY)})
    output = results[0].stderr
    assert results[0].returncode == 0, output[-4000:]
    events = {r.rank: r.events for r in results}
    _assert_rank_0_stayed(events, output)
    assert all("leaving" in [e["event"] for e in events[r]] for r in range(1, world)), events


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(hosts.unavailable() is not None, reason=str(hosts.unavailable()))
def test_a_rank_on_another_host_that_finished_first_is_not_declared_silent(tmp_path):
    outdir = tmp_path / "leave-2x1"
    outdir.mkdir()
    with hosts.Rig(2, outdir) as rig:
        rig.start([str(SCRIPT), str(outdir)], env={"STAY": str(STAY)})
        end = time.monotonic() + 120
        while time.monotonic() < end and any(h.proc.poll() is None for h in rig.hosts):
            time.sleep(0.1)
        codes = [h.proc.poll() for h in rig.hosts]
        output = "\n".join(h.log.read_text(errors="replace") for h in rig.hosts)
    events = {r: read_events(outdir, r) for r in range(2)}
    assert codes == [0, 0], (codes, output[-4000:])
    _assert_rank_0_stayed(events, output)
