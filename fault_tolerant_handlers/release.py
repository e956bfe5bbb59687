"""Release threads blocked in collectives of this process, on any backend.

NCCL (and other backends with an abort) are aborted with ``torch.distributed``'s own abort. gloo
has no in-process abort (``ProcessGroup.abort``/``shutdown`` leave a pending gloo operation
blocked), so on Linux the release shuts down this process's *established TCP connections other
than those of the c10d store*: the gloo pairs. The blocked gloo operation then fails at once with
"Connection closed", on this rank and on the peers at the other end of those connections. The
store's connections stay open, so failure records can still be read after the release.

After a release the process groups of this process are unusable (as after an NCCL abort): it is
only done once the job is known to be failing. Other TCP connections of a failing process (an
HTTP logger, say) may be cut too; set ``FTH_RELEASE=exit`` to never cut sockets and rely on the
reported exit instead.

Private API: ``torch.distributed.distributed_c10d._world.pg_map`` and
``_abort_process_group`` (checked against torch 2.13).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import socket
import sys

import torch.distributed as dist

from ._log import log

#: ``auto`` (default): abort where the backend can, cut gloo connections on Linux. ``exit``: never
#: touch the process groups; the watchdog's reported exit ends a blocked rank instead.
RELEASE_ENV = "FTH_RELEASE"
RELEASE_CHOICES = ("auto", "exit")


def release_mode() -> str:
    mode = os.environ.get(RELEASE_ENV, "auto").strip().lower() or "auto"
    if mode not in RELEASE_CHOICES:
        raise ValueError(f"{RELEASE_ENV}={mode!r}: expected one of {', '.join(RELEASE_CHOICES)}")
    return mode


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


def _socket_inodes() -> dict[int, int]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(fd)
    return found


def _established_tcp() -> dict[int, tuple[int, int]]:
    """inode -> (local port, remote port) of established TCP connections in this net namespace."""
    table = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != "01":  # 01 = ESTABLISHED
                continue
            local_port = int(parts[1].rsplit(":", 1)[1], 16)
            remote_port = int(parts[2].rsplit(":", 1)[1], 16)
            table[int(parts[9])] = (local_port, remote_port)
    return table


def cut_gloo_connections(keep_ports: set[int]) -> int:
    """Shut down this process's established TCP connections except those on ``keep_ports``."""
    if not sys.platform.startswith("linux"):
        return 0
    table = _established_tcp()
    cut = 0
    for inode, fd in _socket_inodes().items():
        ports = table.get(inode)
        if ports is None or ports[0] in keep_ports or ports[1] in keep_ports:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            sock.close()
    return cut


#: After a release, the process groups are torn down at interpreter exit while Python is still
#: alive, bounded by this many seconds; left to C++ static destruction, a gloo worker thread that
#: is still joinable can end the process with ``std::terminate`` (SIGABRT).
EXIT_TEARDOWN_SEC = 3.0
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
    """Tear the process groups down at interpreter exit (once registered, for a failing job)."""
    global _teardown_registered
    if not _teardown_registered:
        _teardown_registered = True
        atexit.register(_teardown_after_release)


#: Exit code when tearing down released process groups at exit did not finish in time.
EXIT_TEARDOWN_STUCK = 89


def release_process_groups(store: dist.Store | None) -> str:
    """Make every pending and future collective of this process fail fast. Returns what was done."""
    if release_mode() == "exit":
        return "release disabled (FTH_RELEASE=exit)"
    teardown_at_exit()
    done = []
    try:
        from torch.distributed import distributed_c10d

        groups = list(distributed_c10d._world.pg_map.keys())
    except Exception:  # noqa: BLE001 - nothing initialized, or a torch without this table
        groups = []
    for pg in groups:
        try:
            backend = dist.get_backend(pg)
        except Exception:  # noqa: BLE001
            continue
        if backend in ("nccl", "xccl"):
            try:
                from torch.distributed import distributed_c10d

                distributed_c10d._abort_process_group(pg)
                done.append(f"aborted {backend} group")
            except Exception as err:  # noqa: BLE001
                log(logging.WARNING, "could not abort a %s process group: %s", backend, err)
    cut = cut_gloo_connections(store_ports(store))
    if cut:
        done.append(f"closed {cut} gloo connections")
    return ", ".join(done) or "nothing to release"
