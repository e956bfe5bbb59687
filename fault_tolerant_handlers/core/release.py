"""Release threads blocked in collectives of this process, on any backend.

NCCL (and other backends with an abort) are aborted with ``torch.distributed``'s own abort. gloo
has no in-process abort (``ProcessGroup.abort``/``shutdown`` leave a pending gloo operation
blocked: measured), so on Linux the release shuts down this process's *established TCP connections
other than those of the c10d store*: the gloo pairs. The blocked gloo operation then fails at once
with "Connection closed", on this rank and on the peers at the other end of those connections. The
store's connections stay open, so failure records can still be read after the release.

Which sockets are cut is decided by :func:`select_sockets`, a pure function of two tables read from
``/proc`` (this process's socket fds; the established TCP connections of its network namespace) and
the store's ports: every established TCP socket of this process neither of whose ends is a store
port. It is unit-tested on made-up tables.

After a release the process groups of this process are unusable (as after an NCCL abort): it is
only done once the job is known to be failing. Other TCP connections of a failing process (an HTTP
logger, say) may be cut too; ``FTH_RELEASE=exit`` never cuts sockets and leaves a blocked rank to
the watchdog's reported exit instead.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading

import torch.distributed as dist

from . import compat_torch as _compat_torch
from . import config
from .log import log
from .config import EXIT_TEARDOWN_SEC

#: Exit code when tearing down released process groups at exit did not finish in time.
EXIT_TEARDOWN_STUCK = 89


def store_ports(store: dist.Store | None) -> set[int]:
    """The TCP port(s) of the c10d store behind ``store`` (through any PrefixStore wrappers)."""
    ports: set[int] = set()
    seen = 0
    while store is not None and seen < 16:
        port = getattr(store, "port", None)
        if isinstance(port, int) and port > 0:
            ports.add(port)
        store = getattr(store, "underlying_store", None)
        seen += 1
    env_port = os.environ.get("MASTER_PORT", "")
    if env_port.isdigit():
        ports.add(int(env_port))
    return ports


def socket_fds() -> dict[int, int]:
    """inode -> fd of this process's sockets (``/proc/self/fd``)."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(fd)
    return found


#: ``/proc/net/tcp`` states.
ESTABLISHED, LISTEN = "01", "0A"


def parse_tcp_table(text: str, state: str = ESTABLISHED) -> dict[int, tuple[int, int]]:
    """inode -> (local port, remote port) of the rows in ``state`` (ESTABLISHED by default) of a
    ``/proc/net/tcp`` table."""
    table = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10 or parts[3] != state:
            continue
        try:
            local_port = int(parts[1].rsplit(":", 1)[1], 16)
            remote_port = int(parts[2].rsplit(":", 1)[1], 16)
            table[int(parts[9])] = (local_port, remote_port)
        except (IndexError, ValueError):
            continue
    return table


def tcp_sockets(state: str = ESTABLISHED) -> dict[int, tuple[int, int]]:
    """inode -> (local port, remote port) of this network namespace's TCP sockets in ``state``."""
    table: dict[int, tuple[int, int]] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                table.update(parse_tcp_table(f.read(), state))
        except OSError:
            continue
    return table


def listens_here(port: int) -> bool:
    """This process holds a socket listening on ``port`` (it hosts the store there)."""
    if not sys.platform.startswith("linux"):
        return False
    listening = {inode for inode, (local, _) in tcp_sockets(LISTEN).items() if local == port}
    return bool(listening & set(socket_fds()))


def store_peer_address(ports: set[int]) -> str | None:
    """The address this process's connection to the store (a remote port in ``ports``) reaches:
    the store's host as the network sees it, read from the connection itself (no name lookup).
    ``None`` without such a connection (or off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    fds = socket_fds()
    for inode, (_, remote) in tcp_sockets().items():
        if remote not in ports or inode not in fds:
            continue
        try:
            dup = os.dup(fds[inode])
        except OSError:
            continue
        try:
            with socket.socket(fileno=dup) as sock:  # closes the dup only
                return str(sock.getpeername()[0])
        except OSError:
            continue
    return None


def select_sockets(fds: dict[int, int], tcp: dict[int, tuple[int, int]], keep_ports: set[int]) -> list[int]:
    """The fds to shut down: this process's established TCP sockets not on a store port."""
    chosen = []
    for inode, fd in sorted(fds.items(), key=lambda item: item[1]):
        ports = tcp.get(inode)
        if ports is None or ports[0] in keep_ports or ports[1] in keep_ports:
            continue
        chosen.append(fd)
    return chosen


def _shutdown(fds: list[int], inodes: dict[int, int]) -> int:
    """``shutdown(SHUT_RDWR)`` each socket fd (through a dup: the fd itself stays its owner's), if it
    is still the socket it was chosen as (``inodes``: fd -> inode). A socket cut before it may end
    others of its owner's (a gloo pair's error closes them) and a connect in another thread then
    gets that fd number: it must not be cut in its place (a store client's new connection, seen
    at 8 ranks: its validation read 0 bytes)."""
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


#: Sockets this process shares with the process it was forked from (a keeper's training child):
#: ``shutdown()`` acts on the socket, not the descriptor, so cutting one here would break it in the
#: other process too (the keeper's own store client, made before ``recover_in_place``). Never cut.
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
    fds = _own_socket_fds()
    return _shutdown(select_sockets(fds, tcp_sockets(), keep_ports), {fd: inode for inode, fd in fds.items()})


def cut_connections_to(ports: set[int]) -> int:
    """Shut down this process's established TCP connections *to* ``ports`` (the store's: only at
    exit, when a store call is stuck); returns how many: the complement of :func:`select_sockets`."""
    if not sys.platform.startswith("linux") or not ports:
        return 0
    fds, tcp = _own_socket_fds(), tcp_sockets()
    others = set(select_sockets(fds, tcp, ports))
    return _shutdown([fd for inode, fd in sorted(fds.items(), key=lambda i: i[1]) if inode in tcp and fd not in others],
                     {fd: inode for inode, fd in fds.items()})


_teardown_registered = False


def _teardown_after_release() -> None:
    if not dist.is_available() or not dist.is_initialized():
        return
    timer = threading.Timer(EXIT_TEARDOWN_SEC, lambda: os._exit(EXIT_TEARDOWN_STUCK))
    timer.daemon = True
    timer.start()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the groups were released on purpose; they may complain
        pass
    finally:
        timer.cancel()


def teardown_at_exit() -> None:
    """Tear the process groups down at interpreter exit (registered once, for a failing job)."""
    global _teardown_registered
    if not _teardown_registered:
        _teardown_registered = True
        atexit.register(_teardown_after_release)


def release_process_groups(store: dist.Store | None) -> str:
    """Make every pending and future collective of this process fail fast. Returns what was done."""
    if config.settings().release == "exit":
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
