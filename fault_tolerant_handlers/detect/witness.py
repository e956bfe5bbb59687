"""A second witness of a silent rank on another host: that host's kernel (``docs/multiple-hosts.md``).
A helper watching a rank on another host sends one byte every ``WITNESS_EVERY`` to that rank's
helper's listener (``wit/<rank>``); its kernel acknowledges each byte whatever its processes do, so
nothing acknowledged for ``FTH_UNACKED_SEC`` is evidence that the host or its link is down.
"""

from __future__ import annotations

import errno
import fcntl
import select
import socket
import struct
import termios
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from ..core.config import WITNESS_RETRY
from ..core.failure import Stored
from ..core.schema import Schema, witness_key

#: Linux ioctls on a TCP socket: the bytes not yet acknowledged (sent or not), those not yet sent.
SIOCOUTQ = termios.TIOCOUTQ
SIOCOUTQNSD = 0x894B
#: Bytes a link keeps unacknowledged at most: past it, nothing more is sent until an answer comes.
MAX_UNACKED = 64


@dataclass(frozen=True)
class Address(Stored):
    """Where a rank's liveness helper accepts its watchers' connections."""

    address: str
    port: int

    BOUNDS: ClassVar[dict] = {"address": 64, "port": (1, 65535)}


class Listener:
    """The helper's listening socket; :meth:`drain` discards its watchers' bytes so that its buffers never fill."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.bind((address, 0))
            self.sock.listen(64)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.address = Address(address, self.sock.getsockname()[1])
        self.peers: list[socket.socket] = []

    def publish(self, schema: Schema, rank: int) -> None:
        schema.conn.call("set", witness_key(rank), self.address.to_json())

    def drain(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # none waiting (or the socket closed)
                break
            conn.setblocking(False)
            self.peers.append(conn)
        for conn in list(self.peers):
            try:
                if conn.recv(4096):
                    continue
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            conn.close()  # the watcher closed it (or it broke)
            self.peers.remove(conn)


class Link:
    """This helper's connection to a watched rank's :class:`Listener`: :meth:`unacked_for` says how long
    the oldest byte that went out has waited for its acknowledgement (from when it was seen gone out: a
    byte this host could not send is not waiting yet). A link that cannot connect, or breaks,
    witnesses nothing (``unacked_for`` 0)."""

    def __init__(self, schema: Schema, rank: int) -> None:
        self.schema = schema
        self.rank = rank
        self.sock: socket.socket | None = None
        self.connected = False
        self.retry_at = 0.0  # the next look for its address, while there is no socket
        #: per byte not known acknowledged, oldest first: when it was seen gone out (None: not yet)
        self.sent: deque[float | None] = deque()

    def ready(self, now: float) -> None:
        """Connect (its address looked up at most every :data:`WITNESS_RETRY`: its helper may be replaced)."""
        if self.sock is not None:
            self._settle()
            return
        if now < self.retry_at:
            return
        self.retry_at = now + WITNESS_RETRY.total_seconds()
        key = witness_key(self.rank)
        if not self.schema.conn.call("check", [key]):
            return  # its helper published none before its first beat: it has no listener
        found = Address.from_json(self.schema.conn.call("get", key), self.schema.world_size, key=key)
        if found is None:
            return
        self.sock = socket.socket(socket.AF_INET6 if ":" in found.address else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setblocking(False)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each byte its own segment, at once
        if self.sock.connect_ex((found.address, found.port)) not in (0, errno.EINPROGRESS):
            self.close()

    def _settle(self) -> None:  # a connect under way that completed (or failed) since
        if self.sock is None or self.connected:
            return
        try:
            _, writable, _ = select.select([], [self.sock], [], 0)
            if writable:
                if self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    self.close()
                else:
                    self.connected = True
        except (OSError, ValueError):
            self.close()

    def send(self, now: float) -> None:
        self._settle()
        if not self.connected or len(self.sent) >= MAX_UNACKED:
            return
        try:
            if self.sock.send(b"\0"):
                self.sent.append(None)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # reset: its helper is gone, its host is not (that is the pid's and the heartbeat's)
            self.close()
            return
        self._look(now)

    def unacked_for(self, now: float) -> float:
        out = self._look(now)
        return now - self.sent[0] if out > 0 and self.sent else 0.0

    def _look(self, now: float) -> int:
        """The kernel's counts: bytes acknowledged leave :attr:`sent`, bytes gone out are marked
        ``now`` if they were not yet. Returns how many are out and not acknowledged."""
        if not self.connected:
            return 0
        try:
            queued = _ioctl(self.sock, SIOCOUTQ)
            out = queued - _ioctl(self.sock, SIOCOUTQNSD)
        except OSError:
            self.close()
            return 0
        while len(self.sent) > queued:
            self.sent.popleft()  # acknowledged
        for i in range(min(out, len(self.sent))):
            if self.sent[i] is None:
                self.sent[i] = now
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock, self.connected = None, False
        self.sent.clear()


def _ioctl(sock: socket.socket, request: int) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0\0\0\0"))[0]
