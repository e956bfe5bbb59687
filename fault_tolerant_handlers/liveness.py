"""Liveness that does not depend on the GIL: a small helper process per rank (``fth-liveness``).

A rank's heartbeat must not stop when its main thread holds the GIL in a long C call, or when every
core is busy: a neighbour would then declare a healthy rank lost. So the heartbeat comes from a
helper process, forked when the watchdog starts, that every :data:`~.watchdog.HEARTBEAT_EVERY`
(0.5 s):

* ends at once when its rank's process is gone (its parent changed) or was told to stop (the pipe
  from the rank closed);
* beats ``hb/<rank>`` in the store, unless its rank is *stopped* (SIGSTOP: a frozen rank must be
  noticed by its neighbour, so it stops beating for it);
* runs the :class:`~.probes.HeartbeatProbe` on its ring successor: a successor whose counter stands
  still for ``FTH_HEARTBEAT_TIMEOUT_SEC`` (3 s) is declared lost, once, with a record the
  successor's peers' watchdogs read within a poll. Across hosts this is how a host that died or
  whose link was cut is named by the connected side.

It has its own store connection (a clone of the rank's), touches nothing else of the rank, never
runs the rank's exit hooks (``os._exit``), and is one of the rank's child processes, so the
watchdog's reported exit kills it with the DataLoader workers.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from . import _procfs, spawned
from ._log import log
from .probes import HeartbeatProbe
from .schema import Schema

if TYPE_CHECKING:
    from .session import Session

#: Timeout of the helper's store calls: a call never blocks it longer than a heartbeat or two.
HELPER_STORE_TIMEOUT = timedelta(seconds=1)


def _stopped(pid: int) -> bool:
    fields = _procfs.stat_fields(pid)
    return bool(fields) and fields[_procfs.STATE] in ("T", "t")


def _run(session: Session, schema: Schema, parent: int, stop_fd: int, period: float, limit: float) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write("fth-liveness")
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the rank; its end ends this process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    successor = session.ranks[(session.group_rank + 1) % session.world_size]
    probe = HeartbeatProbe(schema, session.rank, successor, session.pids[session.ranks.index(successor)],
                           period=period, limit=limit, host=session.hosts[session.ranks.index(successor)])
    declared = [False]
    while os.getppid() == parent:
        if not _stopped(parent):  # frozen: its neighbour must see it, so no beat
            _poll(probe, schema, declared)
        readable, _, _ = select.select([stop_fd], [], [], period)
        if readable:
            break  # the rank stopped its watchdog (or is gone: the pipe closed)
    spawned.hold_zombie(parent, session.rank, session.host)  # under mp.spawn: how a dead rank ended


def _poll(probe: HeartbeatProbe, schema: Schema, declared: list[bool]) -> None:
    """One beat and one look at the successor; declares it once when it is silent."""
    try:
        finding = probe.poll(time.monotonic())
        if finding is not None and not declared[0]:
            declared[0] = True
            if schema.claim_declaration(finding.declare.rank):
                schema.publish(finding.declare)
    except Exception:  # noqa: BLE001 - the store is unreachable: the rank's watchdog judges that
        probe.next_at = 0.0


class LivenessProcess:
    """The helper process of one rank; ``start()`` forks it, ``stop()`` ends it."""

    def __init__(self, session: Session, *, period: float, limit: float) -> None:
        self.session = session
        self.period = period
        self.limit = limit
        self.pid: int | None = None
        self._stop_w: int | None = None

    def start(self) -> LivenessProcess:
        if not sys.platform.startswith("linux"):
            return self
        # Connected before the fork, by the rank: a new connection can take seconds (a store server
        # resolving the client's name), and the helper must beat from its first period on.
        conn = self.session.connection("helper", HELPER_STORE_TIMEOUT)
        try:
            conn.store()
        except Exception as err:  # noqa: BLE001 - the helper connects by itself later
            log(logging.WARNING, "the liveness process could not connect to the store yet: %s",
                (str(err).splitlines() or [""])[0][:200])
        schema = Schema(conn, self.session.schema.world_size)
        try:
            schema.beat(self.session.rank)  # a first beat now: a rank frozen at once is still seen
        except Exception:  # noqa: BLE001
            pass
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError as err:
            os.close(read_fd)
            os.close(write_fd)
            log(logging.WARNING, "could not start the liveness process: %s", err)
            return self
        if pid == 0:  # the helper
            code = 0
            try:
                os.close(write_fd)
                _run(self.session, schema, parent, read_fd, self.period, self.limit)
            except BaseException:  # noqa: BLE001
                code = 1
            finally:
                os._exit(code)
        os.close(read_fd)
        conn.close()  # the rank's copy; the helper keeps its own
        self.pid, self._stop_w = pid, write_fd
        _children.add(pid)
        return self

    def stop(self) -> None:
        if self._stop_w is not None:
            os.close(self._stop_w)
            self._stop_w = None
        if self.pid is not None:
            # It leaves its select() at once, but may be in a store call; once the job failed (the
            # store's host may be gone) it has nothing left to do: no wait.
            deadline = time.monotonic() + (0.0 if self.session.failing else 0.5)
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                time.sleep(0.02)
            else:
                kill(self.pid)
            _children.discard(self.pid)
            self.pid = None


_children: set[int] = set()


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def kill_all() -> None:
    """For the reported exit: end every helper of this process."""
    for pid in list(_children):
        kill(pid)
    _children.clear()


__all__ = ["LivenessProcess", "kill_all"]
