"""Who the ranks are (:class:`RankTable`, what probes and reporters take instead of the session) and
whether their processes run: the one ``/proc/<pid>/stat`` parser (fields after the *last* ``)``;
indices are ``man 5 proc``'s minus 3), same-host peers by pid (:class:`PeerPidProbe`), and this process's
TCP sockets (``/proc/self/fd`` and ``/proc/net/tcp``: the connections a release shuts down)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import ipaddress
import os
import re
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .failure import Ended, FailureRecord, PeerFailedError, sanitize

STATE, PPID, SESSION = 0, 1, 3
FLAGS = 6  # field 9: the kernel's flags of the (thread group leader's) task
UTIME, STIME = 11, 12  # fields 14 and 15: clock ticks run in user and in kernel mode
PF_EXITING = 0x4  # set when the process starts to exit, before its files close
START_TIME = 19  # field 22: clock ticks after boot (bench/detection.py)
EXIT_CODE = 49  # field 52: the wait status of an exited (zombie) process


def _stat(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2 :].split()


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields after ``comm`` of ``/proc/<pid>/stat`` (``pid`` also ``self/task/<tid>``); ``None`` if it is gone."""
    try:
        return _stat(pid)
    except OSError:
        return None


def is_running(fields: list[str] | None) -> bool:
    return bool(fields) and fields[STATE] not in ("Z", "X")


def cpu_ticks(fields: list[str] | None) -> int | None:
    """The CPU time the process has used, in clock ticks (user and kernel mode); ``None`` if it is gone."""
    return int(fields[UTIME]) + int(fields[STIME]) if is_running(fields) else None


def exiting(fields: list[str] | None) -> bool:
    """The process has begun to exit (``PF_EXITING``, before its files close and it is a zombie)."""
    try:
        return fields is not None and bool(int(fields[FLAGS]) & PF_EXITING)
    except (IndexError, ValueError):
        return False


def process_state(pid: int) -> Ended | None:
    """``None`` if ``pid`` runs; otherwise how it ended, as far as this host can see (``Ended()``:
    gone, its exit status not visible from this process)."""
    try:
        fields = _stat(pid)
    except FileNotFoundError:
        return Ended()
    except OSError:
        try:
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return Ended()
        except PermissionError:
            return None
    if not fields or fields[STATE] not in ("Z", "X"):
        return None
    try:
        return Ended.from_status(int(fields[EXIT_CODE]))
    except (IndexError, ValueError):
        return Ended()


def ended(pid: int, within: float) -> Ended | None:
    """How ``pid`` ended (:func:`process_state`), waiting up to ``within`` seconds while it exits."""
    deadline = time.monotonic() + within
    while True:
        how = process_state(pid)
        if how is not None:
            return how
        if not exiting(stat_fields(pid)) or time.monotonic() >= deadline:
            return None
        time.sleep(0.001)


def fd_targets() -> dict[int, str]:
    """fd -> what ``/proc/self/fd`` links it to (``socket:[123]``, ``anon_inode:[eventpoll]``)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


def socket_fds() -> dict[int, int]:
    """inode -> fd of this process's sockets."""
    return {int(target[8:-1]): fd for fd, target in fd_targets().items() if target.startswith("socket:[")}


#: ``/proc/net/tcp`` states.
ESTABLISHED, LISTEN = "01", "0A"


def parse_tcp_table(text: str) -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of the rows of a ``/proc/net/tcp`` table."""
    table = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        with contextlib.suppress(IndexError, ValueError):  # not a row
            table[int(parts[9])] = (int(parts[1].rsplit(":", 1)[1], 16), int(parts[2].rsplit(":", 1)[1], 16), parts[3])
    return table


def tcp_sockets() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of this network namespace's TCP sockets."""
    table: dict[int, tuple[int, int, str]] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            table.update(parse_tcp_table(f.read()))
    return table


def listens_here(port: int) -> bool:
    """This process holds a socket listening on ``port`` (it hosts the store there)."""
    if not sys.platform.startswith("linux"):
        return False
    fds = socket_fds()
    return any(local == port and state == LISTEN and inode in fds for inode, (local, _, state) in tcp_sockets().items())


def store_peer_address(ports: set[int]) -> str | None:
    """The address this process's connection to the store (on a port in ``ports``) reaches (Linux)."""
    linux = sys.platform.startswith("linux")
    for fd in select_sockets(socket_fds(), tcp_sockets(), ports, on_ports=True) if linux else ():
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:  # closes the dup only
            return str(sock.getpeername()[0])
    return None


def select_sockets(fds: dict[int, int], tcp: dict[int, tuple[int, int, str]], keep_ports: set[int], *,
                   on_ports: bool = False) -> list[int]:
    """The fds to shut down: this process's established TCP sockets not on a store port (``on_ports``: on one)."""
    return [fd for inode, fd in sorted(fds.items(), key=lambda item: item[1]) if inode in tcp
            and tcp[inode][2] == ESTABLISHED and on_ports == bool(keep_ports & {tcp[inode][0], tcp[inode][1]})]


#: Signals the library's own handler reports (:mod:`..launchers.signals`): a rank they end says so itself.
HANDLED_SIGNALS = ("SIGTERM", "SIGINT")


def unreported(how: Ended) -> bool:
    """A rank that ended ``how`` was killed by a signal it could not report itself (SIGKILL, a crash)."""
    return how.killed and how.signal_name not in HANDLED_SIGNALS


# -- the one probe the core runs itself ----------------------------------------------------------------
class PeerPidProbe:
    """Peers on this host, by pid: one gone is declared lost (with its signal where seen; a clean exit or
    ``left(rank)``, for one gone with no status to see, is a rank that finished first)."""

    def __init__(self, peers: Sequence[tuple[int, int]], *, by: int, host: str,
                 state: Callable[[int], Ended | None] = process_state,
                 after_failure: Callable[[], bool] = lambda: False,
                 left: Callable[[int], bool] = lambda rank: False) -> None:
        self.after_failure = after_failure  # once the job failed, peers leaving is expected
        self.left = left
        self.peers = list(peers)  # (global rank, pid)
        self.by = by
        self.host = host
        self.state = state

    def poll(self, now: float) -> PeerFailedError | None:
        for rank, pid in list(self.peers):
            state = self.state(pid)
            if state is None or state == Ended(exit_code=0):  # a clean exit: a rank that finished first
                continue
            if self.after_failure() and not state.killed:
                continue  # a peer that ended after the failure was agreed: the job is ending
            if state.unseen and self._left(rank):  # a status that shows a failure is declared, left or not
                self.peers.remove((rank, pid))
                continue
            return PeerFailedError(record=FailureRecord.lost(rank=rank, pid=pid, host=self.host, why=state, by=self.by))
        return None

    def _left(self, rank: int) -> bool:
        try:
            return self.left(rank)
        except Exception:  # noqa: BLE001 - no answer is no evidence that it left: declared as before
            return False


# -- who the ranks are ----------------------------------------------------------------------------------

def digest(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode("utf-8", "replace")).digest()[:7], "big")


#: Bytes of a host name carried in the setup table (8 int64s).
HOST_NAME_BYTES = 64
_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)")


def _interface_address(name: str) -> str | None:
    """IPv4 address of network interface ``name`` (``GLOO_SOCKET_IFNAME``), Linux only."""
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError, ValueError):
        return None


def own_address() -> str:
    """The address peers see this rank at: ``GLOO_SOCKET_IFNAME``'s, else the one reaching
    ``MASTER_ADDR``, else its name's."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        found = _interface_address(ifname)
        if found:
            return normalize_address(found)
    master = os.environ.get("MASTER_ADDR", "")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            return normalize_address(s.getsockname()[0])
    try:
        return normalize_address(socket.gethostbyname(socket.gethostname()))
    except OSError:
        return ""


def normalize_address(text: str) -> str:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return text
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def addresses_named(text: str) -> list[str]:
    """The peer addresses a backend error names (``Connection reset by peer [10.0.0.2]:4242``)."""
    return [normalize_address(m.group(1)) for m in _ADDRESS.finditer(text)]


def encode_name(name: str) -> list[int]:
    data = name.encode("utf-8", "replace")[:HOST_NAME_BYTES].ljust(HOST_NAME_BYTES, b"\0")
    return [int.from_bytes(data[i : i + 8], "big", signed=True) for i in range(0, HOST_NAME_BYTES, 8)]


def decode_name(words: list[int]) -> str:
    data = b"".join(int(w).to_bytes(8, "big", signed=True) for w in words).rstrip(b"\0")
    return sanitize(data.decode("utf-8", "replace"))


def local_layout(host_ids: list[int], group_rank: int, whole_world: bool) -> tuple[int, int]:
    """Local rank and ranks per node: the launcher's (for the world's group), else from host ids."""
    env_rank, env_size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if env_rank is not None and env_size is not None and whole_world:
        with contextlib.suppress(ValueError):
            return int(env_rank), int(env_size)
    me = host_ids[group_rank]
    same = [i for i, h in enumerate(host_ids) if h == me]
    return same.index(group_rank), len(same)


@dataclass(frozen=True)
class RankTable:
    """The members of one group as learned at setup: ``ranks`` (global, in group order), per member
    ``pids``, ``hosts``, ``host_ids``, ``address_ids`` (hashes); this process's ``rank`` and local layout."""

    rank: int
    ranks: tuple[int, ...]
    pids: tuple[int, ...]
    hosts: tuple[str, ...]
    host_ids: tuple[int, ...] = ()
    address_ids: tuple[int, ...] = ()
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        n = len(self.ranks)
        if self.rank not in self.ranks or len(self.pids) != n or len(self.hosts) != n:
            raise ValueError(f"inconsistent rank table: rank {self.rank}, ranks {self.ranks}, pids {self.pids}, "
                             f"hosts {self.hosts}")
        if not self.host_ids:  # a table built by hand: hosts are told apart by name
            object.__setattr__(self, "host_ids", tuple(digest(h) for h in self.hosts))

    @property
    def group_rank(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def host(self) -> str:
        """This rank's host name."""
        return self.hosts[self.group_rank]

    def pid_of(self, rank: int) -> int:
        return self.pids[self.ranks.index(rank)]

    def host_of(self, rank: int) -> str:
        return self.hosts[self.ranks.index(rank)]

    def same_host_peers(self) -> list[tuple[int, int]]:
        """(global rank, pid) of the other members on this host."""
        me = self.host_ids[self.group_rank]
        return [(self.ranks[i], pid) for i, (pid, host) in enumerate(zip(self.pids, self.host_ids))
                if i != self.group_rank and host == me]

    def successor(self) -> int:
        """The next member in the ring (whose heartbeat this rank's helper watches)."""
        return self.ranks[(self.group_rank + 1) % self.world_size]

    def watched(self) -> list[int]:
        """Whose heartbeat this rank's helper watches: its ring successor and, when on another host,
        every other member of that host too (a host cut off whole takes its own watchers with it)."""
        successor = self.successor()
        if successor == self.rank:
            return []
        i = self.ranks.index(successor)
        if self.host_ids[i] == self.host_ids[self.group_rank]:
            return [successor]
        n = self.world_size
        return [successor] + [self.ranks[(i + k) % n] for k in range(1, n)
                              if self.host_ids[(i + k) % n] == self.host_ids[i] and (i + k) % n != self.group_rank]

    def suspects(self, exc: BaseException) -> list[int]:
        """Global ranks at the peer address a backend error names (never this rank)."""
        wanted = {digest(a) for a in addresses_named(str(exc))}
        return [self.ranks[i] for i, a in enumerate(self.address_ids) if a in wanted and i != self.group_rank]

    def lost_record(self, rank: int, why: str) -> FailureRecord:
        """This rank declares global rank ``rank`` lost (``PeerLost``), naming its pid and host."""
        i = self.ranks.index(rank)
        return FailureRecord.lost(rank=rank, pid=self.pids[i], host=self.hosts[i], why=why, by=self.rank)


def thread_ticks(tid: int) -> int | None:
    """The CPU time thread ``tid`` of this process has used, in clock ticks; ``None`` if it is gone."""
    return cpu_ticks(stat_fields(f"self/task/{tid}"))


def main_thread_frame():
    """The main thread's innermost frame (``None`` once it ended), with the collector held off: a
    collection inside ``sys._current_frames()`` that frees a process group deadlocks (CPython 3.11)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames().get(threading.main_thread().ident)
    finally:
        if enabled:
            gc.enable()


def main_position() -> tuple[int, int] | None:
    """The main thread's innermost frame and instruction: the same twice, some time apart, is blocked in C."""
    frame = main_thread_frame()
    return None if frame is None else (id(frame), frame.f_lasti)


@contextlib.contextmanager
def collector_held():
    """The collector held off in this process while the block runs (yields whether it was enabled): a
    child forked in the block inherits it off until :func:`child_starts`."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield enabled
    finally:
        if enabled:
            gc.enable()


def child_starts(collects: bool) -> None:
    """First thing in a child forked under :func:`collector_held`: what it inherited is never collected
    (``gc.freeze()``), then its own objects are (``collects``: the parent's collector was enabled). A
    gloo process group left in a reference cycle would be destroyed by the child's first collection,
    and gloo's destructor waits there, holding the GIL, for threads a forked child does not have."""
    gc.freeze()
    if collects:
        gc.enable()


def fork() -> int:
    """``os.fork()`` whose child never collects what it inherited (:func:`child_starts`)."""
    with collector_held() as collects:
        pid = os.fork()
        if pid == 0:
            child_starts(collects)
    return pid
