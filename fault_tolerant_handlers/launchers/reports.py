"""What a launcher reads of a failure (``docs/launchers.md``), and the launchers' part of the core's
announcements: this module is the one the failure path calls.

torchrun's *Root Cause* is the failure with the smallest ``timestamp`` in the workers'
``TORCHELASTIC_ERROR_FILE``: a rank that fails itself writes its own with the failure's second; a
survivor, one that cannot win; a killed rank's, its liveness helper and a same-host survivor that
sees it gone (the first writer wins). Under ``mp.spawn`` (which prints only the first failed
process's exception) each rank prints its full report, and torch's error file is written for a
killed rank and by a reported exit.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

from . import compat_torchrun
from ..core import compat_torch as _compat_torch
from ..core.config import SIGTERM_CAUSE_WAIT, ZOMBIE_HOLD  # timings: the table in core.config
from ..core.errors import EXIT_PEER_FAILED
from ..core.failure import FailureKind, FailureRecord, PeerFailedError
from ..core.hooks import first_line, log
from ..core.procfs import STATE, RankTable, process_state, stat_fields

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
ERROR_FILE_NAME = "error.json"
WRITER = "fault_tolerant_handlers"  # marks the files this library wrote (extraInfo.writer)


# -- torchrun's error files ----------------------------------------------------------------------------
def own_path() -> str | None:
    path = os.environ.get(ERROR_FILE_ENV, "")
    return None if not path or path == os.devnull else path


def peer_path(own: str, local_rank: int, peer_local_rank: int) -> str | None:
    """The error file of a peer on this host: ``<attempt dir>/<peer local rank>/error.json``,
    ``None`` when ``own`` is not laid out as torchrun does or the directory is missing."""
    parent = os.path.dirname(own)
    if os.path.basename(own) != ERROR_FILE_NAME or os.path.basename(parent) != str(local_rank):
        return None
    directory = os.path.join(os.path.dirname(parent), str(peer_local_rank))
    if not os.path.isdir(directory):
        return None
    return os.path.join(directory, ERROR_FILE_NAME)


def payload(message: str, callstack: str, timestamp: int, role: str) -> dict:
    return {"message": {"message": message,
                        "extraInfo": {"py_callstack": callstack, "timestamp": str(int(timestamp)),
                                      "writer": WRITER, "role": role}}}


def write_once(path: str | None, data: dict | bytes) -> bool:
    """Create ``path`` with ``data`` (a dict: as JSON) unless it exists (atomically; ``None``: no file to
    write); True when this call wrote it."""
    if path is None or os.path.exists(path):
        return False
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".error-", suffix=".json", dir=os.path.dirname(path) or ".")
        with os.fdopen(fd, "wb") as f:
            f.write(data if isinstance(data, bytes) else json.dumps(data).encode())
        os.link(tmp, path)  # fails if the file exists: never overwrites
        return True
    except FileExistsError:
        return False
    except OSError as err:
        log(logging.WARNING, "could not write the error file %s: %s", path, err)
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def forget_own_file(state=None) -> None:
    """``RE_FORM``: this rank's file, if this library wrote it, goes (torchrun must not name a recovered failure)."""
    path = own_path()
    if path is None:
        return
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none, or not ours
        with open(path) as f:
            written = json.load(f)
        if written["message"]["extraInfo"]["writer"] == WRITER:
            os.unlink(path)


def write_failed(record: FailureRecord) -> bool:
    """``RANK_FAILED``: this rank failed itself (``record`` is its own): its file, with the failure's time."""
    message = f"{record.exc_type}: {record.exc_message}"
    callstack = record.traceback if message in record.traceback else f"{message}\n{record.traceback}".rstrip()
    return write_once(own_path(), payload(message, callstack, record.time_ms // 1000, "failed"))


def survivor_timestamp(failed_at: float | None, now: float | None = None) -> int:
    """A survivor's timestamp: after the failure's second and after the current one."""
    now = time.time() if now is None else now
    return (int(now) if failed_at is None else max(int(failed_at), int(now))) + 1


def _dead_peer_file(table: RankTable, err: PeerFailedError, own: str) -> None:
    """``err`` says a same-host peer is gone (killed): write the file it could not write."""
    rank = err.failed_rank
    if (err.kind is not FailureKind.PEER_LOST or err.host != table.host or rank == table.rank
            or rank not in table.ranks or table.pid_of(rank) != err.pid):
        return
    peer_local = rank - (table.rank - table.local_rank)
    path = peer_path(own, table.local_rank, peer_local) if 0 <= peer_local < table.local_world_size else None
    when = err.failed_at if err.failed_at is not None else time.time()
    message = f"{err.exc_type}: {err.exc_message}"
    if write_once(path, payload(message, f"{message}\n(written by rank {table.rank}, which saw it end)",
                                int(when), "killed")):
        log(logging.INFO, "wrote the error file of rank %d for torchrun: %s", rank, path)


def write_killed(record: FailureRecord) -> bool:
    """``RANK_KILLED``, in the liveness helper of a rank killed by a signal it could not report."""
    message = f"{record.exc_type}: {record.exc_message}"
    return write_once(own_path(), payload(message, f"{message}\n(written by its liveness helper, which saw it end)",
                                          record.time_ms // 1000, "killed"))


def write_survivor(table: RankTable, err: PeerFailedError | None) -> bool:
    """This rank ends because of ``err``: a peer killed on this host gets its file, then this rank one that can't win."""
    own = own_path()
    if own is None:
        return False
    try:
        if err is not None:
            _dead_peer_file(table, err, own)
        failed_at = err.failed_at if err is not None else None
        message = f"PeerFailedError: {first_line(err, None) if err is not None else 'a peer failed'}"
        return write_once(own, payload(message, str(err) if err is not None else message,
                                       survivor_timestamp(failed_at), "survivor"))
    except Exception as exc:  # noqa: BLE001 - never mask the failure being reported
        log(logging.WARNING, "could not write torchrun's error file: %s", exc)
        return False


# -- torch.multiprocessing's error files and a spawned rank's report -----------------------------------
@dataclass
class _Spawned:
    error_file: str | None  # torch's error file of this process (None: not found)
    printed: set[tuple]  # the failures whose report was printed
    lock: threading.Lock


_state: _Spawned | None = None


@functools.cache
def detect() -> bool:
    """Whether this process runs a rank under ``torch.multiprocessing`` (looked at once per process)."""
    global _state
    found = _compat_torch.spawn_error_file()
    if found is not None:
        _state = _Spawned(found or None, set(), threading.Lock())
        if not found:
            log(logging.WARNING, "started by torch.multiprocessing, but its error file was not found: the parent "
                                 "will report a hung rank by its exit code only")
    return _state is not None


def _key(err: BaseException) -> tuple:
    return (getattr(err, "failed_rank", None), getattr(err, "exc_type", type(err).__name__),
            first_line(err, None))


def print_report(rank: int, err: BaseException | None) -> bool:
    """Under ``mp.spawn``: print ``err`` in full on stderr, once per failure (True: printed, now or before)."""
    state = _state
    if state is None or err is None:
        return False
    key = _key(err)
    with state.lock:
        if key in state.printed:
            return True
        state.printed.add(key)
    with contextlib.suppress(Exception):  # the report must never raise
        sys.stderr.write(f"[rank {rank}] fault-tolerant-handlers: the job fails:\n{err}\n")
        sys.stderr.flush()
    return True


def printed(err: BaseException | None) -> bool:
    state = _state
    return state is not None and err is not None and _key(err) in state.printed


def awaited_cause(same_host, known: Callable[[], PeerFailedError | None],
                  records: Callable[[], PeerFailedError | None], wait: float = SIGTERM_CAUSE_WAIT) -> PeerFailedError | None:
    """A SIGTERM under ``mp.spawn`` after a same-host peer is gone: the cause (``known()``, else ``records()``)
    waited for up to ``wait`` s, else that peer gone; ``None`` when no peer is gone."""
    if _state is None:
        return None
    gone = same_host.poll(time.monotonic())
    if gone is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        if known() is not None:
            return known()
        found = None
        with contextlib.suppress(Exception):  # the store may be what died
            found = records()
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            return known() or gone
        time.sleep(0.05)


def hold_zombie(rank_pid: int, rank: int | None = None, host: str = "") -> None:
    """``RANK_ENDED``, in a rank's liveness helper under ``mp.spawn``: a zombie rank gets torch's error file if a
    signal killed it, and is held :data:`ZOMBIE_HOLD` (this process holds its sentinel) for its peers to read."""
    state = _state
    fields = stat_fields(rank_pid) if state is not None else None
    if not fields or fields[STATE] != "Z":
        return
    how = process_state(rank_pid)
    if rank is not None and state.error_file is not None and how is not None and how.killed:
        # torch's error file for it (read once every process has ended): the parent reads a pickled str
        lost = FailureRecord.lost(rank=rank, pid=rank_pid, host=host, why=how, by=rank).exc_message
        write_once(state.error_file, pickle.dumps(f"fault-tolerant-handlers: {lost} (seen by its liveness helper: "
                                                  "a killed process prints no traceback)\n"))
    time.sleep(ZOMBIE_HOLD)


def write_exit_report(err: BaseException | None, code: int) -> None:
    """A reported exit under ``mp.spawn``: ``err``'s report goes into torch's error file (the parent raises it)."""
    if _state is not None and _state.error_file is not None and err is not None:
        write_once(_state.error_file, pickle.dumps(f"fault-tolerant-handlers ended this process (exit code {code}) "
                                                   f"because:\n{err}\n"))


# -- the core's announcements (wired in ``..wiring``) --------------------------------------------------
#: This process's own failure in its current session, kept after the session is gone: a SIGTERM after
#: it (:mod:`.signals`), even during the interpreter's exit hooks, ends the rank with exit code 1, not -15.
own_failure: FailureRecord | None = None
#: Per session imported after init_process_group under torchrun: its gloo address keys to delete.
_attempt_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def on_session_started(session) -> None:
    global own_failure
    own_failure = None  # a new session: a new attempt (recovering in place), no failure of its own yet
    detect()  # under mp.spawn, this rank prints its report itself
    keys = compat_torchrun.attempt_keys(session)
    if keys is not None:
        _attempt_keys[session] = keys


def on_rank_failed(record: FailureRecord) -> None:
    global own_failure
    write_failed(record)
    own_failure = record


def on_peer_failed(table: RankTable, err: PeerFailedError, escalated: bool) -> None:
    # torchrun: the agent reads a failed worker's file as soon as it notices the exit
    own = own_path()
    if own is not None:
        try:
            _dead_peer_file(table, err, own)
        except Exception as exc:  # noqa: BLE001
            log(logging.WARNING, "could not write torchrun's error file: %s", exc)
    if escalated:
        print_report(table.rank, err)  # mp.spawn: the report, before the launcher's SIGTERM


def on_acknowledged(table: RankTable, err: BaseException | None, known: PeerFailedError | None) -> None:
    write_survivor(table, err if isinstance(err, PeerFailedError) else known)
    print_report(table.rank, err if err is not None else known)


def on_job_failed(session) -> None:
    keys = _attempt_keys.get(session)
    if keys is not None:  # torchrun, imported late: the next attempt comes up
        keys.forget(session)


def on_exiting(table: RankTable, err: BaseException | None, code: int) -> None:
    if code == EXIT_PEER_FAILED:
        write_survivor(table, err)
    write_exit_report(err, code)  # mp.spawn: the parent raises this report


def on_session_closed(session) -> None:
    keys = _attempt_keys.pop(session, None)
    if keys is not None:
        keys.close()


def ignore_sigterm_if_failed() -> None:
    """At exit, where SIGTERM's action is the default (registered by :mod:`.signals`): after the exit
    hooks Python runs no handler while it tears down, for seconds; a rank that failed itself ignores a
    launcher's SIGTERM from here on, so that torchrun's Root Cause shows its exception, not -15."""
    if own_failure is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
