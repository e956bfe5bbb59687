"""Each rank's shard of a sharded model (FSDP2) kept in a partner's CPU memory, checksummed, so that a
rank lost with its process gets its shard back (docs/sharded.md, "Shards in a peer's memory"):
:func:`choose_partners` picks the partners, :class:`ShardReplicas` sends each ``replicate_every``-th
step's snapshot from a thread of its own and receives the copies it holds."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.hooks import log
from ..core.sharded import MAX_MANIFEST_BYTES, ManifestError, Snapshot, memory, take_snapshot

_HEADER = 6  # sent before each snapshot: format tag, rank, step, manifest bytes, payload bytes, CRC-32
_TAG = 0x46544853  # "FTHS"
_STOP = -1
#: The step of a header that says "still here" (no copy): sent to each partner after a quarter of the
#: group's timeout without a copy (a long evaluation), since a receive that times out on gloo breaks
#: the pair for good (the message it waited for is taken by the abandoned receive).
_IDLE = -2
_ACK = 1  # the tag of a holder's acknowledgement of each copy (the step it now holds, -1: refused)


def choose_partners(hosts: Sequence[str], partners: int = 1) -> list[tuple[int, ...]]:
    """For each rank (``hosts[r]`` is rank ``r``'s host), the ranks that hold a copy of its shard:
    copy ``k`` of the rank at place ``i`` on its host goes to place ``i`` of the ``k``-th next host in a
    ring over the hosts (NVIDIA's clique rule); copies beyond the other hosts go to the same host's
    ranks (logged), then to any. ``ValueError``: ``partners`` not in ``1 .. len(hosts) - 1``."""
    world = len(hosts)
    if not 1 <= partners < max(world, 2) or world < 2:
        raise ValueError(f"choose_partners(partners={partners!r}): valid 1 .. world size - 1 "
                         f"({world - 1}) with at least 2 ranks")
    order: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        order.setdefault(host, []).append(rank)
    names = list(order)
    chosen = []
    same_host = 0
    for rank, host in enumerate(hosts):
        h, local = names.index(host), order[host].index(rank)
        ring = [order[names[(h + k) % len(names)]] for k in range(1, len(names))]
        own = order[host]
        candidates = ([ranks[local % len(ranks)] for ranks in ring]
                      + [own[(local + j) % len(own)] for j in range(1, len(own))]
                      + list(range(world)))
        picked = list(dict.fromkeys(c for c in candidates if c != rank))[:partners]
        same_host += sum(hosts[p] == host for p in picked)
        chosen.append(tuple(picked))
    if same_host:
        log(logging.WARNING, "shard replicas: %d of %d copies are held on their own rank's host (%d host(s) "
            "for %d ranks, %d copy/copies each): a lost host loses those", same_host, world * partners,
            len(names), world, partners)
    return chosen


def held_by(chosen: Sequence[Sequence[int]], rank: int) -> list[int]:
    """The ranks whose copies ``rank`` holds under ``chosen`` (:func:`choose_partners`)."""
    return [r for r, ps in enumerate(chosen) if rank in ps]


@dataclass(frozen=True)
class HeldCopy:
    """What :meth:`ShardReplicas.held` reports per rank whose copy this rank holds."""

    rank: int
    step: int
    checksum_ok: bool


@dataclass
class _Stats:
    """Snapshots sent and received; ``replaced`` before they were sent; copies ``refused`` (checksum);
    steps that started ``late`` (a copy not yet held) and the seconds ``waited`` for them."""
    sent: int = 0
    received: int = 0
    replaced: int = 0
    refused: int = 0
    late: int = 0
    waited: float = 0.0
    errors: list[str] = field(default_factory=list)


class ShardReplicas:
    """Keep this rank's shard in its partners' CPU memory, and theirs in this rank's.

    Made on every rank (collective: a gloo group of its own). Call :meth:`step` after every optimizer
    step and :meth:`stop` at the end, on every rank.

    Args:
        hosts: each rank's host (``hosts[r]``); default: every rank's ``socket.gethostname()``, gathered.
        replicate_every: snapshot and send every this many steps (>= 1; default 1, every step).
        partners: copies of each shard, each on another rank (1 .. world size - 1; default 1).
        enabled: ``False``: :meth:`step` does nothing and no group or thread is made.
        timeout: bound on each send and receive of the replicas' gloo group.
        wait: bound on :meth:`wait_home` (at the start of the next step, until the copy is held);
            ``timedelta(0)``: never wait (a failure in the next step may then resume a step earlier).

    Raises:
        ValueError: a setting out of its range, naming it and the range.
    """

    def __init__(self, hosts: Sequence[str] | None = None, *, replicate_every: int = 1, partners: int = 1,
                 enabled: bool = True, timeout: timedelta = timedelta(minutes=5),
                 wait: timedelta = timedelta(seconds=5)) -> None:
        if type(replicate_every) is not int or replicate_every < 1:
            raise ValueError(f"ShardReplicas(replicate_every={replicate_every!r}): an int >= 1 (1: every step)")
        if type(partners) is not int or partners < 1:
            raise ValueError(f"ShardReplicas(partners={partners!r}): an int from 1 to the world size - 1")
        if type(enabled) is not bool:
            raise ValueError(f"ShardReplicas(enabled={enabled!r}): True or False")
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"ShardReplicas(timeout={timeout!r}): a positive timedelta")
        if not isinstance(wait, timedelta) or wait < timedelta(0):
            raise ValueError(f"ShardReplicas(wait={wait!r}): a timedelta >= 0 (0: never wait)")
        self.replicate_every, self.partners, self.enabled, self.wait = replicate_every, partners, enabled, wait
        self._idle_every = timeout.total_seconds() / 4
        self.stats = _Stats()
        self._own: Snapshot | None = None
        self._prev: Snapshot | None = None  # the one before: a copy of the newest may not have arrived
        self._held: dict[int, Snapshot] = {}
        #: per held rank, its copy of the step before: a failure may find the newest copy of a rank a step
        #: ahead of a survivor that had not yet captured that step, and both must then be at the one before
        self._held_prev: dict[int, Snapshot] = {}
        self._pending: Snapshot | None = None
        self.taken = -1  #: the step of the newest snapshot handed to step()
        self.rng: tuple | None = None  #: the RNG states handed with it
        self._home: dict[int, int] = {}  # per partner, the newest step it acknowledged holding
        #: a buffer no snapshot uses any more, for the next (see :func:`_unused`)
        self._spare: torch.Tensor | None = None
        self._cond = threading.Condition()
        self._stopping = self._sending = self._aborted = False
        self._stalled = False  # a wait ran out while this send went on: not waited for again until it ends
        self._threads: list[threading.Thread] = []
        if not enabled:
            return
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if partners >= world:
            raise ValueError(f"ShardReplicas(partners={partners}): from 1 to the world size - 1 ({world - 1})")
        if hosts is None:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, socket.gethostname())
            hosts = [str(h) for h in gathered]
        if len(hosts) != world:
            raise ValueError(f"ShardReplicas(hosts=<{len(hosts)} names>): one host per rank ({world})")
        chosen = choose_partners(hosts, partners)
        self.to = chosen[self.rank]
        self.holds = held_by(chosen, self.rank)
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        for target, name in ((self._send_loop, "send"), (self._receive_loop, "receive")):
            thread = threading.Thread(target=target, name=f"fth-shard-replicas-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def step(self, state: Any, step: int, rng: tuple | None = None) -> bool:
        """After the optimizer step ``step``: every ``replicate_every``-th step, copy ``state`` and ``rng``
        (the step's RNG states) for the sending thread, replacing one not yet sent; whether it did."""
        if not self.enabled or step % self.replicate_every:
            return False
        with self._cond:
            spare, self._spare = self._spare, None
        snap = take_snapshot(state, step, self.rank, seal=False, buffer=spare, rng=rng)
        with self._cond:
            if self._stopping:
                raise RuntimeError("ShardReplicas.step() after stop()")
            if self._pending is not None:
                self.stats.replaced += 1
                self._spare = self._pending.payload  # never handed out
            self._pending, self.taken, self.rng = snap, step, rng
            self._cond.notify_all()
        return True

    def wait_home(self) -> bool:
        """A step starts: wait (``wait`` at most) until every partner acknowledged the newest snapshot,
        so that a failure in this step finds it; ``False`` when one did not (``stats.late``, logged
        once). A send still going after a wait ran out is not waited for again until it ends."""
        if not self.enabled or not self.wait:
            return True
        start = time.monotonic()
        with self._cond:
            sent = not self._stalled and self._cond.wait_for(
                lambda: self._pending is None and not self._sending or self._stopping, self.wait.total_seconds())
            self._stalled = not sent
            missing = [p for p in self.to if self._home.get(p, -1) < self.taken]
            self.stats.waited += time.monotonic() - start
            if not missing:
                return True
            self.stats.late += 1
            first = self.stats.late == 1
        if first:
            log(logging.WARNING, "shard replicas: the copy of step %d is not held by rank(s) %s after %.1f s (%s): a "
                "failure in the step starting now resumes from an older step (logged once; counted in stats.late)",
                self.taken, ", ".join(map(str, missing)), time.monotonic() - start,
                "its send failed or was refused" if sent else "still being sent")
        return False

    def own(self) -> Snapshot | None:
        """This rank's newest sealed snapshot (checksummed, sent or being sent)."""
        with self._cond:
            return self._own

    def copy_of(self, rank: int) -> Snapshot | None:
        """The newest copy held of ``rank``'s shard (its checksum matched on arrival)."""
        with self._cond:
            return self._held.get(rank)

    def held(self, verify: bool = True) -> list[HeldCopy]:
        """(rank, step, checksum ok) of each copy held; ``verify`` recomputes each checksum now."""
        with self._cond:
            held = sorted(self._held.items())
        return [HeldCopy(r, s.step, s.verify() if verify else True) for r, s in held]

    def flush(self, timeout: timedelta = timedelta(seconds=60)) -> bool:
        """Wait until the pending snapshot is sent (for tests and the end of a run); ``False`` on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._sending,
                                       timeout.total_seconds())

    def stop(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Send what is pending, tell the partners this rank sends no more, wait for the threads
        (``timeout`` at most: a dead held rank is seen only at the group's timeout). Every rank calls it."""
        if not self.enabled or self._stopping:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout.total_seconds())
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log(logging.WARNING, "shard replicas: %s still running after %.0f s (daemon threads, left)",
                ", ".join(alive), timeout.total_seconds())
        else:
            dist.destroy_process_group(self._group)

    def abort(self) -> list[Snapshot]:
        """A failure: the threads told to stop, not waited for (their group goes with the recovery's
        teardown). Returns the snapshots held: this rank's two newest, then the two newest copies of
        each rank it holds."""
        if not self.enabled:
            return []
        with self._cond:
            self._stopping = self._aborted = True
            self._pending = None
            self._cond.notify_all()
            return [s for s in (self._prev, self._own) if s is not None] + [
                s for r, new in sorted(self._held.items()) for s in (self._held_prev.get(r), new) if s is not None]

    def _send_loop(self) -> None:
        """Seal each pending snapshot (it becomes :meth:`own`) and send it to every partner still
        reachable; one whose send failed is sent nothing more (logged once)."""
        live = list(self.to)
        idle = torch.tensor([_TAG, self.rank, _IDLE, 0, 0, 0], dtype=torch.int64)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._stopping, self._idle_every)
                snap, self._pending = self._pending, None
                self._sending = snap is not None
                stopping = self._stopping
            if self._aborted or snap is None and stopping:  # a failure: nothing more sent; or the end
                break
            if snap is None:  # no copy for a while: each partner's receive is answered before its timeout
                live = [peer for peer in live if self._send(peer, idle)]
                continue
            snap.seal()
            with self._cond:  # a step sent again (its RNG moved on) replaces its own: the step before stays
                if self._own is not None and self._own.step == snap.step:
                    old, self._own = self._own, snap
                else:
                    old, self._prev, self._own = self._prev, self._own, snap
                if _unused(old):
                    self._spare = old.payload
                del old
            header = torch.tensor([_TAG, snap.rank, snap.step, len(snap.manifest), snap.payload.numel(),
                                   snap.checksum], dtype=torch.int64)
            manifest = torch.frombuffer(bytearray(snap.manifest), dtype=torch.uint8)
            ack = torch.zeros(1, dtype=torch.int64)
            for peer in list(live):
                if not self._send(peer, header, manifest, snap.payload, ack=ack):
                    live.remove(peer)
                elif int(ack) == snap.step:
                    with self._cond:
                        self._home[peer] = snap.step
            del snap  # (no name left on the payload: see _unused)
            with self._cond:
                self.stats.sent += 1
                self._sending = self._stalled = False
                self._cond.notify_all()
        stop = torch.tensor([_TAG, self.rank, _STOP, 0, 0, 0], dtype=torch.int64)
        for peer in [] if self._aborted else live:
            self._send(peer, stop)

    def _send(self, peer: int, *tensors: torch.Tensor, ack: torch.Tensor | None = None) -> bool:
        """Send ``tensors`` to ``peer``, then receive its acknowledgement into ``ack`` (if given)."""
        try:
            for t in tensors:
                if t.numel():
                    dist.send(t, peer, group=self._group)
            if ack is not None:
                dist.recv(ack, peer, group=self._group, tag=_ACK)
            return True
        except Exception as e:  # a partner gone: training goes on; it is sent nothing more
            if self._aborted:  # the recovery took over (its group destroyed): nothing to tell
                return False
            self.stats.errors.append(f"send to rank {peer}: {type(e).__name__}: {e}")
            log(logging.WARNING, "shard replicas: sending to rank %d failed, nothing more is sent to it: %s",
                peer, e)
            return False

    def _receive_loop(self) -> None:
        waiting = set(self.holds)
        spares: dict[int, torch.Tensor] = {}  # per held rank, the buffer of a copy replaced and unused
        header = torch.zeros(_HEADER, dtype=torch.int64)
        ack: tuple[int, int] | None = None  # (to whom, the step now held; -1: refused), sent before receiving on
        while waiting:
            try:
                if ack is not None:
                    dist.send(torch.tensor([ack[1]]), ack[0], group=self._group, tag=_ACK)
                    ack = None
                src = dist.recv(header, group=self._group)  # from any rank (its global rank)
                tag, rank, step, mlen, plen, crc = header.tolist()
                if tag != _TAG or src not in waiting or rank != src or not 0 <= mlen <= MAX_MANIFEST_BYTES \
                        or plen < 0:
                    raise ManifestError(f"a malformed header from rank {src}: {header.tolist()}")
                if step == _STOP:
                    waiting.discard(src)
                    continue
                if step == _IDLE:
                    continue
                manifest = torch.empty(mlen, dtype=torch.uint8)
                spare = spares.pop(src, None)
                payload = spare if spare is not None and spare.numel() == plen else torch.empty(plen, dtype=torch.uint8)
                del spare
                dist.recv(manifest, src, group=self._group)
                if plen:
                    dist.recv(payload, src, group=self._group)
            except Exception as e:  # a held rank gone (timeout, connection closed, the group destroyed): held stays
                if self._aborted:
                    return
                self.stats.errors.append(f"receive: {type(e).__name__}: {e}")
                log(logging.WARNING, "shard replicas: receiving stopped: %s: %s", type(e).__name__, e)
                return
            snap = Snapshot(rank, step, bytes(memory(manifest)), payload, crc)
            del payload
            if not snap.verify():
                self.stats.refused += 1
                spares[rank] = snap.payload
                log(logging.WARNING, "shard replicas: the copy of rank %d at step %d does not have its checksum: "
                    "refused (the copy of step %s kept)", rank, step, getattr(self._held.get(rank), "step", None))
                ack = (src, -1)
                continue
            with self._cond:
                if self._aborted:
                    return
                old, self._held[rank] = self._held.get(rank), snap
                if old is not None and old.step != step:  # (a step sent again replaces its own copy)
                    old, self._held_prev[rank] = self._held_prev.get(rank), old
                self.stats.received += 1
                self._cond.notify_all()
            ack = (src, step)
            if _unused(old):
                spares[rank] = old.payload
            del old, snap


def _unused(snap: Snapshot | None) -> bool:
    """True if only the caller's one name refers to ``snap`` and its payload, whose buffer can then be
    written again (CPython's reference counts: the argument and the caller's name make 3)."""
    return snap is not None and sys.getrefcount(snap) <= 3 and sys.getrefcount(snap.payload) <= 2
