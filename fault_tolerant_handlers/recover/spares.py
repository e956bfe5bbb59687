"""Spare ranks (``docs/recovering.md``, "Spares"): under torchrun the last ``k`` launched ranks wait for
an :class:`Order` to ``take`` the seat of a training rank lost with no keeper (and join the recovery the
survivors wait in, as a keeper's replacement does), or to ``end``. The first survivor to reach such a
recovery claims the next spare (:class:`Claims`) and publishes the :class:`Answer` the others read.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar

import torch.distributed as dist

from ..core import attempts, compat_torch, config
from ..core.config import RECOVER_TELL_SEC
from ..core.errors import RecoveryError
from ..core.failure import WORLD, FailureRecord, Stored, cap_head, host_name
from ..core.hooks import first_line, log
from ..core.schema import (Bounded, Connection, agreement_key, answer_key, claim_key, keeper_key, order_key,
                           seat_key, taken_key)

TAKE = "take"
END = "end"

_left: int | None = None  # spares left, as this process last learned it (None: no spares in this job)


def spares_left() -> int | None:
    """How many spares are left, as this process last learned it: ``k`` at the start of
    ``recover_in_place(fn, spares=k)``, one less at each recovery a spare took a place; ``None`` without."""
    return _left


def learned(count: int | None) -> None:
    global _left
    _left = count


def check_spares(spares: Any) -> int:
    """``spares`` as given to ``recover_in_place`` (its upper bound: :func:`layout`)."""
    is_int = isinstance(spares, int) and not isinstance(spares, bool)
    if not is_int or spares < 0:
        raise (ValueError if is_int else TypeError)(f"recover_in_place(spares=...) must be an int from 0 to the "
                                                    f"launched world size - 1 (0: no spares), got {spares!r}")
    return spares


@dataclass(frozen=True)
class Layout:
    """Which launched rank this process is, and which ranks train: the last ``spares`` are spares."""

    launched_world: int
    spares: int
    launched_rank: int
    local_rank: int | None = None  #: torchrun's LOCAL_RANK (None: not set)
    local_world: int | None = None  #: torchrun's LOCAL_WORLD_SIZE (None: not set)

    @property
    def training_world(self) -> int:
        return self.launched_world - self.spares

    @property
    def is_spare(self) -> bool:
        return self.launched_rank >= self.training_world

    def spare_rank(self, taken: int) -> int:
        return self.training_world + taken - 1

    def training_local_world(self) -> int | None:
        """How many training ranks share this host (torchrun numbers a host's ranks contiguously)."""
        if self.local_rank is None or self.local_world is None:
            return None
        first = self.launched_rank - self.local_rank
        return max(0, min(first + self.local_world, self.training_world) - first)


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else None


def layout(spares: int) -> Layout:
    """This process's place in the launched world (torchrun's environment), ``spares`` checked against it."""
    world, rank = _int_env("WORLD_SIZE"), _int_env("RANK")
    if not attempts.under_torchrun() or world is None or rank is None \
            or not os.environ.get("MASTER_ADDR") or _int_env("MASTER_PORT") is None:
        raise RecoveryError(
            f"recover_in_place(spares={spares}) needs torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set and "
            "TORCHELASTIC_USE_AGENT_STORE=True): the spares wait on the store of torchrun's agent, which outlives "
            "any rank; use spares=0 under another launcher")
    if not 0 <= spares < world:
        raise ValueError(f"recover_in_place(spares={spares}): the job was launched with {world} ranks "
                         f"(WORLD_SIZE={world}), so spares must be from 0 to {world - 1} (at least 1 rank trains)")
    return Layout(world, spares, rank, _int_env("LOCAL_RANK"), _int_env("LOCAL_WORLD_SIZE"))


def enter_training_world(lay: Layout) -> None:
    """A training rank at start: its environment names the training world."""
    os.environ["RANK"] = str(lay.launched_rank)
    os.environ["WORLD_SIZE"] = str(lay.training_world)
    if "ROLE_WORLD_SIZE" in os.environ:  # torchrun's one role: the same as the world
        os.environ["ROLE_WORLD_SIZE"] = str(lay.training_world)
    local = lay.training_local_world()
    if local is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
    learned(lay.spares)


@dataclass(frozen=True)
class Seat(Stored):
    """The process holding a training rank (local names as training, -1: not set)."""

    launched: int
    host: str
    local_rank: int = -1
    local_world: int = -1

    BOUNDS: ClassVar[dict] = {"launched": (0, WORLD), "host": 200, "local_rank": (-1, WORLD), "local_world": (-1, 2**31 - 1)}

    def problem(self, world: int) -> str | None:
        return f"local_world {self.local_world} is over {world}" if self.local_world > world else None

    def describe(self) -> str:
        return f"launched rank {self.launched} on host {self.host}"


@dataclass(frozen=True)
class Order(Stored):
    """What a waiting spare is told: ``take`` training rank ``rank`` at recovery ``attempt`` (``since``:
    when the failure reached the claimer, wall clock), or ``end`` (``ok``: the training ended)."""

    kind: str
    why: str
    rank: int = -1
    attempt: int = -1
    since: float = 0.0
    left: int = 0
    lost: str = ""  #: the lost rank's seat, described ("" when unknown)
    ok: bool = False
    lost_host: str = ""  #: the lost rank's host ("" when unknown)
    lost_local_rank: int = -1  #: its LOCAL_RANK (-1: unknown)
    lost_local_world: int = -1  #: its LOCAL_WORLD_SIZE (-1: unknown)

    BOUNDS: ClassVar[dict] = {"kind": 10, "why": 500, "rank": (-1, WORLD), "attempt": (-1, 2**31 - 1),
                              "since": (0.0, 1e13), "left": (0, 2**31 - 1), "lost": 300, "lost_host": 200,
                              "lost_local_rank": (-1, 2**31 - 1), "lost_local_world": (-1, 2**31 - 1)}

    def problem(self, world: int) -> str | None:
        if self.kind == END or (self.kind == TAKE and self.rank >= 0 and self.attempt >= 0):
            return None
        return f"an order of kind {self.kind!r} for rank {self.rank} at recovery {self.attempt}"


@dataclass(frozen=True)
class Answer(Stored):
    """Which spare replaces a lost rank (``spare``: its launched rank; -1: none left) and how many are left."""

    spare: int
    left: int

    BOUNDS: ClassVar[dict] = {"spare": (-1, WORLD), "left": (0, 2**31 - 1)}


# -- the protocol ------------------------------------------------------------------------------------
def write_seat(store: Any, rank: int, launched_rank: int) -> None:
    """This process holds training rank ``rank`` (its local names as its environment says now)."""
    local_rank, local_world = _int_env("LOCAL_RANK"), _int_env("LOCAL_WORLD_SIZE")
    store.set(seat_key(rank), Seat(launched_rank, host_name(), -1 if local_rank is None else local_rank,
                                   -1 if local_world is None else local_world).to_json())


def claim(store: Any, lay: Layout, rank: int, gen: int, why: str, since: float, wait: timedelta) -> Answer:
    """The first survivor to come orders the next spare to take lost ``rank`` at recovery ``gen``; every
    survivor returns the same :class:`Answer`."""
    if store.add(claim_key(gen, rank), 1) == 1:
        taken = store.add(taken_key(), 1)
        if taken > lay.spares:
            answer = Answer(-1, 0)
        else:
            answer = Answer(lay.spare_rank(taken), lay.spares - taken)
            raw = store.get(seat_key(rank)) if store.check([seat_key(rank)]) else None
            seat = Seat.from_json(raw, lay.launched_world)
            store.set(order_key(answer.spare), Order(
                TAKE, why, rank, gen, since, answer.left, seat.describe() if seat else "",
                lost_host=seat.host if seat else "", lost_local_rank=seat.local_rank if seat else -1,
                lost_local_world=seat.local_world if seat else -1).to_json())
        store.set(answer_key(gen, rank), answer.to_json())
    else:
        store.wait([answer_key(gen, rank)], wait)
        answer = Answer.from_json(store.get(answer_key(gen, rank)), lay.launched_world) or Answer(-1, 0)
    learned(answer.left)
    return answer


def left_after(store: Any, lay: Layout) -> int:
    """How many spares are left, as the store counts the ones taken (rank 0, deciding a recovery)."""
    taken = int(store.add(taken_key(), 0)) if store.check([taken_key()]) else 0
    return max(0, lay.spares - max(0, taken))


def wait_for_order(store: Any, lay: Layout, launched_rank: int, *, end_only: bool = False) -> Order:
    """This launched rank's order (waits of ``FTH_SPARE_WAIT_SEC`` each); a store that fails: :class:`RecoveryError`.
    ``end_only``: the job's end only (a spare whose seat was lost in turn: the order that gave it the seat
    is still under its key, read again every ``END_POLL`` until the end replaces it)."""
    chunk = config.settings().spare_wait
    key = order_key(launched_rank)
    while True:
        try:
            store.wait([key], chunk)
        except Exception as err:  # noqa: BLE001 - a timeout is the usual case; anything else is the store
            if isinstance(err, dist.DistStoreError) and "timeout" in str(err).lower():
                continue
            raise RecoveryError(f"launched rank {launched_rank} (a spare) lost torchrun's store while waiting: "
                                f"{type(err).__name__}: {first_line(err)}") from err
        order = Order.from_json(store.get(key), lay.training_world)
        if order is None:
            raise RecoveryError(f"launched rank {launched_rank} (a spare) read an order it cannot understand")
        if end_only and order.kind != END:
            time.sleep(config.END_POLL)
            continue
        return order


def take_seat(lay: Layout, order: Order) -> None:
    """A spare taking training rank ``order.rank``: its environment names that rank; on the lost rank's
    host, its ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` too (the device the lost process left)."""
    os.environ["RANK"] = str(order.rank)
    os.environ["WORLD_SIZE"] = str(lay.training_world)
    for name, value in (("ROLE_RANK", order.rank), ("ROLE_WORLD_SIZE", lay.training_world)):
        if name in os.environ:  # torchrun's one role: the same as the world
            os.environ[name] = str(value)
    if order.lost_host and order.lost_host == host_name() and order.lost_local_rank >= 0:
        os.environ["LOCAL_RANK"] = str(order.lost_local_rank)
        if order.lost_local_world >= 0:
            os.environ["LOCAL_WORLD_SIZE"] = str(order.lost_local_world)
    learned(order.left)


def log_takeover(lay: Layout, order: Order, reformed_wall: float) -> None:
    """The one line an operator reads: which rank was lost, which spare replaced it, how long it took."""
    took = max(0.0, reformed_wall - order.since) if order.since else float("nan")
    log(logging.WARNING, "spare %s took the place of lost rank %d%s (%s): %.2f s from the failure reaching a "
        "survivor to the re-formed group; %d spare%s left", Seat(lay.launched_rank, host_name()).describe(),
        order.rank, f" ({order.lost})" if order.lost else "", order.why, took, order.left,
        "" if order.left == 1 else "s")


# -- a process's part, as the recovery's loop calls it ------------------------------------------------
def serve(lay: Layout, timeout: timedelta) -> tuple[Order, FailureRecord] | None:
    """A spare: wait for an order; ``None`` when the training ended without it, else the order (its seat
    taken) and the cause it joins the recovery with."""
    learned(lay.spares)
    # what the training's first optimizer would import (seconds), imported while nothing waits for it
    compat_torch.import_lazy_modules()
    log(logging.INFO, "launched rank %d of %d is a spare: it waits for a training rank (%d of them) lost with no "
        "keeper to replace it", lay.launched_rank, lay.launched_world, lay.training_world)
    order = wait_for_order(attempts.agent_store(timeout), lay, lay.launched_rank)
    if order.kind == END:
        if order.ok:
            log(logging.INFO, "spare launched rank %d: %s; it never trained (its call returns None)",
                lay.launched_rank, order.why)
            return None
        raise RecoveryError(f"spare launched rank {lay.launched_rank}: the job ended without it: {order.why}")
    take_seat(lay, order)
    attempts.set_in_place(order.attempt)
    return order, FailureRecord.replaced(order.rank, f"rank {order.rank}'s process was lost with no keeper to replace it: spare "
                                       f"launched rank {lay.launched_rank} took its place")


def take_own_seat(lay: Layout, timeout: timedelta) -> Any:
    """A training rank's first attempt: hold its seat in torchrun's store (the one the attempts share)."""
    store = attempts.agent_store(timeout)
    write_seat(store, lay.launched_rank, lay.launched_rank)
    log(logging.INFO, "rank %d of a training world of %d (%d spare%s launched beside it)", lay.launched_rank,
        lay.training_world, lay.spares, "" if lay.spares == 1 else "s")
    return store


def tell_end(store: Any, lay: Layout, ok: bool, why: str) -> None:
    """Training rank 0, when the job ends (``ok``: the training ended): every launched rank that waits for
    an order is told, within :data:`RECOVER_TELL_SEC` (the store may be what failed)."""
    conn = Connection(lambda: store, timedelta(seconds=RECOVER_TELL_SEC), "spares")
    conn.deadline = time.monotonic() + RECOVER_TELL_SEC
    try:
        order, bounded = Order(END, cap_head(why, 500), ok=ok).to_json(), Bounded(conn)
        for launched in range(lay.launched_world):
            bounded.set(order_key(launched), order)
    except Exception as err:  # noqa: BLE001 - torchrun ends them anyway once a rank exits with an error
        log(logging.WARNING, "could not tell the spares that the job ended: %s: %s", type(err).__name__,
            first_line(err))
    finally:
        conn.close()


def keeper_replaces(store: Any, rank: int, end_seen: bool) -> bool:
    """A keeper replaces lost rank ``rank``: its end was seen (by a peer on its host, or its liveness
    helper, which saw its keeper live on) and its keeper announced itself (:func:`keeper_key`). A key
    alone is no evidence: a rank whose host is gone left its key behind, and so did a keeper killed with it."""
    return end_seen and bool(store.check([keeper_key(rank)]))


class Claims:
    """A survivor's part in recovery ``gen``'s agreement when the job has spares (``since``: when the
    failure reached this rank, wall clock; ``lost()``: the failed attempt's records of the ranks lost)."""

    def __init__(self, store: Any, lay: Layout, gen: int, since: float, seconds: float,
                 lost: Callable[[], dict[int, Any]]) -> None:
        self.store, self.lay, self.gen, self.since, self.seconds, self.lost = store, lay, gen, since, seconds, lost
        self.claimed: set[int] = set()  # lost ranks this rank found a spare for, this recovery

    def displaced(self, rank: int) -> str:
        """Why this process must not take part as ``rank`` any more (its peers declared it lost and a spare
        was ordered to, or holds, its seat), or ``""``."""
        mine = self.lay.launched_rank  # a spare that took the seat: its own launched rank is the seat's
        if self.store.check([answer_key(self.gen, rank)]):
            answer = Answer.from_json(self.store.get(answer_key(self.gen, rank)), self.lay.launched_world)
            if answer is not None and answer.spare >= 0 and answer.spare != mine:
                return (f"rank {rank} was declared lost by its peers and spare launched rank {answer.spare} takes its "
                        f"place: this process (launched rank {mine}) does not rejoin the job")
        if self.store.check([seat_key(rank)]):
            seat = Seat.from_json(self.store.get(seat_key(rank)), self.lay.launched_world)
            if seat is not None and seat.launched != mine:
                return (f"rank {rank} was declared lost by its peers and {seat.describe()} holds its seat: this "
                        f"process (launched rank {mine}) does not rejoin the job")
        return ""

    def claim(self, rank: int, why: str, *, too: bool = False) -> str:
        """A spare for lost ``rank`` (``too``: beside the cause's), logged; why the job ends when none is left."""
        self.claimed.add(rank)
        answer = claim(self.store, self.lay, rank, self.gen, why, self.since, timedelta(seconds=self.seconds))
        if answer.spare < 0:
            return (f"rank {rank} was lost with no keeper to replace it, and no spare is left "
                    f"(spares={self.lay.spares}, all taken): a relaunch replaces it")
        log(logging.WARNING, "rank %d was lost%s with no keeper to replace it: spare launched rank %d takes its place "
            "(%d spare%s left after it)", rank, " too," if too else "", answer.spare, answer.left,
            "" if answer.left == 1 else "s")
        return ""

    def for_lost(self, gen: int) -> str:
        """A spare for every rank the records declare lost (a host of several ranks, two killed at once)
        that has not reached recovery ``gen`` and has no keeper; why the job ends when one gets none."""
        for rank, record in sorted(self.lost().items()):
            if rank in self.claimed or self.store.check([agreement_key(gen, "cause", rank)]):
                continue  # found a spare already, or it (or its replacement) reached the recovery
            if keeper_replaces(self.store, rank, record.ended is not None and not record.ended.keeper_gone):
                continue
            ends = self.claim(rank, f"rank {rank} failed: {record.exc_type}: {cap_head(record.exc_message, 200)}",
                              too=True)
            if ends:
                return ends
        return ""
