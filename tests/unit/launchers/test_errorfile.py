"""torchrun's error files as this library writes them, read back by torch's own ``ProcessFailure``
(the class the agent uses to pick the Root Cause)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from fault_tolerant_handlers.launchers import reports
from fault_tolerant_handlers.core.failure import Ended, FailureRecord, PeerFailedError, decode
from fault_tolerant_handlers.core.procfs import RankTable


def _read_timestamp(path: str) -> int | None:
    """The timestamp torchrun's Root Cause compares, from an error file."""
    try:
        with open(path) as f:
            data = json.load(f)
        message = data["message"]
        return int(message["extraInfo"]["timestamp"]) if isinstance(message, dict) else int(data.get("timestamp", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _layout(tmp_path, n=2):
    """torchrun's ``attempt_0/<local rank>/`` directories."""
    paths = []
    for local in range(n):
        (tmp_path / "attempt_0" / str(local)).mkdir(parents=True)
        paths.append(str(tmp_path / "attempt_0" / str(local) / "error.json"))
    return paths


def _record(rank=1, time_ms=1_700_000_000_900):
    try:
        raise ValueError("bad sample 17")
    except ValueError as exc:
        rec = FailureRecord.from_exception(exc, rank=rank, section="train", step=3)
    return FailureRecord(**{**rec.__dict__, "time_ms": time_ms})


def FakeSession(rank, local_rank=None, pids=(100, 101)):  # noqa: N802 - the table a session would hold
    """Ranks 0 and 1 on node-a."""
    return RankTable(rank, (0, 1), tuple(pids), ("node-a", "node-a"),
                     local_rank=rank if local_rank is None else local_rank, local_world_size=2)


def test_failed_rank_file_is_read_by_torch_with_its_failure_second(tmp_path, monkeypatch):
    own = _layout(tmp_path)[1]
    monkeypatch.setenv(reports.ERROR_FILE_ENV, own)
    assert reports.write_failed(_record())
    failure = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=own)
    assert failure.timestamp == 1_700_000_000
    assert failure.message["message"] == "ValueError: bad sample 17"
    assert "bad sample 17" in failure.message["extraInfo"]["py_callstack"]


def test_a_file_is_never_overwritten(tmp_path, monkeypatch):
    own = _layout(tmp_path)[1]
    monkeypatch.setenv(reports.ERROR_FILE_ENV, own)
    assert reports.write_failed(_record(time_ms=1_700_000_000_000))
    assert not reports.write_failed(_record(time_ms=1_700_000_500_000))
    assert not reports.write_survivor(FakeSession(1), None)
    assert _read_timestamp(own) == 1_700_000_000
    assert [p for p in os.listdir(os.path.dirname(own)) if p != "error.json"] == []  # no temp file left


def test_nothing_is_written_outside_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv(reports.ERROR_FILE_ENV, os.devnull)
    assert not reports.write_failed(_record())
    monkeypatch.delenv(reports.ERROR_FILE_ENV)
    assert not reports.write_failed(_record())


def test_survivor_loses_to_the_failing_rank_in_torchs_root_cause(tmp_path, monkeypatch):
    paths = _layout(tmp_path)
    monkeypatch.setenv(reports.ERROR_FILE_ENV, paths[1])
    reports.write_failed(_record(rank=1, time_ms=int(1_700_000_000.95 * 1000)))
    peer = PeerFailedError.from_records([_record(rank=1, time_ms=int(1_700_000_000.95 * 1000))])
    monkeypatch.setenv(reports.ERROR_FILE_ENV, paths[0])
    assert reports.write_survivor(FakeSession(0), peer)
    assert _read_timestamp(paths[0]) >= 1_700_000_001
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file=paths[r]) for r in (0, 1)}
    rank, _ = ChildFailedError("train.py", failures).get_first_failure()
    assert rank == 1  # without the survivor's later second, the tie would go to rank 0


def test_survivor_timestamp_is_after_the_failure_and_after_now():
    assert reports.survivor_timestamp(100.9, now=100.95) == 101
    assert reports.survivor_timestamp(100.9, now=105.2) == 106
    assert reports.survivor_timestamp(None, now=7.5) == 8


def test_survivor_writes_a_killed_same_host_peers_file_first(tmp_path, monkeypatch):
    paths = _layout(tmp_path)
    monkeypatch.setenv(reports.ERROR_FILE_ENV, paths[0])
    lost = FailureRecord.declared(rank=1, kind="PeerLost", message="rank 1 (pid 101 on node-a) lost: killed by SIGKILL",
                                  by=0, pid=101, host="node-a", time_ms=1_700_000_000_300)
    err = PeerFailedError.from_records([lost])
    assert reports.write_survivor(FakeSession(0), err)
    dead = ProcessFailure(local_rank=1, pid=101, exitcode=-9, error_file=paths[1])
    assert dead.timestamp == 1_700_000_000 and "SIGKILL" in dead.message["message"]
    mine = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file=paths[0])
    assert mine.timestamp > dead.timestamp
    rank, _ = ChildFailedError("train.py", {0: mine, 1: dead}).get_first_failure()
    assert rank == 1


@pytest.mark.parametrize("what", ["other host", "other pid", "silent"])
def test_no_file_for_a_peer_this_host_cannot_vouch_for(tmp_path, monkeypatch, what):
    paths = _layout(tmp_path)
    monkeypatch.setenv(reports.ERROR_FILE_ENV, paths[0])
    lost = FailureRecord.declared(rank=1, kind="PeerSilent" if what == "silent" else "PeerLost", message="rank 1 lost",
                                  by=0, pid=999 if what == "other pid" else 101,
                                  host="node-b" if what == "other host" else "node-a")
    reports.write_survivor(FakeSession(0), PeerFailedError.from_records([lost]))
    assert not os.path.exists(paths[1])


def test_peer_path_follows_torchruns_layout_only(tmp_path):
    own = _layout(tmp_path)[0]
    assert reports.peer_path(own, 0, 1) == str(tmp_path / "attempt_0" / "1" / "error.json")
    assert reports.peer_path(own, 3, 1) is None          # own path does not end in <local rank>/error.json
    assert reports.peer_path(own, 0, 5) is None          # no such directory
    assert reports.peer_path(str(tmp_path / "x.json"), 0, 1) is None




_RANK = """
import os, signal, sys, threading, time, types
from fault_tolerant_handlers.core.procfs import RankTable
from fault_tolerant_handlers.detect import liveness
rank_pid = os.getpid()
r, w = os.pipe()
helper = os.fork()
if helper == 0:  # the liveness helper's watcher of its rank's end
    os.close(w)
    told = lambda record: open(sys.argv[1], "w").write(record.exc_message)  # the PeerLost record it publishes
    liveness._on_rank_end(RankTable(1, (0, 1), (0, rank_pid), ("node-a", "node-a")), rank_pid, r, threading.Event(), told)
worker = os.fork()
if worker == 0:  # a DataLoader worker forked after the helper: it holds the pipe's write end too
    time.sleep(60)
    os._exit(0)
print(helper, worker, flush=True)
os.kill(rank_pid, signal.SIGKILL)
"""


@pytest.mark.timeout(60)
def test_a_sigkilled_ranks_helper_writes_its_file(tmp_path):
    """A rank SIGKILLed (the OOM killer) writes nothing; its liveness helper, woken by its end (its
    pidfd: a DataLoader worker still holds the helper's pipe), writes its file before the launcher
    reaps it and tells its peers how it ended. A real process, a real forked helper and worker."""
    import subprocess
    import sys
    import time

    own = _layout(tmp_path)[1]
    env = dict(os.environ, **{reports.ERROR_FILE_ENV: own})
    told = tmp_path / "told.txt"
    proc = subprocess.Popen([sys.executable, "-c", _RANK, str(told)], env=env, stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        helper, worker = map(int, proc.stdout.readline().split())
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{helper}") and time.monotonic() < deadline:
            time.sleep(0.01)  # until the helper has ended (an orphan, reaped by init)
        assert not os.path.exists(f"/proc/{helper}")
        assert os.path.exists(f"/proc/{worker}")  # woken by the rank's end, not the pipe's
        rc = proc.wait(timeout=20)
    finally:
        proc.kill()
        proc.wait()
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
    failure = ProcessFailure(local_rank=1, pid=proc.pid, exitcode=rc, error_file=own)
    assert rc == -9
    assert failure.message["message"] == f"PeerLost: rank 1 (pid {proc.pid} on node-a) lost: killed by SIGKILL"
    assert "written by its liveness helper" in failure.message["extraInfo"]["py_callstack"]
    assert abs(failure.timestamp - time.time()) < 30
    assert told.read_text() == f"rank 1 (pid {proc.pid} on node-a) lost: killed by SIGKILL"


def test_a_helper_writes_nothing_for_a_signal_the_rank_reports_or_a_rank_that_runs(tmp_path, monkeypatch):
    """SIGTERM and SIGINT are the signal handler's to report; a rank that only stopped its
    watchdog (the pipe closed, the process runs) has not ended, and is not waited for."""
    import time

    from fault_tolerant_handlers.core import procfs as _procfs

    from fault_tolerant_handlers.detect import liveness

    own = _layout(tmp_path)[1]
    monkeypatch.setenv(reports.ERROR_FILE_ENV, own)
    reported = (Ended(signal=signal.SIGTERM), Ended(signal=signal.SIGINT), Ended(exit_code=1))
    assert not any(_procfs.unreported(how) for how in reported)
    assert _procfs.unreported(Ended(signal=signal.SIGKILL)) and _procfs.unreported(Ended(signal=signal.SIGSEGV))
    for how in reported:
        with monkeypatch.context() as m:  # the rank ended so (a real one is the next test's)
            m.setattr(liveness._procfs, "ended", lambda pid, within, how=how: how)
            liveness.rank_ended(1, 101, "node-a", tell=lambda record: pytest.fail(f"told {record}"))
    assert not os.path.exists(own)
    start = time.monotonic()
    assert _procfs.ended(os.getpid(), 5.0) is None
    assert time.monotonic() - start < 0.5


def test_a_rank_whose_keeper_died_first_is_told_to_its_peers_with_its_keeper_gone(tmp_path, monkeypatch):
    """A keeper SIGKILLed: its training child dies with it and is reaped by whoever adopted it (its
    exit status not visible: ``Ended()``, which alone its helper would not report). The helper finds
    the keeper's pid gone (a real process, ended and reaped) and tells the peers, ``keeper_gone`` set:
    they do not wait for a replacement the keeper's key promised. A keeper that lives changes nothing."""
    import subprocess
    import sys

    from fault_tolerant_handlers.core import hooks
    from fault_tolerant_handlers.detect import liveness

    monkeypatch.setenv(reports.ERROR_FILE_ENV, _layout(tmp_path)[1])
    keeper = subprocess.Popen([sys.executable, "-c", "pass"])
    keeper.wait()  # ended and reaped: its pid is gone
    told = []
    real = liveness._procfs.ended
    monkeypatch.setattr(liveness._procfs, "ended", lambda pid, within: Ended() if pid == 101 else real(pid, within))
    monkeypatch.setitem(hooks._hooks, hooks.KEEPER_PID, ((os.getpid, False),))  # a keeper that lives: nothing told
    liveness.rank_ended(1, 101, "node-b", tell=told.append)
    assert told == []
    monkeypatch.setitem(hooks._hooks, hooks.KEEPER_PID, ((lambda: keeper.pid, False),))
    liveness.rank_ended(1, 101, "node-b", tell=told.append)
    assert len(told) == 1 and told[0].ended == Ended(keeper_gone=True), told
    assert told[0].exc_message == ("rank 1 (pid 101 on node-b) lost: process is gone (exit status not visible from "
                                   "this process), and its keeper is gone too")


def test_keeper_gone_is_read_back_only_as_a_bool():
    assert _ended({"signal": 9, "keeper_gone": True}) == Ended(signal=9, keeper_gone=True)
    assert _ended({"signal": 9}) == Ended(signal=9)
    assert _ended({"signal": 9, "keeper_gone": "yes"}) is None
    assert _ended({"signal": 9, "keeper_gone": 1}) is None


def _ended(obj):
    """An ``Ended`` as the one store codec reads it back."""
    return decode(Ended, json.dumps(obj), world=1, max_bytes=1024)


def test_a_recovery_in_place_forgets_the_file_written_for_the_recovered_failure_but_not_torchs(tmp_path, monkeypatch):
    from fault_tolerant_handlers.launchers import reports

    path = tmp_path / "0" / "error.json"
    path.parent.mkdir()
    monkeypatch.setenv(reports.ERROR_FILE_ENV, str(path))
    assert reports.write_once(str(path), reports.payload("ValueError: recovered", "tb", 100, "failed"))
    reports.forget_own_file()
    assert not path.exists()  # the next failure writes its own
    path.write_text(json.dumps({"message": {"message": "torch's", "extraInfo": {"timestamp": "1"}}}))
    reports.forget_own_file()
    assert path.exists()  # torch's own file is left
    path.write_text("not json")
    reports.forget_own_file()
    assert path.exists()
