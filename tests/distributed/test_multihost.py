"""Across hosts: what every rank sees when a rank, a host or a link fails (2 hosts x 1 rank unless
said, Ignite unless said, the library's default settings).

Each test runs a real multi-host job on the rig of ``tests/hosts.py`` (network namespaces joined by
a veth pair or a bridge, each with its own hostname and pid namespace, one ``torchrun`` agent per
host with c10d rendezvous), injects one fault, and asserts what every rank recorded. The tests
marked ``long`` run with ``make test-multihost`` and ``make test-long``, not ``make test``.
"""

from __future__ import annotations

import os
import re

import pytest

import hosts
from hosts import MultiHostResult, RankOutcome, run_hosts
from launch import cpu_hogs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(hosts.unavailable() is not None, reason=str(hosts.unavailable())),
    pytest.mark.timeout(240),
]
_EXIT_REPORT = re.compile(r"ending this process with exit code \d+: .*?\brank (\d+)\b")


def reported_peer(r: RankOutcome) -> tuple[int, float, str] | None:
    """(the rank it names as failed or lost, when, the text) from what rank ``r`` reported: its
    run raised ``PeerFailedError``, or (its main thread stuck) the watchdog ended the process with
    the same report."""
    raised = r.raised
    if raised is not None and raised["raised"] == "PeerFailedError":
        return raised["failed_rank"], raised["t"], raised["message"]
    ended = r.event("watchdog_exit")
    if ended is not None:
        m = _EXIT_REPORT.search(ended["message"])
        if m:
            return int(m.group(1)), ended["t"], ended["message"]
    return None


def assert_no_own_failure(res: MultiHostResult, rank: int) -> None:
    """Rank ``rank`` never recorded (nor published) a failure of its own."""
    raised = res.ranks[rank].raised
    assert raised is None or raised["raised"] == "PeerFailedError", (
        f"rank {rank} raised its own error for a peer's loss: {raised}\n{res.describe()}")
    log = res.log(res.host_of(rank).index)
    assert not re.search(rf"\[rank {rank}( step \d+)?\] failed: ", log), (
        f"rank {rank} recorded its own failure:\n{res.describe()}")


#: What a rank its launcher SIGTERMs prints when that signal is the consequence of a peer's failure
#: (``signals.py``): torchrun's agent on a store host's death, sometimes before the rank's main thread
#: has raised. The process then ends by the signal (its ``ended_at`` bounds when it printed).
_SIGTERM_REPORT = re.compile(r"\[rank (\d+)\] fault-tolerant-handlers: SIGTERM while the job fails:\n(\w+: rank (\d+) .*)")


def assert_names(res: MultiHostResult, rank: int, lost: int, within: float, host: str | None = None,
                 since: float | None = None) -> None:
    """Rank ``rank`` named rank ``lost`` (on ``host``) within ``within`` s of ``since`` (the fault)."""
    since = res.fault_at if since is None else since
    got = reported_peer(res.ranks[rank])
    if got is None:
        printed = [m for m in _SIGTERM_REPORT.finditer(res.log(res.host_of(rank).index)) if int(m.group(1)) == rank]
        if printed and res.ranks[rank].ended_at is not None:
            got = int(printed[0].group(3)), res.ranks[rank].ended_at, printed[0].group(2)
    assert got is not None, f"rank {rank} named no failed peer:\n{res.describe()}"
    named, t, text = got
    assert named == lost, f"rank {rank} named rank {named}, not {lost}: {text}\n{res.describe()}"
    if host is not None:
        assert host in text, f"rank {rank}'s report does not name host {host}: {text}"
    assert t - since <= within, (
        f"rank {rank} named rank {lost} {t - since:.2f} s after the fault (bound {within} s; the fault at "
        f"{res.fault_at}, counted from {since})\n{res.describe()}")


@pytest.mark.long
def test_rank_on_other_host_raises(tmp_path):
    """Rank 1 (host node-b) raises: every rank raises with the cause within 1 s, and every rank and
    agent ends by itself."""
    res = run_hosts(tmp_path, "raise", fault_host=1, after_fault=25, env={"LINGER": "3"})
    assert res.fault_at is not None, res.describe()
    r0, r1 = res.ranks
    assert r0.host == "node-a" and r1.host == "node-b", res.describe()
    assert r1.raised is not None and r1.raised["raised"] == "InjectedFault", res.describe()
    assert r1.raised["t"] - res.fault_at <= 1.0, res.describe()
    assert r0.raised is not None and r0.raised["raised"] == "PeerFailedError", res.describe()
    assert r0.raised["failed_rank"] == 1 and r0.raised["host"] == "node-b", res.describe()
    assert "InjectedFault" in r0.raised["exc_type"] and "raise@rank=1" in r0.raised["exc_message"], res.describe()
    assert r0.raised["t"] - res.fault_at <= 1.0, res.describe()
    assert all(r.ended_by_itself for r in res.ranks), res.describe()
    assert all(h.ended_at is not None and not h.killed for h in res.hosts), res.describe()
    left = [ns for ns in hosts._namespaces() if ns.startswith(f"{hosts.PREFIX}{os.getpid()}x")]
    assert not left, f"namespaces left behind: {left}"
    assert not any(hosts._alive(h.init_pid) for h in res.hosts), res.describe()


def test_host_dies(tmp_path):
    """Everything on node-b is SIGKILLed: rank 0 raises PeerFailedError naming rank 1 and node-b
    within 2 s of node-b's death (its rank's process gone: under load the kernel has taken 2 s to end
    the pid namespace), and never records a failure of its own."""
    res = run_hosts(tmp_path, "kill_host", fault_host=1, after_fault=20)
    assert res.fault_at is not None and res.host_dead_at(1) is not None, res.describe()
    assert_names(res, 0, lost=1, within=2.0, host="node-b", since=res.host_dead_at(1))
    assert_no_own_failure(res, 0)
    assert res.ranks[0].ended_by_itself, res.describe()


def test_rank_killed_on_other_host_is_named_with_its_signal(tmp_path):
    """Rank 1, alone on node-b, is SIGKILLed (the OOM killer): rank 0, on another host and pid
    namespace, cannot see how it ended, and its collective only breaks; rank 1's liveness helper
    tells it. Rank 0 raises ``PeerFailedError`` naming rank 1 on node-b, killed by SIGKILL, within
    2 s, records no failure of its own, and ends by itself."""
    res = run_hosts(tmp_path, "kill", fault_host=1, after_fault=20)
    assert res.fault_at is not None, res.describe()
    assert_names(res, 0, lost=1, within=2.0, host="node-b")
    named, _, text = reported_peer(res.ranks[0])
    assert "PeerLost" in text and "killed by SIGKILL" in text, f"{text}\n{res.describe()}"
    assert_no_own_failure(res, 0)
    assert res.ranks[0].ended_by_itself, res.describe()


@pytest.mark.long
def test_store_host_dies(tmp_path):
    """Everything on node-a (rank 0, the c10d store, the rendezvous) is SIGKILLed: rank 1 names
    rank 0 within 5 s, never records a failure of its own, and ends by itself."""
    res = run_hosts(tmp_path, "kill_host", fault_host=0, after_fault=20)
    assert res.fault_at is not None and res.host_dead_at(0) is not None, res.describe()
    assert_names(res, 1, lost=0, within=5.0, host="node-a", since=res.host_dead_at(0))
    assert_no_own_failure(res, 1)
    assert res.ranks[1].ended_by_itself, res.describe()


def test_link_cut(tmp_path):
    """node-b's link goes down: rank 0 names rank 1 within 5 s; rank 1, cut off from rank 0 and the
    store, names rank 0 within 10 s; both rank processes end by themselves within 10 s, and
    node-a's agent (its rank failed) by itself after them. (node-b's agent is left blocked in its
    own rendezvous read of the unreachable store, which no process of the library can reach:
    docs/multiple-hosts.md, docs/limits.md.)"""
    res = run_hosts(tmp_path, "cut_link", fault_host=1, after_fault=20)
    assert res.fault_at is not None, res.describe()
    assert_names(res, 0, lost=1, within=5.0)
    assert_names(res, 1, lost=0, within=10.0)
    assert_no_own_failure(res, 0)
    assert_no_own_failure(res, 1)
    for r in res.ranks:
        assert r.ended_by_itself and r.ended_at - res.fault_at <= 10.0, res.describe()
    a = res.hosts[0]
    assert a.ended_at is not None and not a.killed, res.describe()


@pytest.mark.long
def test_hung_rank_on_other_host_sends_its_stack_to_every_host(tmp_path):
    """Rank 1 (node-b) hangs in a step with ``hang_timeout`` 5 s: rank 0 raises ``RankHung`` for
    rank 1 with the hung rank's own stack (the injected sleep) within 5 s + 3 s."""
    res = run_hosts(tmp_path, "hang", fault_host=1, after_fault=25, env={"FTH_HANG_TIMEOUT_SEC": "5"})
    assert res.fault_at is not None, res.describe()
    raised = res.ranks[0].raised
    assert raised is not None and raised["raised"] == "PeerFailedError", res.describe()
    assert raised["failed_rank"] == 1 and raised["exc_type"] == "RankHung" and raised["host"] == "node-b", raised
    assert "time.sleep(3600)" in raised["message"], raised["message"]  # the line rank 1 hangs on, from node-b
    assert raised["t"] - res.fault_at <= 5.0 + 3.0, res.describe()
    assert_no_own_failure(res, 0)


@pytest.mark.long
def test_four_hosts_a_rank_raises(tmp_path):
    """4 hosts x 2 ranks, rank 2 (node-b) raises: every other rank, on every host, raises
    ``PeerFailedError`` naming rank 2 and its error within 1 s."""
    res = run_hosts(tmp_path, "raise", hosts=4, nproc_per_node=2, fault_host=1, after_fault=25, env={"LINGER": "3"})
    assert res.fault_at is not None, res.describe()
    assert res.ranks[2].raised is not None and res.ranks[2].raised["raised"] == "InjectedFault", res.describe()
    for r in res.ranks:
        if r.rank != 2:
            assert_names(res, r.rank, lost=2, within=1.0, host="node-b")
            assert "raise@rank=2" in r.raised["exc_message"], r.raised


@pytest.mark.long
def test_four_hosts_a_host_dies(tmp_path):
    """4 hosts x 2 ranks, node-b (ranks 2 and 3) is SIGKILLed: each of the six survivors raises
    ``PeerFailedError`` naming rank 2 or 3 on node-b within 2 s, and none records a failure of its
    own."""
    res = run_hosts(tmp_path, "kill_host", hosts=4, nproc_per_node=2, fault_host=1, after_fault=20)
    assert res.fault_at is not None and res.host_dead_at(1) is not None, res.describe()
    for r in res.ranks:
        if r.rank in (2, 3):
            continue
        got = reported_peer(r)
        assert got is not None and got[0] in (2, 3), f"rank {r.rank}: {got}\n{res.describe()}"
        assert "node-b" in got[2] and got[1] - res.host_dead_at(1) <= 2.0, f"rank {r.rank}: {got}\n{res.describe()}"
        assert_no_own_failure(res, r.rank)


@pytest.mark.long
def test_lightning_rank_on_other_host_raises(tmp_path):
    """Lightning ``Trainer.fit`` with the callback, rank 1 (node-b) raises: rank 0 names it and its
    error within 1 s."""
    res = run_hosts(tmp_path, "raise", framework="lightning", fault_host=1, after_fault=25, env={"LINGER": "3"})
    assert res.fault_at is not None, res.describe()
    assert_names(res, 0, lost=1, within=1.0, host="node-b")
    assert "raise@rank=1" in res.ranks[0].raised["exc_message"], res.ranks[0].raised


def assert_nobody_declared(res: MultiHostResult, iterations: int, extra: tuple[str, ...] = ()) -> None:
    """A healthy run: nobody raised, every rank finished its ``iterations``, and no host's log
    declares a rank lost, silent or hung (nor has any of ``extra``)."""
    for r in res.ranks:
        assert r.raised is None, f"rank {r.rank} raised: {r.raised}\n{res.describe()}"
        assert r.event("run_returned") is not None and r.event("run_returned")["iteration"] == iterations, res.describe()
    for h in res.hosts:
        log = res.log(h.index)
        for word in ("PeerSilent", "PeerLost", "RankHung", "PeerFailedError", *extra):
            assert word not in log, f"{h.name}: {word!r} in its log\n{res.describe()}"


@pytest.mark.long
@pytest.mark.timeout(600)
def test_no_false_alarm_with_every_core_saturated_and_a_20_s_gil_hold(tmp_path):
    """A healthy 2-host run of over two minutes (2000 iterations) while every core is busy with
    other processes, and rank 1's main thread holds the GIL for 20 s in one C call at iteration
    300 (hang detection off, the default): nobody is declared lost, silent or hung, and both ranks
    finish the run."""
    with cpu_hogs(2 * (os.cpu_count() or 2)):
        res = run_hosts(tmp_path, "none", fault_host=1, after_fault=420, start_timeout=120,
                        env={"MAX_ITERS": "2000", "STEP_SEC": "0.05", "GIL_HOLD": "1,300,20"})
    assert_nobody_declared(res, 2000, extra=("did not answer",))
    r1 = res.ranks[1]
    assert r1.event("gil_end")["t"] - r1.event("gil_start")["t"] >= 19.5, res.describe()
    took = res.ranks[0].event("run_returned")["t"] - res.ranks[0].event("start")["t"]
    assert took >= 120, f"the run took {took:.0f} s"


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("hosts_n,per_host", [(4, 2), (4, 4)], ids=["8-ranks", "16-ranks"])
def test_no_heartbeat_is_declared_silent_across_hosts_at_8_and_16_ranks_with_every_core_saturated(
        hosts_n, per_host, tmp_path):
    """A healthy run on 4 simulated hosts of 2 or 4 ranks (8 and 16 ranks on this 2-core machine)
    beside 4 CPU hogs, 600 iterations: the last rank of each host watches every rank of the next
    host by its heartbeat alone (no pid to look at across hosts), read every SILENCE_POLL while a
    counter stands still. Nobody is declared silent, lost or hung, and every rank finishes; the near
    misses (a heartbeat still for half the limit) are printed, the margin left."""
    with cpu_hogs(2 * (os.cpu_count() or 2)):
        res = run_hosts(tmp_path, "none", hosts=hosts_n, nproc_per_node=per_host, after_fault=540,
                        start_timeout=300, env={"MAX_ITERS": "600", "STEP_SEC": "0.05"})
    assert_nobody_declared(res, 600)
    near = [line for h in res.hosts for line in res.log(h.index).splitlines() if "has stood still for" in line]
    print(f"{hosts_n} hosts x {per_host} ranks: {len(near)} near misses" + "".join(f"\n  {line}" for line in near))
