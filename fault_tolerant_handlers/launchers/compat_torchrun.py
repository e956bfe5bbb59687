"""torchrun restarts: one store namespace per attempt (``docs/launchers.md``), torch's private
rendezvous and group tables in one place.

torchrun's agent hands every attempt the same ``TCPStore`` without a per-attempt prefix: gloo's
``connectFullMesh`` of attempt N could read attempt N-1's dead addresses. So the ``env`` and ``tcp``
rendezvous handlers are wrapped to give ``init_process_group`` ``PrefixStore("fth/attempt_<restart>",
store)`` (installed at import; ``FTH_ATTEMPT_STORE=0`` turns it off). Imported after
``init_process_group``, each rank deletes its address keys once every peer read them
(:func:`attempt_keys`).

Private API: ``torch.distributed.rendezvous._rendezvous_handlers``, checked against torch 2.13.0; the
names of gloo's address keys (``core.schema.gloo_address_key``, with ``_world.pg_map``, ``pg_names``
and ``group_count``), checked at start against this rank's own.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..core import attempts, config
from ..core.config import ATTEMPT_KEYS_PATIENCE, ATTEMPT_KEYS_WAIT, EXPLAIN_EVIDENCE_TIMEOUT, MAIN_STORE_TIMEOUT
from ..core.hooks import first_line, log
from ..core.schema import gloo_address_key
from ..core.phases import RecoveryState

if TYPE_CHECKING:
    from ..core.schema import Connection
    from ..core.session import Session

_WRAPPED_ATTR = "_fth_attempt_wrapped"
_SCHEMES = ("env", "tcp")


def _agent_store() -> bool:
    return attempts.under_torchrun() and config.settings().attempt_store


def _table() -> dict:
    # the module (``torch.distributed.rendezvous`` the attribute is a function of the same name)
    table = getattr(importlib.import_module("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    missing = [s for s in _SCHEMES if not isinstance(table, dict) or s not in table]
    if missing:
        raise RuntimeError(
            "fault_tolerant_handlers: torch.distributed.rendezvous._rendezvous_handlers "
            f"{'is missing' if not isinstance(table, dict) else 'has no handler for ' + ', '.join(missing)} "
            f"(torch {torch.__version__}); restarts under torchrun cannot be isolated per attempt. "
            f"Set {config.ATTEMPT_STORE_ENV}=0 to go on without it, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun"
        )
    return table


#: The process group was made through :func:`_wrap`'s handler: its keys are in the attempt's namespace
#: (else, under torchrun's shared store, they are under torch's bare names: the next attempt reads them).
_prefixed = False


def _gloo_groups() -> list[tuple[Any, str | None]]:
    """``(group, name)`` of every gloo group of this process (``None`` names the default group)."""
    world = distributed_c10d._world
    default = distributed_c10d._get_default_group()
    groups = []
    for pg in list(world.pg_map):
        with contextlib.suppress(Exception):  # a group being destroyed
            if dist.get_backend(pg) == "gloo":
                groups.append((pg, None if pg is default else world.pg_names[pg]))
    return groups


def _keys(groups: list[tuple[Any, str | None]], *, own: bool) -> list[str]:
    keys = []
    for pg, name in groups:
        with contextlib.suppress(Exception):  # a group being destroyed
            keys += [gloo_address_key(r, name) for r in ((pg.rank(),) if own else range(pg.size()))]
    return keys


def group_count() -> int:
    """How many groups this process made with a counted name (``0``: the default; a destroyed one keeps its number)."""
    return int(distributed_c10d._world.group_count)


def forget_addresses(call: Callable[..., Any], keys: list[str]) -> int:
    """Delete ``keys`` one by one (listing them holds the GIL for the whole call, torch 2.13); how many were there."""
    return sum(bool(call("delete_key", key)) for key in keys)


def read_keys(session: Session) -> tuple[list[str], set[str | None], int]:
    """The gloo address keys this rank deletes when ``session`` starts (its own of each live group within
    it, and of every counted group not live here when it spans the world), the live groups' names and the count."""
    members = set(dist.get_process_group_ranks(session.side))
    count = group_count()
    live, keys = set(), []
    for pg, name in _gloo_groups():
        try:
            ranks = set(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 - a group being destroyed
            continue
        live.add(name)
        if ranks <= members:
            keys.append(gloo_address_key(pg.rank(), name))
    if len(members) == dist.get_world_size():
        keys += [key for n in range(count) if (None if n == 0 else str(n)) not in live
                 for key in [gloo_address_key(session.rank, None if n == 0 else str(n))]]
    return keys, live, count


class AttemptKeys:
    """Imported after ``init_process_group`` under torchrun (:func:`attempt_keys`): one session's
    connection without a prefix (``None`` once used), a lock held while deleting, and what went when
    it started: the live groups' names and the group count."""

    def __init__(self, conn: Connection, done: set[str | None], count: int) -> None:
        self.conn: Connection | None = conn
        self.lock = threading.Lock()
        self.done = done
        self.count = count

    def later(self, world_size: int) -> list[str]:
        """Every rank's address keys of the groups made since, live or destroyed (whose members are unknown)."""
        keys = [gloo_address_key(r, None if n == 0 else str(n)) for n in range(self.count, group_count())
                for r in range(world_size)]
        return keys + [key for pg, name in _gloo_groups() if name not in self.done and not (
            name is not None and name.isdigit() and int(name) >= self.count) for key in _keys([(pg, name)], own=False)]

    def forget(self, session: Session) -> None:
        """The job failed: delete the address keys of the groups made after ``session`` started (once)."""
        # Held while deleting: a second caller (the main thread taking the failure, while the
        # watchdog deletes) waits until the keys are gone, so that its exit never cuts it short.
        with self.lock:
            conn, self.conn = self.conn, None
            if conn is None:
                return
            try:
                later = self.later(session.world_size)
                if not later:  # the usual case: nothing is deleted on the way out
                    return
                gone = session.store_evidence(EXPLAIN_EVIDENCE_TIMEOUT)
                if gone is not None:  # the store (torchrun's rendezvous with it) is gone: nothing to delete
                    log(logging.INFO, "not deleting the gloo address keys of the groups made later: %s", gone)
                    return
                conn.deadline = time.monotonic() + ATTEMPT_KEYS_WAIT  # the failure path: bounded
                count = forget_addresses(conn.call, later)
                log(logging.INFO, "deleted %d gloo address keys of groups made after the session started from "
                    "torchrun's store, so that a restarted attempt connects to its new peers", count)
            except Exception as err:  # noqa: BLE001 - the store may be what failed; never mask the failure
                log(logging.WARNING, "could not delete the gloo address keys of later groups: %s", first_line(err))
            finally:
                conn.close()

    def close(self) -> None:
        with self.lock:
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


def attempt_keys(session: Session) -> AttemptKeys | None:
    """Imported after init_process_group under torchrun: the keys every peer has read go now, in a
    thread (a store connection in the main thread stalled the start of 8 ranks on a busy store); the
    entry returned deletes those of groups made later when the job fails. ``None`` otherwise."""
    if _prefixed or not _agent_store() or session.store_address is None:
        return None
    keys, names, upto = read_keys(session)  # no store call: torch's group table
    conn = session.connection("attempt-keys", MAIN_STORE_TIMEOUT, prefix="", backoff=True)
    entry = AttemptKeys(conn, set(), 1)  # until the thread deleted them, all go on the way out
    threading.Thread(target=_forget_read_keys, args=(session, entry, keys, names, upto), name="fth-attempt-keys",
                     daemon=True).start()
    return entry


def _forget_read_keys(session: Session, entry: AttemptKeys, keys: list[str], names: set[str | None],
                      upto: int) -> None:
    # Tries of ATTEMPT_KEYS_WAIT each, under the lock (the way out, AttemptKeys.forget, waits for one
    # try, or comes first and leaves nothing to do); a connect slower than a try is kept for the next.
    end, checked = time.monotonic() + ATTEMPT_KEYS_PATIENCE, False
    while True:
        with entry.lock:
            conn = entry.conn
            if conn is None:
                return
            conn.deadline = time.monotonic() + ATTEMPT_KEYS_WAIT
            try:
                # Checked once: a try that failed part-way may have deleted this rank's own key.
                if not checked and not conn.call("check", [gloo_address_key(session.rank)]):
                    log(logging.WARNING, "fault_tolerant_handlers was imported after init_process_group under "
                        "torchrun, and this attempt's gloo address keys cannot be found (no key %r in the store, "
                        "torch %s): a restarted attempt may fail in gloo's connectFullMesh; import "
                        "fault_tolerant_handlers before init_process_group",
                        gloo_address_key(session.rank), torch.__version__)
                    entry.conn = None
                    conn.close()
                    return
                checked = True
                deleted = forget_addresses(conn.call, keys)
                entry.done, entry.count = names, upto
                log(logging.INFO, "deleted %d gloo address keys of %d groups from torchrun's shared store: "
                    "every peer has read them, and a restarted attempt must not", deleted, upto)
                return
            except Exception as err:  # noqa: BLE001 - never stop the session
                if time.monotonic() >= end:
                    log(logging.WARNING, "could not delete the gloo address keys from torchrun's shared store now "
                        "(%s): they are deleted on the way out instead", first_line(err))
                    return
            finally:
                conn.deadline = None
        time.sleep(0.5)


# -- recovering in place: the launchers' steps (wired in ``..wiring``) ---------------------------------
#: ``(store, rank, world_size)`` every rendezvous gives after a recovery in place (:func:`re_form`):
#: the first attempt's store without its prefixes.
_in_place: tuple[Any, int, int] | None = None
#: While a recovery in place runs: the first rendezvous's ``(store, rank, world_size)`` is kept.
_capture = False
_first: tuple[Any, int, int] | None = None
#: The prefix the last rendezvous through :func:`_wrap` put its store under ("" for none).
_last_prefix = ""


def begin_recovery(state: RecoveryState | None = None) -> None:
    """``BEGIN``: keep the next rendezvous's store (under ``env://``, rank 0's is the server: it outlives the group)."""
    global _capture
    _capture = True
    install(in_place=True)


def first_rendezvous() -> tuple[Any, int, int] | None:
    return _first


def forget_addresses_of_attempt(state: RecoveryState) -> None:
    """``TEAR_DOWN``, before the groups go: this rank's address keys, so that the store does not grow."""
    if state.store is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        target = dist.PrefixStore(_last_prefix, state.store) if _last_prefix else state.store
        for key in _keys(_gloo_groups(), own=True):
            target.delete_key(key)
    except Exception as err:  # noqa: BLE001 - a few keys left behind must not stop the recovery
        log(logging.DEBUG, "deleting the failed attempt's address keys: %s", err)


def re_form(state: RecoveryState) -> None:
    """``RE_FORM``: ``init_process_group`` of any scheme is given ``PrefixStore(<namespace>, state.store)``
    without connecting again (the server may live in this very process: a second one would fail)."""
    global _in_place
    _in_place = None if state.store is None else (state.store, state.rank, state.world_size)
    if state.store is not None:
        install(in_place=True)


def end_recovery(state: RecoveryState | None = None) -> None:
    global _capture, _first, _in_place
    _capture, _first, _in_place = False, None, None


def _wrap(handler):
    def per_attempt(url: str, **kwargs: Any) -> Iterator[tuple]:
        global _prefixed, _first, _last_prefix
        if _in_place is not None:
            store, rank, world_size = _in_place
            _prefixed, _last_prefix = True, attempts.namespace()
            yield dist.PrefixStore(_last_prefix, store), rank, world_size
            return
        for store, rank, world_size in handler(url, **kwargs):
            if _capture and _first is None:
                _first = (store, rank, world_size)
            _last_prefix = ""
            if _agent_store():
                _last_prefix = attempts.namespace()
                store = dist.PrefixStore(_last_prefix, store)
                _prefixed = True
            yield store, rank, world_size

    setattr(per_attempt, _WRAPPED_ATTR, True)
    per_attempt.__wrapped__ = handler  # type: ignore[attr-defined]
    return per_attempt


def install(*, in_place: bool = False) -> bool:
    """Wrap the rendezvous handlers (idempotent): under torchrun's agent store, or with ``in_place``."""
    if not (in_place or _agent_store()):
        return False
    table = _table()
    for scheme in _SCHEMES + (("file",) if in_place and "file" in table else ()):
        if not getattr(table[scheme], _WRAPPED_ATTR, False):
            table[scheme] = _wrap(table[scheme])
    if not in_place and dist.is_available() and dist.is_initialized():
        log(logging.INFO, "the process group was initialized before fault_tolerant_handlers was imported: "
            "under torchrun its keys are not isolated per attempt; each rank deletes its address keys once "
            "every peer has read them (when the session starts), so that a restarted attempt comes up")
    return True
