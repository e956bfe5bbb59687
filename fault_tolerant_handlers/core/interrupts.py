"""Getting a main thread out of where it waits: the interrupt of a hung main thread (recovering in
place; pending until the recovery takes it (:func:`take`), held back by deferred sections; its signal
handler takes no lock), and the release of collectives blocked on a failed peer (NCCL/XCCL groups
aborted, gloo's TCP connections other than the store's shut down). docs/recovering.md has the long form."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import ContextDecorator
from datetime import timedelta
from types import CodeType, FrameType, TracebackType

import torch.distributed as dist

from . import compat_torch as _compat_torch
from . import config, hooks
from .config import EXIT_TEARDOWN_SEC
from .hooks import log
from .procfs import LISTEN, select_sockets, socket_fds, tcp_sockets

_pending: BaseException | None = None  # delivered, not yet taken by the recovery
#: The recovery took the interrupt (:func:`take`) and has not called the training function again
#: (:func:`arm`): a later interrupt has nothing to interrupt.
_taken = False
_depth = 0  # the main thread's deferred sections, nested
_deferred_at: float | None = None  # when the pending interrupt first found the main thread in one
_bound = 30.0  # seconds: how long a section may hold the interrupt back (set by install)
_signum: int | None = None  # the signal of the installed handler
_takers: frozenset[CodeType] = frozenset()  # frames that take the interrupt: never raised in them
_lock = threading.Lock()  # interrupt / uninstall against each other (never in the handler)


def _in_main_thread() -> bool:
    return threading.get_ident() == threading.main_thread().ident


def _handling(err: BaseException) -> bool:
    """The main thread handles ``err`` already: an ``except``/``finally`` clause (or one an exception
    it caused is raised in) is on its way out with it."""
    seen = sys.exc_info()[1]
    for _ in range(32):  # a chain of contexts is short; a cycle must not hang the handler
        if seen is None:
            return False
        if seen is err:
            return True
        seen = seen.__context__
    return False


class deferred_interrupt(ContextDecorator):  # noqa: N801 - used like a function: ``with deferred_interrupt():``
    """Context manager (or decorator): the interrupt of a hung main thread waits until the section ends.

    Recovering in place, a rank hung in Python is interrupted where it hangs
    (:class:`~fault_tolerant_handlers.HangInterrupted`); inside this section the interrupt is raised
    as the outermost section ends, ``FTH_INTERRUPT_DEFER_SEC`` (30 s) at most after it arrived.
    Sections nest and count in the main thread only.

    Examples:
        .. code-block:: python

            from fault_tolerant_handlers import deferred_interrupt

            with deferred_interrupt():            # a manifest and its data, both or neither
                write_shard(path, data)
                append_manifest(manifest, path)

            @deferred_interrupt()
            def upload_metrics(run, metrics): ...
    """

    def __enter__(self) -> deferred_interrupt:
        global _depth
        if _in_main_thread():
            _depth += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        global _depth
        if not _in_main_thread():
            return False
        _depth = max(0, _depth - 1)  # (a child forked inside a section starts at 0)
        err = _pending
        if _depth == 0 and err is not None and exc is not err and not _handling(err):
            log(logging.WARNING, "the interrupt of the hung main thread, held back by a deferred section, is raised "
                "now that the section ended")
            raise err
        return False


#: The section the library's own hot paths enter (its store calls): made once, reentrant.
SECTION = deferred_interrupt()


def raise_pending() -> None:
    """At an adapter's hook in the main thread: raise the pending interrupt again if user code
    swallowed it (outside a deferred section, and not while the main thread handles it already)."""
    err = _pending
    if err is None or _depth or not _in_main_thread() or _handling(err):
        return
    log(logging.WARNING, "the interrupt of the hung main thread was caught and not re-raised (an except "
        "BaseException, a bare except): raised again here")
    raise err


def deferred_until() -> float | None:
    """While a deferred section holds the interrupt back: when its bound runs out (``time.monotonic()``)."""
    since = _deferred_at
    return None if since is None or _pending is None else since + _bound


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _deferred_at
    err = _pending
    if err is None:
        return
    if frame is not None and frame.f_code in _takers:
        return  # the recovery's own frame: it takes the interrupt there
    if _handling(err):
        return  # on its way out already (an exception path, a finally)
    if _depth or (frame is not None and any(defer(frame) for defer in hooks.callbacks(hooks.DEFER))):
        now = time.monotonic()
        if _deferred_at is None:
            _deferred_at = now
            log(logging.WARNING, "the hung main thread is in a deferred section (%s): its interrupt waits until the "
                "section ends, %.0f s at most (FTH_INTERRUPT_DEFER_SEC)",
                "deferred_interrupt" if _depth else "a checkpoint write", _bound)
        if now - _deferred_at < _bound:
            return
        log(logging.ERROR, "a deferred section held the interrupt of the hung main thread back for %.0f s "
            "(FTH_INTERRUPT_DEFER_SEC): interrupted inside it", now - _deferred_at)
    raise err


def install(signum: int, bound: timedelta, takers: tuple[CodeType, ...] = ()) -> object:
    """Install the interrupt's handler for ``signum`` (main thread only); frames running one of
    ``takers`` (the recovery's) never have it raised in them. Returns what :func:`uninstall` restores."""
    global _signum, _takers, _bound
    previous = signal.signal(signum, _on_signal)
    with _lock:
        state = (_signum, _takers, _bound, previous)
        _signum, _takers, _bound = signum, frozenset(takers) | {take.__code__}, bound.total_seconds()
    _clear()
    return state


def uninstall(state: object) -> None:
    """Restore what :func:`install` replaced; a pending interrupt is dropped."""
    global _signum, _takers, _bound
    signum = _signum
    with _lock:  # no resend after this: the previous handler may be the default (it ends the process)
        _signum, _takers, _bound, previous = state  # type: ignore[misc]
    _clear()
    if signum is not None:
        signal.signal(signum, previous)


def interrupt(error: BaseException | None) -> bool:
    """From the watchdog's thread: make ``error`` the pending interrupt (unless one is; ``None``: the one
    pending) and signal the main thread. False without a handler, or once the recovery took it."""
    global _pending
    with _lock:
        if _signum is None or _taken or (_pending is None and error is None):
            return False
        if _pending is None:
            _pending = error
        signal.pthread_kill(threading.main_thread().ident, _signum)
        return True


def take() -> BaseException | None:
    """The recovery takes the interrupt, if any: none is accepted until :func:`arm`."""
    global _pending, _deferred_at, _taken
    with _lock:  # against interrupt(): after this, none is accepted (never taken in the handler)
        err, _pending, _deferred_at, _taken = _pending, None, None, True
    return err


def taken() -> bool:
    return _taken


def arm() -> None:
    """The recovery calls the training function again: an interrupt is accepted again."""
    global _taken
    with _lock:
        _taken = False


def _clear() -> None:
    global _pending, _deferred_at, _taken
    _pending, _deferred_at, _taken = None, None, False


def _after_fork_in_child() -> None:  # a child starts with nothing pending and no section open
    global _depth, _lock
    _lock = threading.Lock()
    _depth = 0
    _clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- releasing collectives ------------------------------------------------------------------------------
#: Exit code when tearing down released process groups at exit did not finish in time.
EXIT_TEARDOWN_STUCK = 89


def store_ports(store: dist.Store | None) -> set[int]:
    """The TCP port(s) of the c10d store behind ``store``."""
    ports = {p for p in (getattr(s, "port", None) for s in _compat_torch.store_chain(store)) if isinstance(p, int) and p > 0}
    env_port = os.environ.get("MASTER_PORT", "")
    if env_port.isdigit():
        ports.add(int(env_port))
    return ports


#: Inodes of the connections of released groups (:func:`cut_connections`), for :func:`quiet_released`.
_released: set[int] = set()
#: Of those, the connections (not the listeners): what :func:`release_spent` waits to see closed.
_released_connections: set[int] = set()


def _shutdown(fds: list[int], inodes: dict[int, int]) -> int:
    """``shutdown(SHUT_RDWR)`` each fd still the socket (``inodes``: fd -> inode) it was chosen as."""
    cut = 0
    for fd in fds:
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            if os.fstat(dup).st_ino != inodes.get(fd):
                os.close(dup)
                continue
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            sock.close()
    return cut


#: Sockets this process shares with its parent (a keeper's training child): never cut.
_spared: set[int] = set()


def spare_inherited_sockets() -> None:
    """In a forked child that may cut connections: the sockets it holds now are its parent's too."""
    _spared.update(socket_fds())


def _own_socket_fds() -> dict[int, int]:
    return {inode: fd for inode, fd in socket_fds().items() if inode not in _spared}


def cut_connections(keep_ports: set[int]) -> int:
    """Shut down the sockets :func:`select_sockets` chooses; returns how many."""
    if not sys.platform.startswith("linux"):
        return 0
    fds, tcp = _own_socket_fds(), tcp_sockets()
    # every connection and listener of the released groups, cut here or already closing
    released = {inode for inode, (local, remote, _) in tcp.items()
                if inode in fds and local not in keep_ports and remote not in keep_ports}
    _released.update(released)
    _released_connections.update(inode for inode in released if tcp[inode][2] != LISTEN)
    return _shutdown(select_sockets(fds, tcp, keep_ports), {fd: inode for inode, fd in fds.items()})


def cut_connections_to(ports: set[int]) -> int:
    """Shut down this process's established TCP connections on ``ports`` (the store's: only at exit,
    when a store call is stuck); returns how many."""
    if not sys.platform.startswith("linux") or not ports:
        return 0
    fds = _own_socket_fds()
    return _shutdown(select_sockets(fds, tcp_sockets(), ports, on_ports=True), {fd: inode for inode, fd in fds.items()})


def release_spent() -> bool:
    """This process's release found gloo connections (not only listeners) and every one of them is
    closed now, with no NCCL or XCCL group in the process: a collective still blocked is one its group's
    timeout alone ends (gloo does not fail a send already queued on a connection that closes)."""
    if not _released_connections or not sys.platform.startswith("linux"):
        return False
    if any(inode in _released_connections for inode in _own_socket_fds()):
        return False
    for pg in _compat_torch.process_groups():
        try:
            if dist.get_backend(pg) in ("nccl", "xccl"):
                return False
        except Exception:  # noqa: BLE001 - a group already destroyed
            continue
    return True


def quiet_released() -> int:
    """Stop destroyed gloo groups' event loops spinning on the sockets a release shut down."""
    if not _released or not sys.platform.startswith("linux"):
        return 0
    return _compat_torch.disarm_loops(_released, {fd: inode for inode, fd in _own_socket_fds().items()})


_teardown_registered = False


def destroy_process_groups(within: float) -> None:
    """Destroy every process group, released ones too; past ``within`` seconds the process ends
    (:data:`EXIT_TEARDOWN_STUCK`)."""
    if not dist.is_available() or not dist.is_initialized():
        return
    timer = threading.Timer(within, lambda: os._exit(EXIT_TEARDOWN_STUCK))
    timer.daemon = True
    timer.start()
    try:
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - released groups may complain; they are gone either way
        log(logging.DEBUG, "destroying the process groups: %s", err)
    finally:
        timer.cancel()


def teardown_at_exit() -> None:
    """Tear the process groups down at interpreter exit (registered once, for a failing job)."""
    global _teardown_registered
    if not _teardown_registered:
        _teardown_registered = True
        atexit.register(destroy_process_groups, EXIT_TEARDOWN_SEC)


def release_process_groups(store: dist.Store | None, mode: str | None = None) -> str:
    """Make every pending and future collective of this process fail fast; returns what was done."""
    if (mode or config.settings().release) == "exit":
        return "release disabled (FTH_RELEASE=exit)"
    teardown_at_exit()
    done = []
    for pg in _compat_torch.process_groups():
        try:
            backend = dist.get_backend(pg)
        except Exception:  # noqa: BLE001 - a group already destroyed
            continue
        if backend in ("nccl", "xccl"):
            try:
                _compat_torch.abort_process_group(pg)
                done.append(f"aborted {backend} group")
            except Exception as err:  # noqa: BLE001
                log(logging.ERROR, "could not abort a %s process group: %s", backend, err)
    cut = cut_connections(store_ports(store))
    if cut:
        done.append(f"closed {cut} gloo connections")
    return ", ".join(done) or "nothing to release"
