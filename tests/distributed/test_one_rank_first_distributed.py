"""``one_rank_first`` on real ranks: the waiting ranks never run the body after the first rank
failed, a later failure fails everyone, and stock Ignite's version is shown to wait to its timeout
in the same scenario while ours ends in seconds."""

from __future__ import annotations

import pytest

from launch import run_ranks

MAX_LATENCY_SEC = 5.0

pytestmark = pytest.mark.timeout(120)


def _assert_done(results):
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited {r.returncode}:\n{r.stderr[-3000:]}"
        assert r.has("done"), r.events


def _body_ran(result, event):
    return result.has(f"{event}:body_start")


@pytest.mark.parametrize("world_size", [2, 4])
def test_first_rank_failing_releases_waiters_without_running_the_body(world_size, tmp_path):
    results = run_ranks(world_size, "rank_first_each", tmp_path)
    _assert_done(results)
    for first in range(world_size):
        event = f"first{first}"
        fault = [e for e in results[first].events if e["event"] == "fault" and e["message"] == f"download failed on rank {first}"]
        assert len(fault) == 1
        for r in results:
            seen = r.event(event)
            assert seen["t"] - fault[0]["t"] < MAX_LATENCY_SEC
            if r.rank == first:
                assert _body_ran(r, event)
                assert seen["raised"] == "OSError"
            else:
                assert not _body_ran(r, event), f"rank {r.rank} ran the body after rank {first} failed"
                assert seen["raised"] == "PeerFailedError"
                assert seen["failed_rank"] == first
                assert seen["exc_type"] == "OSError"
                assert seen["exc_message"] == f"download failed on rank {first}"
                assert seen["where"] == "'download'"
    # with no fault, the first rank finished the body before any other rank started it
    end_first = results[0].event("clean:body_end")["t"]
    for r in results:
        assert r.event("clean")["raised"] is None
        if r.rank:
            assert r.event("clean:body_start")["t"] >= end_first


def test_later_rank_failing_in_the_body_fails_every_rank(tmp_path):
    results = run_ranks(2, "rank_first_late", tmp_path)
    _assert_done(results)
    fault = results[1].event("fault")
    assert results[0].event("late:body_end")  # the first rank completed the body...
    first = results[0].event("late")
    assert first["raised"] == "PeerFailedError" and first["failed_rank"] == 1 and first["exc_type"] == "OSError"
    assert first["t"] - fault["t"] < MAX_LATENCY_SEC  # ...and did not wait past the failure
    assert results[1].event("late")["raised"] == "OSError"


def test_local_rank_first_on_two_simulated_nodes(tmp_path):
    # torchrun --nnodes=2 --nproc-per-node=2 would give these LOCAL_RANK / LOCAL_WORLD_SIZE values
    per_rank = {r: {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2"} for r in range(4)}
    results = run_ranks(4, "rank_first_local", tmp_path, per_rank_env=per_rank)
    _assert_done(results)
    # local rank 0 of both nodes (global 0 and 2) ran first; global 2 failed
    assert _body_ran(results[0], "local") and _body_ran(results[2], "local")
    assert not _body_ran(results[1], "local") and not _body_ran(results[3], "local")
    assert results[2].event("local")["raised"] == "OSError"
    for r in (0, 1, 3):
        seen = results[r].event("local")
        assert seen["raised"] == "PeerFailedError" and seen["failed_rank"] == 2
    # clean run: each node's waiter started after its node's first rank finished
    for first, waiter in ((0, 1), (2, 3)):
        assert results[waiter].event("local_clean:body_start")["t"] >= results[first].event("local_clean:body_end")["t"]
        assert results[waiter].event("local_clean")["raised"] is None


def test_bad_input_names_the_argument_and_valid_values(tmp_path):
    results = run_ranks(2, "bad_input", tmp_path)
    _assert_done(results)
    for r in results:
        assert r.event("rank=2")["raised"] == "ValueError"
        assert "rank must be in [0, 1]" in r.event("rank=2")["message"]
        assert r.event("rank=-1")["raised"] == "ValueError"
        assert r.event("rank=1.5")["raised"] == "TypeError"
        assert "one_rank_first(rank=...)" in r.event("rank=1.5")["message"]
        assert r.event("rank=True")["raised"] == "TypeError"
        assert r.event("name")["raised"] == "TypeError"
    # rank 0 is in the one-rank group (nothing to coordinate); rank 1 is not a member
    assert results[0].event("group")["raised"] is None
    group_err = results[1].event("group")
    assert group_err["raised"] == "ValueError"
    assert "not a member" in group_err["message"] and "group=None" in group_err["message"]


@pytest.mark.long  # stock Ignite's behaviour, not the library's: make test-long
def test_stock_ignite_one_rank_first_waits_to_its_timeout(tmp_path):
    # Rank 0's download always fails; rank 0 catches it and retries after a backoff, so its process
    # stays alive. The process-group timeout is 3 s (gloo's default is 30 minutes).
    stock = run_ranks(2, "retry_stock", tmp_path, pg_timeout=3.0, deadline=40)
    fault0 = stock[0].event("fault0")
    waiter = stock[1].event("attempt0")
    # stock: the waiting rank sat in the barrier until the process-group timeout, and never heard why
    assert waiter["t"] - fault0["t"] >= 2.5
    assert waiter["raised"] != "PeerFailedError"
    assert "mirror unreachable" not in waiter["message"]
    assert "Timed out" in waiter["message"]


def test_our_one_rank_first_ends_a_failing_download_in_seconds_on_every_attempt(tmp_path):
    # The same retrying download as above, with the library's one_rank_first.
    ours = run_ranks(2, "retry_ours", tmp_path, pg_timeout=3.0, deadline=40)
    for r in ours:
        assert r.returncode == 0, r.stderr[-3000:]
    assert not ours[1].has("body_ran")  # the waiter never ran the body its first rank failed in
    for attempt in (0, 1):
        fault = ours[0].event(f"fault{attempt}")
        seen = ours[1].event(f"attempt{attempt}")
        assert seen["raised"] == "PeerFailedError"
        assert seen["exc_type"] == "ConnectionError" and "mirror unreachable" in seen["exc_message"]
        assert seen["t"] - fault["t"] < MAX_LATENCY_SEC
    assert ours[0].has("gave_up") and ours[1].has("gave_up")
