"""Create, stop and create again: a session with its watchdog (threads, the liveness helper process,
store connections), 20 times in one process, on 2 real gloo ranks. Whatever the first round
installed once per process (the SIGTERM/SIGINT handlers, the exit hooks) stays the same; the
threads, fds and child processes held after each round stay flat; no key of a closed run remains in
the store."""

from __future__ import annotations

import pytest

from launch import HERE, run_ranks

LIFECYCLE = HERE / "programs" / "lifecycle_main.py"
ROUNDS = 20

pytestmark = pytest.mark.timeout(150)


def test_twenty_sessions_in_one_process_leave_nothing_behind(tmp_path):
    results = run_ranks(2, "", tmp_path, script=LIFECYCLE, deadline=120, env={"ROUNDS": str(ROUNDS)})
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.has("done")
        rounds = [e for e in r.events if e["event"] == "round"]
        assert len(rounds) == ROUNDS
        print(f"rank {r.rank}: round  threads fds children atexit store_keys helper")
        for e in rounds:
            print(f"rank {r.rank}: {e['round']:5d}  {len(e['threads']):7d} {e['fds']:3d} {e['children']:8d} "
                  f"{e['atexit']:6d} {e['store_keys']:10d} {e['helper']}")
        first = rounds[0]
        for e in rounds:
            assert e["helper"] is not None  # every round really had its liveness helper
            assert len(e["heartbeats"]) == 2  # ... which beat, as its peer's did
            assert e["run_keys_left"] == [], e  # the closed run's keys are gone
            assert e["children"] == 0  # the helper was reaped
            for what in ("threads", "fds", "atexit", "handlers", "wakeup_fd"):
                assert e[what] == first[what], (what, e["round"], e[what], first[what])
        assert len({e["helper"] for e in rounds}) == ROUNDS  # a new helper each round
        # torch's own keys of each new side group (c10d's new_group) stay in the default store: at
        # most a few per round, never the session's (above)
        growth = rounds[-1]["store_keys"] - rounds[0]["store_keys"]
        assert growth <= 3 * (ROUNDS - 1), growth
