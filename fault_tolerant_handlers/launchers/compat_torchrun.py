"""torchrun restarts: one store namespace per attempt (torch's private rendezvous table, in one place).

**The cause of ``Gloo connectFullMesh failed ... Connection refused`` on a restarted attempt.**
torchrun's rendezvous (``--standalone`` or ``--rdzv-backend c10d``) creates one ``TCPStore`` server
in the agent for the whole job and hands it to the workers (``TORCHELASTIC_USE_AGENT_STORE=True``,
``MASTER_PORT`` is that store). A restart re-uses the same store: it is created again only when the
agent's rank changes. The workers' ``env://`` / ``tcp://`` rendezvous (``_create_c10d_store``)
connect to it *without* a per-attempt prefix (its comment assumes "a new TCPStore for every
retry"). So every key of attempt N-1 is still there in attempt N, under the same names: the
default group's (``default_pg/0/...``) and those of every ``new_group``, named by a counter
(``1/``, ``2/``, ...: Lightning's groups, this library's side group). Gloo's ``connectFullMesh``
publishes each rank's listening address under such a key and reads its peers'; a rank that reads
before its peer of *this* attempt has written gets the address of the dead process of the attempt
before, and fails with ``Connection refused`` to a port nobody listens on. Whether it happens is a
race between the ranks' start-up times: Lightning's ranks (slower imports, a second group) lose it
often, and each extra group (the side group) is one more chance to lose it.

**The fix.** Under torchrun with the agent store, the ``env`` and ``tcp`` rendezvous handlers are
wrapped so that the store they give ``init_process_group`` is
``PrefixStore("fth/attempt_<TORCHELASTIC_RESTART_COUNT>", store)``: every key of every group of
an attempt lives in that attempt's namespace, and nothing of an earlier attempt can be read.
Installed when ``fault_tolerant_handlers`` is imported (before ``init_process_group``: Lightning
calls it inside ``fit``; for your own ``init_process_group``, import the library first).
``FTH_ATTEMPT_STORE=0`` turns it off; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's own
environment is the launcher-side alternative (a new store per attempt, on a new port).

It assumes every node counts the same attempts (a fixed number of nodes): with elastic membership
(``--nnodes MIN:MAX``) a node that joins later counts from 0 and would not meet the others' prefix;
use ``FTH_ATTEMPT_STORE=0`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` there.

**Imported after ``init_process_group``.** Then this attempt's groups already wrote their keys under
torch's bare names, and the next attempt (its library imported late too) cannot be given a prefix
either: its ``connectFullMesh`` reads ``default_pg/0//cpu//0/<rank>`` whatever is there. So this
attempt's address keys must be gone before the next attempt reads them, and nothing of this attempt
may touch the store once the next attempt started.

Deleting them on the way out (once the job failed: the core's ``JOB_FAILED``) missed keys, and its
timing was not its own:

* a destroyed group's keys stay in the store, and a group no longer in ``_world.pg_map`` was not
  deleted: Ignite's ``idist`` makes a gloo group on its first use (``_compute_nproc_per_node``:
  ``new_group``, one ``all_reduce``, ``destroy_process_group``; a ``Checkpoint``/``DiskSaver`` is
  enough), so group ``1``'s keys of attempt 0 were still there when attempt 1's ``idist`` made its
  group ``1`` under the same names (torch's group counter starts again in every process): its
  ``connectFullMesh`` read a dead peer's address, ``Connection refused`` (or, when the kernel had
  given that port to a listener of the new attempt, a handshake with the wrong process that hangs
  until the group's timeout);
* torchrun's agent ends the survivors with ``SIGTERM`` as soon as it sees one worker fail (every
  ``--monitor-interval``, 0.1 s by default), and a survivor ended before its watchdog found the
  failure deletes nothing; a SIGKILLed rank never does; the failing rank's own deletion ran on the
  failure path with its 1 s store budget.

**The fix: the keys go while the attempt is healthy.** A gloo address key is read only while its
group is made (every peer reads it in ``connectFullMesh``, before its constructor returns). When a
session starts, its side group has just completed an ``all_gather``, which no peer enters before it
made every group made before the side group (torch makes groups in the same order on every rank,
members or not). So at ``SESSION_STARTED`` every peer has read every key of those groups, and each
rank deletes its share (:func:`read_keys`: its own key of each live group; when the session spans
the world, key ``<its rank>`` of every counted group not live here, the destroyed ones included:
together every key of every group made so far), with ordinary store calls in a thread of its own
(``fth-attempt-keys``: the main thread makes no store connection, which stalled the start of 8
ranks on a busy store), nothing on the failure path. A rank SIGKILLed in the moment before that
thread ran leaves its keys; a failure before it ran in a live rank deletes them on the way out. From then on the attempt leaves nothing the next one could read, and nothing of it deletes or
writes a key the next attempt uses, whenever and on whichever host its processes die. Only the keys
of a group made *after* the session started are still deleted on ``JOB_FAILED``, as before
(:func:`forget_attempt_keys`, best effort: on one host torchrun's agent restarts only once every
local worker exited, which orders it; a group made before ``idist``'s first use inside the loop
is such a group).

Private API: ``torch.distributed.rendezvous._rendezvous_handlers`` (the scheme -> handler table that
``init_process_group`` consults at each call), checked against torch 2.13.0; the names gloo's
address keys have in the store (:func:`address_key_of`, from ``_world.pg_map``, ``_world.pg_names``
and ``_world.group_count``), checked at start against this rank's own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ..core import attempts, config
from ..core.config import ATTEMPT_KEYS_PATIENCE, ATTEMPT_KEYS_WAIT, EXPLAIN_EVIDENCE_TIMEOUT, MAIN_STORE_TIMEOUT
from ..core.hooks import first_line, log
from ..core.phases import RecoveryState

if TYPE_CHECKING:
    from ..core.schema import Connection
    from ..core.session import Session

_WRAPPED_ATTR = "_fth_attempt_wrapped"
_SCHEMES = ("env", "tcp")


def attempt() -> int:
    return attempts.restart()


def prefix() -> str:
    """This attempt's namespace (:func:`..core.attempts.namespace`: torchrun's restart, and the
    recoveries in place)."""
    return attempts.namespace()


def _needed() -> bool:
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and config.settings().attempt_store)


def _table() -> dict:
    import importlib

    try:  # the module (``torch.distributed.rendezvous`` the attribute is a function of the same name)
        rendezvous = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:  # torch built without distributed
        return {}
    table = getattr(rendezvous, "_rendezvous_handlers", None)
    missing = [s for s in _SCHEMES if not isinstance(table, dict) or s not in table]
    if missing:
        raise RuntimeError(
            "fault_tolerant_handlers: torch.distributed.rendezvous._rendezvous_handlers "
            f"{'is missing' if not isinstance(table, dict) else 'has no handler for ' + ', '.join(missing)} "
            f"(torch {__import__('torch').__version__}); restarts under torchrun cannot be isolated per attempt. "
            f"Set {config.ATTEMPT_STORE_ENV}=0 to go on without it, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun"
        )
    return table


#: The process group was made through :func:`_wrap`'s handler: its keys are in the attempt's namespace.
_prefixed = False


def shared_keys_left() -> bool:
    """Under torchrun's shared store, this attempt's groups wrote their keys under torch's bare
    names (the library was imported after ``init_process_group``): the next attempt would read them."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and config.settings().attempt_store
            and not _prefixed)


def address_key_of(rank: int, group: str | None = None) -> str:
    """The key under which gloo context 0 of a group published ``rank``'s address (torch 2.13): the
    default group's ``default_pg/0//cpu//0/<rank>``, group ``N``'s ``default_pg/0//N//cpu//0/<rank>``."""
    return f"default_pg/0//{'' if group is None else group + '//'}cpu//0/{rank}"


def _gloo_groups() -> list[tuple[Any, str | None]]:
    """``(group, name)`` of every gloo group of this process (private: ``_world.pg_map`` and
    ``_world.pg_names``; ``None`` names the default group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    default = distributed_c10d._get_default_group()
    groups = []
    for pg in list(world.pg_map):
        try:
            if dist.get_backend(pg) == "gloo":
                groups.append((pg, None if pg is default else world.pg_names[pg]))
        except Exception:  # noqa: BLE001 - a group being destroyed
            continue
    return groups


def _keys(groups: list[tuple[Any, str | None]], *, own: bool) -> list[str]:
    keys = []
    for pg, name in groups:
        try:
            keys += [address_key_of(r, name) for r in ((pg.rank(),) if own else range(pg.size()))]
        except Exception:  # noqa: BLE001 - a group being destroyed
            continue
    return keys


def address_keys(*, own: bool = False) -> list[str]:
    """Every gloo address key of this process's groups; with ``own``, only this rank's (its rank in
    each group)."""
    return _keys(_gloo_groups(), own=own)


def group_count() -> int:
    """How many groups this process made with a counted name (private: ``_world.group_count``, the
    counter behind the names ``0`` (the default group), ``1``, ``2``...; destroying a group does not
    give its number back, nor delete its keys)."""
    from torch.distributed import distributed_c10d

    return int(distributed_c10d._world.group_count)


def counted_keys(first: int, last: int, ranks: range) -> list[str]:
    """The gloo address keys of ``ranks`` in the groups numbered ``first`` to ``last - 1`` (live or
    destroyed: a destroyed group, such as the one Ignite's ``idist`` makes and destroys to count the
    ranks of a node, leaves its keys)."""
    return [address_key_of(r, None if n == 0 else str(n)) for n in range(first, last) for r in ranks]


def forget_addresses(call: Callable[..., Any], keys: list[str]) -> int:
    """Delete ``keys``; ``call(method, *args)`` is a store call on a client without a prefix. Returns
    how many were there. (Named one by one: listing the store's keys holds the GIL for the whole call
    in torch 2.13, which freezes the process when the store does not answer.)"""
    return sum(bool(call("delete_key", key)) for key in keys)


def read_keys(session: Session) -> tuple[list[str], set[str | None], int]:
    """The gloo address keys this rank deletes when ``session`` starts, all read by every peer by then
    (the side group's all_gather, which a peer enters only after it made every group made before the
    side group), the names of the live groups and the group count they cover. This rank's own key of each live group whose ranks are
    all the session's; when the session spans the world, also key ``<global rank>`` of every counted
    group not live here (destroyed, or one this rank is not in): over the ranks, every key of every
    group made so far. (Each rank its own: a rank checks its own key before it deletes, and a peer
    deleting it would make the check fail.)"""
    import torch.distributed as dist

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
            keys.append(address_key_of(pg.rank(), name))
    if len(members) == dist.get_world_size():
        keys += [key for n in range(count) if (None if n == 0 else str(n)) not in live
                 for key in counted_keys(n, n + 1, range(session.rank, session.rank + 1))]
    return keys, live, count


class _AttemptKeys:
    """What :func:`forget_attempt_keys` uses for one session: a connection without a prefix (``None``
    once used), a lock held while deleting, and what went when the session started: the live groups'
    names and the group count."""

    def __init__(self, conn: Connection, done: set[str | None], count: int) -> None:
        self.conn: Connection | None = conn
        self.lock = threading.Lock()
        self.done = done
        self.count = count

    def later(self, world_size: int) -> list[str]:
        """The address keys of the groups made since: every rank's (a destroyed group is not known
        any more, and its members are not either)."""
        keys = counted_keys(self.count, group_count(), range(world_size))
        return keys + [key for pg, name in _gloo_groups() if name not in self.done and not (
            name is not None and name.isdigit() and int(name) >= self.count) for key in _keys([(pg, name)], own=False)]


_attempt_keys: weakref.WeakKeyDictionary[Session, _AttemptKeys] = weakref.WeakKeyDictionary()


def check_address_keys(session: Session, conn: Connection) -> bool:
    """This rank's own gloo address key is where this module expects it: True; not there: False, and a
    warning (a store call that fails raises)."""
    import torch

    key = address_key_of(session.rank)
    if conn.call("check", [key]):
        return True
    log(logging.WARNING, "fault_tolerant_handlers was imported after init_process_group under torchrun, and "
        "this attempt's gloo address keys cannot be found (no key %r in the store, torch %s): a restarted attempt "
        "may fail in gloo's connectFullMesh; import fault_tolerant_handlers before init_process_group",
        key, torch.__version__)
    return False


def forget_attempt_keys(session: Session) -> None:
    """The job failed: delete the gloo address keys of the groups made after ``session`` started
    from torchrun's shared store (once; those made before went when it started: :func:`on_session_started`),
    so that the next attempt never reads them (only when the library was imported after
    ``init_process_group``; otherwise each attempt has a namespace of its own)."""
    keys = _attempt_keys.get(session)
    if keys is None:
        return
    # Held while deleting: a second caller (the main thread taking the failure, while the
    # watchdog deletes) waits until the keys are gone, so that its exit never cuts it short.
    with keys.lock:
        conn, keys.conn = keys.conn, None
        if conn is None:
            return
        try:
            later = keys.later(session.world_size)
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
            log(logging.WARNING, "could not delete the gloo address keys of later groups: %s",
                first_line(err))
        finally:
            conn.close()


# -- what this module does on the core's events (subscribed in ``launchers/__init__.py``) -------------
def on_session_started(session: Session) -> None:
    """Under torchrun with the library imported after init_process_group: every peer has read the
    gloo address keys of the groups made so far (the side group's all_gather just passed), so they go
    now, while the attempt is healthy (:func:`read_keys`), in a thread of their own (``fth-attempt-keys``:
    the main thread makes no store connection, which at 8 ranks on a busy store stalled the start); the
    connection is kept for the groups made later (``JOB_FAILED``: :func:`forget_attempt_keys`, which
    deletes every key when it comes before the thread did)."""
    if not (shared_keys_left() and session.store_address is not None):
        return
    keys, names, upto = read_keys(session)  # no store call: torch's group table
    conn = session.connection("attempt-keys", MAIN_STORE_TIMEOUT, prefix="", backoff=True)
    entry = _AttemptKeys(conn, set(), 1)  # until the thread deleted them, all go on the way out
    _attempt_keys[session] = entry
    threading.Thread(target=_forget_read_keys, args=(session, entry, keys, names, upto), name="fth-attempt-keys",
                     daemon=True).start()


def _forget_read_keys(session: Session, entry: _AttemptKeys, keys: list[str], names: set[str | None],
                      upto: int) -> None:
    # Tries of ATTEMPT_KEYS_WAIT each, under the lock (the way out, forget_attempt_keys, waits for one
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
                if not checked and not check_address_keys(session, conn):
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


def on_session_closed(session: Session) -> None:
    keys = _attempt_keys.pop(session, None)
    if keys is not None:
        with keys.lock:
            conn, keys.conn = keys.conn, None
        if conn is not None:
            conn.close()


#: ``(store, rank, world_size)`` the rendezvous gives every attempt after a recovery in place
#: (:func:`rendezvous_in_place`): the first attempt's store without its prefixes.
_in_place: tuple[Any, int, int] | None = None


#: Recovering in place: the first rendezvous's ``(store, rank, world_size)`` is kept (:func:`first_rendezvous`).
_capture = False
_first: tuple[Any, int, int] | None = None


def capture_rendezvous() -> None:
    """Keep the next rendezvous's store (recovering in place re-forms the group over it; under
    ``env://`` without torchrun, rank 0's copy is the store's server, which must outlive the group)."""
    global _capture
    _capture = True
    install(in_place=True)


def release_rendezvous() -> None:
    """The recovery is over: forget the first rendezvous's store (and stop keeping the next one)."""
    global _capture, _first, _in_place
    _capture, _first, _in_place = False, None, None


def first_rendezvous() -> tuple[Any, int, int] | None:
    """``(store, rank, world_size)`` of the first rendezvous since :func:`capture_rendezvous`."""
    return _first


#: The prefix the last rendezvous through :func:`_wrap` put its store under ("" for none).
_last_prefix = ""


def forget_own_addresses(store: Any) -> int:
    """Recovering in place, before the failed attempt's groups are destroyed: delete this rank's gloo
    address keys of every group from ``store`` (the rendezvous's own), under the prefix they were
    written with, so that the store does not grow by an attempt's keys at each recovery."""
    import torch.distributed as dist

    target = dist.PrefixStore(_last_prefix, store) if _last_prefix else store
    return sum(bool(target.delete_key(key)) for key in address_keys(own=True))


def rendezvous_in_place(store: Any | None, rank: int = -1, world_size: int = -1) -> None:
    """From now on, ``init_process_group`` of any scheme (``env``, ``tcp``, ``file``) is given
    ``PrefixStore(<this attempt's namespace>, store)`` with ``rank`` and ``world_size``, without
    connecting again: recovering in place re-forms the group over the store of the first attempt
    (whose server may live in this very process: a second one on its port would fail). ``None``
    goes back to torch's own rendezvous."""
    global _in_place
    _in_place = None if store is None else (store, rank, world_size)
    if store is not None:
        install(in_place=True)


def _wrap(handler):
    def per_attempt(url: str, **kwargs: Any) -> Iterator[tuple]:
        import torch.distributed as dist

        global _prefixed, _first, _last_prefix
        if _in_place is not None:
            store, rank, world_size = _in_place
            _prefixed, _last_prefix = True, prefix()
            yield dist.PrefixStore(_last_prefix, store), rank, world_size
            return
        for store, rank, world_size in handler(url, **kwargs):
            if _capture and _first is None:
                _first = (store, rank, world_size)
            _last_prefix = ""
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and config.settings().attempt_store:
                _last_prefix = prefix()
                store = dist.PrefixStore(_last_prefix, store)
                _prefixed = True
            yield store, rank, world_size

    setattr(per_attempt, _WRAPPED_ATTR, True)
    per_attempt.__wrapped__ = handler  # type: ignore[attr-defined]
    return per_attempt


def install(*, in_place: bool = False) -> bool:
    """Wrap the rendezvous handlers (idempotent). True when installed: under torchrun's agent store
    (``env``, ``tcp``), and, with ``in_place``, for recovering in place (``file`` too) under any launcher."""
    if not (in_place or _needed()):
        return False
    table = _table()
    if not table:
        return False
    for scheme in _SCHEMES + (("file",) if in_place and "file" in table else ()):
        if not getattr(table[scheme], _WRAPPED_ATTR, False):
            table[scheme] = _wrap(table[scheme])
    import torch.distributed as dist

    if not in_place and dist.is_available() and dist.is_initialized():
        log(logging.INFO, "the process group was initialized before fault_tolerant_handlers was imported: "
            "under torchrun its keys are not isolated per attempt; each rank deletes its address keys once "
            "every peer has read them (when the session starts), so that a restarted attempt comes up")
    return True


# -- the launchers' steps of a recovery in place (registered in launchers/__init__.py) ----------------------
def begin_recovery(state: RecoveryState) -> None:
    """``BEGIN``: keep the first rendezvous's store."""
    capture_rendezvous()


def forget_addresses_of_attempt(state: RecoveryState) -> None:
    """``TEAR_DOWN``, before the groups go (their names are read from them): this rank's address keys."""
    import torch.distributed as dist

    if state.store is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        forget_own_addresses(state.store)
    except Exception as err:  # noqa: BLE001 - a few keys left behind must not stop the recovery
        log(logging.DEBUG, "deleting the failed attempt's address keys: %s", err)


def re_form(state: RecoveryState) -> None:
    """``RE_FORM``: the next ``init_process_group`` is given ``state.store`` under the new namespace."""
    rendezvous_in_place(state.store, state.rank, state.world_size)


def end_recovery(state: RecoveryState) -> None:
    """``END``: forget the first rendezvous's store."""
    release_rendezvous()
