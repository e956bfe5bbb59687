"""torchrun's error files, written without ``@record``, so that its "Root Cause" names the rank that failed.

torchrun (``torch.distributed.elastic``) gives every worker ``TORCHELASTIC_ERROR_FILE``
(``<log dir>/<run>/attempt_<n>/<local rank>/error.json``) and, when workers fail, names as
*Root Cause* the failure with the smallest ``timestamp`` (whole seconds), ties going to the lowest
rank. A worker without a file gets the time the agent noticed its exit, so without files a victim
often wins: the agent notices the failing rank and its survivors in the same second. This module
writes the files in the format of ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``
(``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": "<s>"}}}``):

* a rank that **fails itself** (:meth:`Session.report_error`, the watchdog finding it hung, its
  own signal: the event ``RANK_FAILED``) writes its own file with the failure's time
  (:func:`write_failed`);
* a **survivor** (it raises or ends because of a peer's failure, or is signalled after it) writes
  its own file with a timestamp that cannot win: at least the failure's second + 1, and at least
  the current second + 1 (the agent never notices an exit later than the survivor's own end)
  (:func:`write_survivor`: the events ``ACKNOWLEDGED`` and ``EXITING``);
* a rank **killed by a signal** cannot write its file: its liveness helper (a process of its own,
  woken by the rank's end, :func:`write_killed`: the event ``RANK_KILLED``) writes it, and so does
  a survivor on the same host that sees it gone (:func:`write_dead_peer`: the event ``PEER_FAILED``;
  its path derived from torchrun's layout: the sibling ``<local rank>`` directory),
  with the kill as the message, before its own. Two writers because the agent reads a failed
  worker's file as soon as its monitor (every 0.1 s by default) notices the exit: the helper, blocked
  on nothing but the rank's end, is there first; the survivor's watchdog thread waits for its GIL.

A file is never overwritten (created atomically with a hard link, so the agent never reads half a
file, and only when absent): the first writer, usually the rank itself, wins. Outside torchrun
(variable unset, empty or ``/dev/null``) nothing is written.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from ..core.errors import EXIT_PEER_FAILED, PeerFailedError
from ..core.failure import FailureKind, FailureRecord
from ..core.hooks import first_line, log
from ..core.procfs import HANDLED_SIGNALS, RankTable, unreported  # noqa: F401 - read by the helper; kept here for readers

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
ERROR_FILE_NAME = "error.json"
#: Marks the files this library wrote (``extraInfo.writer``).
WRITER = "fault_tolerant_handlers"


def own_path() -> str | None:
    """This worker's error file under torchrun, or ``None``."""
    path = os.environ.get(ERROR_FILE_ENV, "")
    if not path or path == os.devnull:
        return None
    return path


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


def write_once(path: str, data: dict) -> bool:
    """Create ``path`` with ``data`` unless it exists (atomically); True when this call wrote it."""
    if os.path.exists(path):
        return False
    directory = os.path.dirname(path) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=".error-", suffix=".json", dir=directory)
    except OSError as err:
        log(logging.WARNING, "could not write torchrun's error file %s: %s", path, err)
        return False
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.link(tmp, path)  # fails if the file exists: never overwrites
        return True
    except FileExistsError:
        return False
    except OSError as err:
        log(logging.WARNING, "could not write torchrun's error file %s: %s", path, err)
        return False
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def write_failed(record: FailureRecord) -> bool:
    """This rank failed itself (or its own signal is the cause) (``record`` is its own): write its file with the failure's time."""
    path = own_path()
    if path is None:
        return False
    message = f"{record.exc_type}: {record.exc_message}"
    callstack = record.traceback if message in record.traceback else f"{message}\n{record.traceback}".rstrip()
    return write_once(path, payload(message, callstack, record.time_ms // 1000, "failed"))


def survivor_timestamp(failed_at: float | None, now: float | None = None) -> int:
    """A survivor's timestamp: after the failure's second and after the current one."""
    now = time.time() if now is None else now
    base = int(now) if failed_at is None else max(int(failed_at), int(now))
    return base + 1


def _dead_peer_file(table: RankTable, err: PeerFailedError, own: str) -> None:
    """``err`` says a same-host peer is gone (killed): write the file it could not write."""
    rank = err.failed_rank
    if err.kind is not FailureKind.PEER_LOST or rank is None or err.host != table.host or rank == table.rank:
        return
    if rank not in table.ranks or table.pid_of(rank) != err.pid:
        return
    peer_local = rank - (table.rank - table.local_rank)
    if not 0 <= peer_local < table.local_world_size:
        return
    path = peer_path(own, table.local_rank, peer_local)
    if path is None:
        return
    when = err.failed_at if err.failed_at is not None else time.time()
    message = f"{err.exc_type}: {err.exc_message}"
    if write_once(path, payload(message, f"{message}\n(written by rank {table.rank}, which saw it end)",
                                int(when), "killed")):
        log(logging.INFO, "wrote the error file of rank %d for torchrun: %s", rank, path)


def write_dead_peer(table: RankTable, err: PeerFailedError) -> None:
    """The watchdog found ``err``: if it is a same-host peer gone, write its file at once (the agent
    reads a failed worker's file as soon as it notices the exit)."""
    own = own_path()
    if own is not None:
        try:
            _dead_peer_file(table, err, own)
        except Exception as exc:  # noqa: BLE001
            log(logging.WARNING, "could not write torchrun's error file: %s", exc)


def write_killed(record: FailureRecord) -> bool:
    """In the liveness helper of a rank killed by a signal it could not report (:func:`~..core.procfs.unreported`):
    write its file for it, with ``record`` (its ``PeerLost``, which the helper also publishes)."""
    path = own_path()
    if path is None:
        return False
    message = f"{record.exc_type}: {record.exc_message}"
    try:
        return write_once(path, payload(message, f"{message}\n(written by its liveness helper, which saw it end)",
                                        record.time_ms // 1000, "killed"))
    except Exception:  # noqa: BLE001 - the helper must end regardless
        return False


def write_survivor(table: RankTable, err: PeerFailedError | None) -> bool:
    """This rank ends (or raises) because of a peer's failure ``err``: write the dead peer's file
    when it was killed on this host, then this rank's own with a timestamp that cannot win."""
    own = own_path()
    if own is None:
        return False
    try:
        if err is not None:
            _dead_peer_file(table, err, own)
        failed_at = err.failed_at if err is not None else None
        summary = first_line(err, None) if err is not None else "a peer failed"
        message = f"PeerFailedError: {summary}"
        return write_once(own, payload(message, str(err) if err is not None else message,
                                       survivor_timestamp(failed_at), "survivor"))
    except Exception as exc:  # noqa: BLE001 - never mask the failure being reported
        log(logging.WARNING, "could not write torchrun's error file: %s", exc)
        return False


# -- what this module does on the core's events (subscribed in ``launchers/__init__.py``) -------------
def on_peer_failed(table: RankTable, err: PeerFailedError, escalated: bool) -> None:
    write_dead_peer(table, err)  # the agent reads a failed worker's file as soon as it notices the exit


def on_acknowledged(table: RankTable, err: BaseException | None, known: PeerFailedError | None) -> None:
    write_survivor(table, err if isinstance(err, PeerFailedError) else known)


def on_exiting(table: RankTable, err: BaseException | None, code: int) -> None:
    if code == EXIT_PEER_FAILED:
        write_survivor(table, err)
