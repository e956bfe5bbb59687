"""Spare ranks: the job is launched with ``k`` more ranks than it trains with; the spares wait, and one
takes the place of a training rank that was lost with no process to come back in.

``recover_in_place(train, spares=k)`` under torchrun: of the ``L`` launched ranks the last ``k``
(launched ranks ``L-k`` to ``L-1``) are spares, the others form the **training world** of
``T = L - k`` ranks. The training ranks see that world only: before ``train`` is called, ``RANK``,
``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` are set to the training world's (:func:`enter_training_world`),
and the default group ``train`` makes with ``init_process_group`` is the training ranks' group over a
``PrefixStore`` of torchrun's store (the attempt's namespace, :func:`..core.attempts.namespace`: no
key of the launched world's is ever read). ``dist.get_rank()``, ``get_world_size()``, Ignite's ``idist``
and Lightning's strategy then tell the training world.

A spare never calls ``train``. It waits on one key of its own in the store (:func:`order_key`), a
blocking store wait (in chunks of ``FTH_SPARE_WAIT_SEC``: no busy loop, one
store request a minute) for an :class:`Order`:

* ``take``: training rank ``r`` was lost (its process ended and no keeper replaced it); the spare
  sets its environment to rank ``r`` of the training world (:func:`take_seat`) and, under a keeper
  of its own (a later death of the seat's process is replaced in place), joins the recovery the
  survivors wait in, as a keeper's replacement does; the live state is sent to it by a peer and
  every training rank calls ``train`` again, carrying on at the failed step;
* ``end``: the training ended (``ok``: the spare's call returns ``None``) or the job ended with a
  failure (it raises :class:`~..core.errors.RecoveryError` naming the cause).

Which spare replaces which rank (:func:`claim`): the first survivor to reach the recovery of a lost
rank ``r`` claims (``add`` on the attempt's claim key: exactly one rank gets 1), takes the next spare
in launched order (a counter of spares taken, over the whole job) and writes its order; it publishes
the answer (:class:`Answer`: the spare, or none left) under the attempt's key, which the other
survivors wait for. With none left, the cause ends the job as without spares.

Every key lives under ``fth/recover/<torchrun restart>/spares/`` in torchrun's store (the first
attempt's store, as every recovery's keys), each value bounded JSON checked on read (never pickled).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from ..core import attempts, config
from ..core.errors import RecoveryError
from ..core.log import first_line, log
from ..core.records import cap_head, host_name, sanitize
from .causes import KEY_ROOT, read_json

TAKE = "take"
END = "end"

_left: int | None = None  # spares left, as this process last learned it (None: no spares in this job)


def spares_left() -> int | None:
    """How many spares are left to replace lost ranks, as this process last learned it: ``k`` at the
    start of ``recover_in_place(fn, spares=k)``, one less each time a spare took a lost rank's place
    (learned at that recovery, by every training rank); ``None`` without spares."""
    return _left


def _set_left(count: int | None) -> None:
    global _left
    _left = count


def check_spares(spares: Any) -> int:
    """``spares`` as given to ``recover_in_place``: an int >= 0 (its upper bound is checked at the
    call, once the launched world is known: :func:`layout`)."""
    if isinstance(spares, bool) or not isinstance(spares, int):
        raise TypeError(f"recover_in_place(spares=...) must be an int from 0 to the launched world size - 1 "
                        f"(0: no spares), got {spares!r}")
    if spares < 0:
        raise ValueError(f"recover_in_place(spares=...) must be an int from 0 to the launched world size - 1 "
                         f"(0: no spares), got {spares}")
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
        """The launched rank of the ``taken``-th spare taken (1-based), in launched order."""
        return self.training_world + taken - 1

    def training_local_world(self) -> int | None:
        """How many training ranks share this host at launch: torchrun numbers a host's ranks
        contiguously (``LOCAL_WORLD_SIZE`` of them, from ``RANK - LOCAL_RANK``), and the spares are the
        last launched ranks."""
        if self.local_rank is None or self.local_world is None:
            return None
        first = self.launched_rank - self.local_rank
        return max(0, min(first + self.local_world, self.training_world) - first)


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else None


def layout(spares: int) -> Layout:
    """This process's place in the launched world (from torchrun's environment), ``spares`` checked
    against it.

    Raises:
        ValueError: ``spares`` does not leave at least one training rank (naming the valid range).
        RecoveryError: not under torchrun (spares need its agent's store, which outlives any rank).
    """
    world, rank = _int_env("WORLD_SIZE"), _int_env("RANK")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or world is None or rank is None \
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
    """A training rank at start: its environment names the training world (its rank is its launched
    rank; ``WORLD_SIZE`` and torchrun's ``ROLE_WORLD_SIZE`` the training world's; ``LOCAL_WORLD_SIZE``
    the training ranks of its host)."""
    os.environ["RANK"] = str(lay.launched_rank)
    os.environ["WORLD_SIZE"] = str(lay.training_world)
    if "ROLE_WORLD_SIZE" in os.environ:  # torchrun's one role: the same as the world
        os.environ["ROLE_WORLD_SIZE"] = str(lay.training_world)
    local = lay.training_local_world()
    if local is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local)
    _set_left(lay.spares)


# -- the store schema (every key of the spares, once) ----------------------------------------------------
def _root() -> str:
    return f"{KEY_ROOT}/{attempts.restart()}/spares"


def order_key(launched_rank: int) -> str:
    """What launched rank ``launched_rank`` is told to do (a spare, or a keeper whose rank was lost)."""
    return f"{_root()}/order/{launched_rank}"


def taken_key() -> str:
    """How many spares were taken (an ``add`` counter, over the whole torchrun attempt)."""
    return f"{_root()}/taken"


def claim_key(gen: int, rank: int) -> str:
    """The first survivor to ``add`` 1 here at recovery ``gen`` finds a spare for lost rank ``rank``."""
    return f"{_root()}/{gen}/claim/{rank}"


def answer_key(gen: int, rank: int) -> str:
    """Which spare replaces lost rank ``rank`` at recovery ``gen`` (:class:`Answer`)."""
    return f"{_root()}/{gen}/answer/{rank}"


def seat_key(rank: int) -> str:
    """Who holds training rank ``rank`` (:class:`Seat`), written when it starts training."""
    return f"{_root()}/seat/{rank}"


def _text(value: Any, chars: int) -> str:
    return cap_head(sanitize(str(value)), chars)


@dataclass(frozen=True)
class Seat:
    """The process holding a training rank: its launched rank, its host, and its ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` as training (-1: not set)."""

    launched: int
    host: str
    local_rank: int = -1
    local_world: int = -1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: Any, launched_world: int) -> Seat | None:
        data = read_json(raw)
        try:
            seat = cls(int(data["launched"]), _text(data["host"], 200), int(data.get("local_rank", -1)),
                       int(data.get("local_world", -1)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if not (0 <= seat.launched < launched_world and -1 <= seat.local_rank < launched_world
                and -1 <= seat.local_world <= launched_world):
            return None
        return seat

    def describe(self) -> str:
        return f"launched rank {self.launched} on host {self.host}"


@dataclass(frozen=True)
class Order:
    """What a waiting spare is told: ``take`` training rank ``rank`` at recovery ``attempt`` (the lost
    rank's ``lost`` seat, why it was lost, when the failure reached the claimer: ``since``, wall
    clock, and the spares left after this one), or ``end`` (``ok``: the training ended)."""

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

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: Any, training_world: int) -> Order | None:
        data = read_json(raw)
        try:
            order = cls(str(data["kind"]), _text(data["why"], 500), int(data.get("rank", -1)),
                        int(data.get("attempt", -1)), float(data.get("since", 0.0)), int(data.get("left", 0)),
                        _text(data.get("lost", ""), 300), bool(data.get("ok", False)),
                        _text(data.get("lost_host", ""), 200), int(data.get("lost_local_rank", -1)),
                        int(data.get("lost_local_world", -1)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if order.kind == END:
            return order
        if order.kind != TAKE or not (0 <= order.rank < training_world and 0 <= order.attempt < 2**31
                                      and order.left >= 0 and order.lost_local_rank >= -1
                                      and order.lost_local_world >= -1):
            return None
        return order


@dataclass(frozen=True)
class Answer:
    """Which spare replaces a lost rank (``spare``: its launched rank; -1: none left) and how many are
    left after it."""

    spare: int
    left: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: Any, launched_world: int) -> Answer | None:
        data = read_json(raw)
        try:
            answer = cls(int(data["spare"]), int(data["left"]))
        except (KeyError, TypeError, ValueError):
            return None
        return answer if -1 <= answer.spare < launched_world and answer.left >= 0 else None


# -- the protocol ------------------------------------------------------------------------------------
def write_seat(store: Any, rank: int, lay: Layout, launched_rank: int) -> None:
    """This process holds training rank ``rank`` (its local names as its environment says now)."""
    local_rank, local_world = _int_env("LOCAL_RANK"), _int_env("LOCAL_WORLD_SIZE")
    store.set(seat_key(rank), Seat(launched_rank, host_name(), -1 if local_rank is None else local_rank,
                                   -1 if local_world is None else local_world).to_json())


def claim(store: Any, lay: Layout, rank: int, gen: int, why: str, since: float, wait: timedelta) -> Answer:
    """A survivor's part when training rank ``rank`` was lost with no keeper to replace it: the first
    to come claims the next spare and orders it to take ``rank`` at recovery ``gen``; every survivor
    returns the same :class:`Answer`. ``store`` is the recovery's bounded store (each call bounded)."""
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
    _set_left(answer.left)
    return answer


def left_after(store: Any, lay: Layout) -> int:
    """How many spares are left, as the store counts the ones taken (rank 0, deciding a recovery)."""
    taken = int(store.add(taken_key(), 0)) if store.check([taken_key()]) else 0  # no key made: none taken
    return max(0, lay.spares - max(0, taken))


def end(store: Any, lay: Layout, ok: bool, why: str) -> None:
    """Training rank 0, when the training ended (``ok``) or the job ends with a failure: every launched
    rank that waits for an order (the spares left, a keeper whose rank was lost) is told."""
    order = Order(END, cap_head(why, 500), ok=ok).to_json()
    for launched in range(lay.launched_world):
        store.set(order_key(launched), order)


def connect(timeout: timedelta) -> Any:
    """A client of torchrun's store (its agent's: ``MASTER_ADDR``, ``MASTER_PORT``)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)


def wait_for_order(store: Any, lay: Layout, launched_rank: int, stop: Any = None) -> Order:
    """Wait for this launched rank's order: blocking store waits of ``FTH_SPARE_WAIT_SEC`` each (a key
    written is seen at once). ``stop()`` (optional) is asked between waits: true ends the wait with an
    ``end`` order. A store that fails (its agent gone) raises :class:`RecoveryError`."""
    from torch.distributed import DistStoreError

    chunk = config.settings().spare_wait
    key = order_key(launched_rank)
    while True:
        if stop is not None and stop():
            return Order(END, "this process was told to stop")
        try:
            store.wait([key], chunk)
        except Exception as err:  # noqa: BLE001 - a timeout is the usual case; anything else is the store
            if isinstance(err, DistStoreError) and "timeout" in str(err).lower():
                continue
            raise RecoveryError(f"launched rank {launched_rank} (a spare) lost torchrun's store while waiting: "
                                f"{type(err).__name__}: {first_line(err)}") from err
        order = Order.from_json(store.get(key), lay.training_world)
        if order is None:
            raise RecoveryError(f"launched rank {launched_rank} (a spare) read an order it cannot understand")
        return order


def take_seat(lay: Layout, order: Order) -> None:
    """A spare taking training rank ``order.rank``: its environment names that rank of the training
    world. On the lost rank's host it takes the lost rank's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
    too (the device its process left, as a keeper's replacement would: the host's local names stay
    those of its training ranks); on another host it keeps its own (the device it was launched for)."""
    os.environ["RANK"] = str(order.rank)
    os.environ["WORLD_SIZE"] = str(lay.training_world)
    for name, value in (("ROLE_RANK", order.rank), ("ROLE_WORLD_SIZE", lay.training_world)):
        if name in os.environ:  # torchrun's one role: the same as the world
            os.environ[name] = str(value)
    if order.lost_host and order.lost_host == host_name() and order.lost_local_rank >= 0:
        os.environ["LOCAL_RANK"] = str(order.lost_local_rank)
        if order.lost_local_world >= 0:
            os.environ["LOCAL_WORLD_SIZE"] = str(order.lost_local_world)
    _set_left(order.left)


def log_takeover(lay: Layout, order: Order, reformed_wall: float) -> None:
    """The one line an operator reads: which rank was lost, which spare replaced it, how long it took."""
    took = max(0.0, reformed_wall - order.since) if order.since else float("nan")
    log(logging.WARNING, "spare %s took the place of lost rank %d%s (%s): %.2f s from the failure reaching a "
        "survivor to the re-formed group; %d spare%s left", Seat(lay.launched_rank, host_name()).describe(),
        order.rank, f" ({order.lost})" if order.lost else "", order.why, took, order.left,
        "" if order.left == 1 else "s")
