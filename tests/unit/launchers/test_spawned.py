"""``reports``: a rank started by ``torch.multiprocessing.spawn`` is recognised, announces a failure
once, and a reported exit's report reaches the parent's ``ProcessRaisedException`` (real
``mp.spawn`` of one process; no process group)."""

from __future__ import annotations

import os

import pytest
import torch.multiprocessing as mp

from fault_tolerant_handlers.core import compat_torch as _compat_torch
from fault_tolerant_handlers.launchers import reports
from fault_tolerant_handlers.core.failure import PeerFailedError

pytestmark = pytest.mark.timeout(60)


def _detects(index: int, out: str) -> None:
    found = _compat_torch.spawn_error_file()
    with open(out, "w") as f:
        f.write(repr(found))


def _hung_exit(index: int) -> None:
    assert reports.detect()
    err = PeerFailedError(1, "RankHung", "rank 1 hung: its main thread made no progress for 3.0 s at step 2",
                          origin="declared")
    reports.write_exit_report(err, 88)
    os._exit(88)


def test_a_spawned_rank_knows_its_error_file(tmp_path):
    out = tmp_path / "found.txt"
    mp.spawn(_detects, args=(str(out),), nprocs=1)
    found = eval(out.read_text())  # noqa: S307 - our own repr of a str
    assert isinstance(found, str) and os.path.basename(found).startswith("pytorch-errorfile-"), found


def test_not_spawned_here():
    assert _compat_torch.spawn_error_file() is None


def _killed_with_its_helper(index: int) -> None:
    """A rank with a forked helper (as its liveness process is) SIGKILLs itself."""
    import signal
    import time

    from fault_tolerant_handlers.core.procfs import process_state

    assert reports.detect()
    rank_pid = os.getpid()
    if os.fork() == 0:  # the helper: holds the parent's sentinel pipe, as every fork of the rank does
        try:
            while process_state(rank_pid) is None:
                time.sleep(0.01)
            reports.hold_zombie(rank_pid, 1, "host-a")
        finally:
            os._exit(0)
    os.kill(rank_pid, signal.SIGKILL)


def test_a_killed_ranks_helper_writes_what_the_parent_raises():
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_killed_with_its_helper, nprocs=1)
    text = str(info.value)
    assert "-- Process 0 terminated with the following error:" in text
    assert f"rank 1 (pid {info.value.error_pid} on host-a) lost: killed by SIGKILL" in text, text


def test_a_reported_exit_is_what_the_parent_raises():
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_hung_exit, nprocs=1)
    text = str(info.value)
    assert "-- Process 0 terminated with the following error:" in text
    assert "ended this process (exit code 88)" in text and "RankHung: rank 1 hung" in text, text


def test_announce_prints_each_failure_once(capsys, monkeypatch):
    monkeypatch.setattr(reports, "_state", reports._Spawned(None, set(), __import__("threading").Lock()))
    err = PeerFailedError(1, "ValueError", "bad sample 17", origin="record")
    assert reports.print_report(0, err) and reports.print_report(0, err)
    assert reports.printed(err)
    printed = capsys.readouterr().err
    assert printed.count("fault-tolerant-handlers: the job fails:") == 1 and "bad sample 17" in printed


def test_announce_is_silent_when_not_spawned(capsys, monkeypatch):
    monkeypatch.setattr(reports, "_state", None)
    assert not reports.print_report(0, PeerFailedError(1, "ValueError", "bad sample 17"))
    assert capsys.readouterr().err == ""


def test_a_dead_ranks_helper_holds_it_visible_for_its_peers(monkeypatch):
    import signal
    import subprocess
    import sys
    import time

    monkeypatch.setattr(reports, "_state", reports._Spawned(None, set(), __import__("threading").Lock()))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        reports.hold_zombie(proc.pid)  # alive: no wait
        assert time.monotonic() - start < 0.2
        os.kill(proc.pid, signal.SIGKILL)
        while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)  # dead, not reaped yet: a zombie
        start = time.monotonic()
        reports.hold_zombie(proc.pid)
        assert time.monotonic() - start >= reports.ZOMBIE_HOLD - 0.01
    finally:
        proc.kill()
        proc.wait()


class _Probe:
    def __init__(self, finding):
        self.finding = finding

    def poll(self, now):
        return self.finding


class _Session:
    """What a SIGTERM's wait reads: the same-host pid check and what the watchdog knows."""

    def __init__(self, finding):
        self.same_host_probe = _Probe(finding)
        self.peer_error = None

    def awaited_cause(self, records, **kw):
        return reports.awaited_cause(self.same_host_probe, lambda: self.peer_error, records, **kw)


def _session(finding):
    return _Session(finding)


def test_a_sigterm_with_no_peer_gone_is_not_waited_on(monkeypatch):
    import time

    monkeypatch.setattr(reports, "_state", reports._Spawned(None, set(), __import__("threading").Lock()))
    start = time.monotonic()
    assert _session(None).awaited_cause(lambda: None) is None
    assert time.monotonic() - start < 0.1


def test_a_sigterm_after_a_peer_is_gone_waits_for_the_watchdogs_finding(monkeypatch):
    import threading
    import time

    monkeypatch.setattr(reports, "_state", reports._Spawned(None, set(), threading.Lock()))
    gone = PeerFailedError(0, "PeerLost", "rank 0 (pid 7 on h) lost: process is gone", origin="declared")
    session = _session(gone)
    better = PeerFailedError(0, "PeerLost", "rank 0 (pid 7 on h) lost: killed by SIGKILL", origin="declared")
    threading.Timer(0.2, lambda: setattr(session, "peer_error", better)).start()
    assert session.awaited_cause(lambda: None, wait=2.0) is better
    # nothing better within the wait (the store's host died): the peer gone, by rank and pid
    session = _session(gone)
    start = time.monotonic()
    assert session.awaited_cause(lambda: None, wait=0.3) is gone
    assert 0.3 <= time.monotonic() - start < 1.0
    # a peer's record in the store wins over the pid
    record = PeerFailedError(1, "ValueError", "bad sample 17", origin="record")
    assert _session(gone).awaited_cause(lambda: record, wait=2.0) is record
