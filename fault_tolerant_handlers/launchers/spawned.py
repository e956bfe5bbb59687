"""Ranks started by ``torch.multiprocessing`` print their report themselves.

``mp.spawn`` / ``mp.start_processes`` (what Ignite's ``idist.Parallel`` / ``idist.spawn`` and
Lightning's ``strategy="ddp_spawn"`` use) run each rank's function inside torch's ``_wrap``, and:

* an exception that leaves the function is **not printed**: ``_wrap`` pickles its traceback into an
  error file, and the parent prints only the one of the first process that failed;
* as soon as one process exits non-zero, the parent SIGTERMs every other one, waits (30 s in torch
  2.13: ``ProcessContext.join`` without a ``grace_period``, which neither Ignite 0.5.5 nor
  Lightning 2.6.6 pass) and then SIGKILLs it.

So a survivor's own output would hold at most the first line the watchdog logs. Under such a
launcher (found at session start from the main thread's stack, :func:`detect`), this module,
told by the core's events (subscribed in ``launchers/__init__.py``):

1. prints the full report (failing rank, exception or signal, remote traceback or hung stack) to
   this rank's stderr as soon as the rank learns of the failure (:func:`print_report`: the watchdog's
   finding, ``PEER_FAILED``; the main thread taking a peer's failure, ``ACKNOWLEDGED``; a SIGTERM
   while the job fails), once per failure;
2. on a SIGTERM that finds nothing known yet, but a same-host peer gone (the parent SIGTERMs only
   after reaping a process that failed), waits up to :data:`SIGTERM_CAUSE_WAIT` for the cause
   (:func:`awaited_cause`): the watchdog's finding (which sees a killed peer's signal) or the peer's
   record in the store; failing both (the store's host is what died), the peer gone, by rank and pid;
3. keeps a killed rank visible: its liveness helper (forked, so it holds the rank's end of the
   parent's sentinel pipe) waits :data:`ZOMBIE_HOLD` before leaving when the rank is gone
   (:func:`hold_zombie`, on ``RANK_ENDED``), so the parent cannot reap the rank before its same-host peers read how
   it ended (``killed by SIGKILL``) from ``/proc``; before that it writes torch's error file for a
   rank killed by a signal (:func:`write_killed`: the helper knows the path, forked after the rank found
   it), so that the parent raises ``ProcessRaisedException: ... rank 1 (pid N on host) lost: killed
   by SIGKILL`` instead of ``process 1 terminated with signal SIGKILL``;
4. writes the report of a reported exit (a hung rank's exit 88, the watchdog ending a survivor with
   87) into torch's error file (:func:`write_exit_report`, on ``EXITING``), so that the parent raises
   ``ProcessRaisedException`` with the report instead of ``process 1 terminated with exit code 88``.

Elsewhere (torchrun, a plain script) it does nothing: the interpreter prints the exception.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..core import compat_torch as _compat_torch
from ..core.config import ZOMBIE_HOLD  # noqa: F401 - how long a gone rank's helper holds it
from ..core.config import SIGTERM_CAUSE_WAIT  # timings: the table in core.config
from ..core.errors import PeerFailedError
from ..core.hooks import first_line, log
from ..core.procfs import RankTable, process_state
from ..core.failure import FailureRecord



@dataclass
class _Spawned:
    error_file: str | None  # torch's error file of this process (None: not found)
    printed: set[tuple]  # the failures whose report was printed
    lock: threading.Lock


_state: _Spawned | None = None
_detected = False


def detect() -> bool:
    """Whether this process runs a rank under ``torch.multiprocessing``'s ``_wrap`` (once per process)."""
    global _state, _detected
    if _detected:
        return _state is not None
    _detected = True
    found = _compat_torch.spawn_error_file()
    if found is not None:
        _state = _Spawned(found or None, set(), threading.Lock())
        if not found:
            log(logging.WARNING, "started by torch.multiprocessing, but its error file was not found: the parent "
                                 "will report a hung rank by its exit code only")
    return _state is not None


def active() -> bool:
    return _state is not None


def _key(err: BaseException) -> tuple:
    return (getattr(err, "failed_rank", None), getattr(err, "exc_type", type(err).__name__),
            first_line(err, None))


def print_report(rank: int, err: BaseException | None, context: str = "the job fails") -> bool:
    """Under ``mp.spawn``: print ``err`` in full on this rank's stderr, once per failure. True if the
    report was printed (now or before)."""
    state = _state
    if state is None or err is None:
        return False
    key = _key(err)
    with state.lock:
        if key in state.printed:
            return True
        state.printed.add(key)
    try:
        sys.stderr.write(f"[rank {rank}] fault-tolerant-handlers: {context}:\n{err}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - the report must never raise
        pass
    return True


def printed(err: BaseException | None) -> bool:
    """The report of ``err`` was printed already (:func:`print_report`)."""
    state = _state
    return state is not None and err is not None and _key(err) in state.printed


def awaited_cause(same_host, known: Callable[[], PeerFailedError | None],
                  records: Callable[[], PeerFailedError | None], wait: float = SIGTERM_CAUSE_WAIT) -> PeerFailedError | None:
    """On a SIGTERM under ``mp.spawn`` with nothing known yet: if a same-host peer is gone
    (``same_host``: a :class:`~..core.procfs.PeerPidProbe`), the cause, waited for up to ``wait``
    seconds (``known()``: the watchdog's finding, else ``records()``: a peer's record in the store),
    else that peer gone. ``None`` when no peer is gone (this rank is the cause)."""
    if _state is None:
        return None
    gone = same_host.poll(time.monotonic())
    if gone is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        if known() is not None:
            return known()
        try:
            found = records()
        except Exception:  # noqa: BLE001 - the store may be what died
            found = None
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return known() or gone.error


def hold_zombie(rank_pid: int, rank: int | None = None, host: str = "") -> None:
    """In a rank's liveness helper whose rank just went away: under ``mp.spawn``, if the rank is
    a zombie (it died; its parent cannot reap it while this process holds the sentinel pipe), write
    torch's error file for it when a signal killed it (:func:`write_killed`), then wait
    :data:`ZOMBIE_HOLD` so that same-host peers read its exit status. Returns at once otherwise."""
    if _state is None:
        return
    try:
        with open(f"/proc/{rank_pid}/stat") as f:
            stat = f.read()
    except OSError:
        return
    fields = stat[stat.rfind(")") + 2:].split()
    if fields and fields[0] == "Z":
        if rank is not None:
            write_killed(rank_pid, rank, host)
        time.sleep(ZOMBIE_HOLD)


def write_killed(rank_pid: int, rank: int, host: str) -> bool:
    """The rank (a zombie its parent cannot reap yet) was killed by a signal: write torch's error
    file for it, so that the parent raises ``ProcessRaisedException`` naming the rank, its pid and
    the signal instead of ``process 1 terminated with signal SIGKILL``. Created here only when
    absent (a rank's own report stands); the parent reads it once every process has ended."""
    state = _state
    if state is None or state.error_file is None:
        return False
    how = process_state(rank_pid)
    if how is None or not how.killed:
        return False
    lost = FailureRecord.lost(rank=rank, pid=rank_pid, host=host, why=how, by=rank).exc_message
    text = f"fault-tolerant-handlers: {lost} (seen by its liveness helper: a killed process prints no traceback)\n"
    return _write_error_file(state.error_file, text)


def _write_error_file(path: str, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    with os.fdopen(fd, "wb") as fh:
        pickle.dump(text, fh)  # the format torch's parent reads: a pickled str
    return True


def write_exit_report(err: BaseException | None, code: int) -> None:
    """A reported exit under ``mp.spawn``: ``err``'s report goes into torch's error file (created
    here, never overwritten), which the parent raises as ``ProcessRaisedException``."""
    state = _state
    if state is None or state.error_file is None or err is None:
        return
    text = f"fault-tolerant-handlers ended this process (exit code {code}) because:\n{err}\n"
    _write_error_file(state.error_file, text)


# -- what this module does on the core's events (subscribed in ``launchers/__init__.py``) -------------
def on_session_started(session) -> None:
    detect()  # under mp.spawn, this rank prints its report itself


def on_peer_failed(table: RankTable, err: PeerFailedError, escalated: bool) -> None:
    if escalated:
        print_report(table.rank, err)  # the report, before the launcher's SIGTERM


def on_acknowledged(table: RankTable, err: BaseException | None, known: PeerFailedError | None) -> None:
    print_report(table.rank, err if err is not None else known)


def on_exiting(table: RankTable, err: BaseException | None, code: int) -> None:
    write_exit_report(err, code)  # the parent raises this report


def on_rank_ended(pid: int, rank: int, host: str) -> None:
    hold_zombie(pid, rank, host)
