"""The RNG states live state records as each step starts and puts back when a recovery in place resumes
there (``docs/recovering.md``, "Live state"): torch's (the CPU generator; every CUDA device's once CUDA
is initialised), Python's ``random`` and numpy's global ``numpy.random`` (when the script imported it;
never imported here), all as tensors, so that the report's CRC, the transfer to a replaced rank and a
shard snapshot carry them alike.

A record is ``(cpu, [cuda, ...] or None, python, numpy or None)``; the earlier ``(cpu, cuda or None)``
(torch's only) still reads. Python's and numpy's generators are both MT19937, each one int64 tensor:
its 624 words, its position, whether a Gaussian is cached, and that float's bits. A record from another
rank is read by :func:`checked`, which refuses a malformed one (nothing is unpickled). The ranks agree
on each of the three :data:`PARTS` alone (a script may seed torch alike on every rank and leave
``random`` to each process): a record sent holds only the parts agreed (:func:`only`), the others ``None``,
which the receiver fills from its own (:func:`merged`).
"""

from __future__ import annotations

import array
import random
import struct
import sys
from typing import Any

import torch

#: What each part of a record is, in order (:func:`groups`), for the log.
PARTS = ("torch's", "Python's random", "numpy's")
_WORDS = 624  #: MT19937's state words, each below 2**32; its position is 0 to 624
_MT_LENGTH = _WORDS + 3  #: the words, the position, whether a Gaussian is cached, its bits


def _mt(words_and_pos: Any, gauss: float | None) -> torch.Tensor:
    bits = struct.unpack("<q", struct.pack("<d", gauss))[0] if gauss is not None else 0
    words = array.array("q", words_and_pos)  # a C loop: torch.tensor over 627 ints takes twice as long
    words.extend((gauss is not None, bits))
    return torch.frombuffer(words, dtype=torch.int64).clone()


def _unmt(t: Any) -> tuple[list[int], float | None] | None:
    """``(words and position, cached Gaussian or None)`` of an MT19937 tensor, ``None`` unless ``t`` is one in range."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (_MT_LENGTH,):
        return None
    *words, pos, cached, bits = t.tolist()
    if not (all(0 <= w < 2**32 for w in words) and 0 <= pos <= _WORDS and cached in (0, 1)):
        return None
    return [*words, pos], struct.unpack("<d", struct.pack("<q", bits))[0] if cached else None


def read() -> tuple:
    """This process's RNG states now, as their generators give them (copies: 30 us, where the tensors
    take 120): what live state keeps twice a step; :func:`of` makes the record when one is used."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    numpy_random = sys.modules.get("numpy.random")
    return torch.get_rng_state(), cuda, random.getstate(), numpy_random.get_state() if numpy_random is not None else None


def of(states: tuple) -> tuple:
    """The record of what :func:`read` returned."""
    cpu, cuda, (_, words_and_pos, gauss), state = states
    numpy = (_mt([*state[1].tolist(), state[2]], state[4] if state[3] else None)
             if type(state) is tuple and state[0] == "MT19937" else None)
    return cpu, cuda, _mt(words_and_pos, gauss), numpy


def restore(rng: tuple) -> None:
    """Put back the states of a record (:func:`of`'s, or one :func:`checked` read); numpy's only when
    numpy is imported."""
    cpu, cuda, python, numpy = (*rng, None, None)[:4]
    if cpu is not None:
        torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    if (mt := _unmt(python)) is not None:
        random.setstate((random.Random.VERSION, tuple(mt[0]), mt[1]))
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and (mt := _unmt(numpy)) is not None:
        words = sys.modules["numpy"].asarray(mt[0][:_WORDS], dtype="uint32")
        numpy_random.set_state(("MT19937", words, mt[0][_WORDS], int(mt[1] is not None), mt[1] or 0.0))


def groups(rng: tuple) -> list[list[torch.Tensor]]:
    """The tensors of each of a record's :data:`PARTS` (``[]``: none recorded); the report's CRCs."""
    cpu, cuda, python, numpy = (*rng, None, None)[:4]
    return [[cpu, *(cuda or ())] if cpu is not None else [], [python] if python is not None else [],
            [numpy] if numpy is not None else []]


def only(rng: tuple, parts: tuple[int, ...]) -> list:
    """``rng`` as a transfer sends it: the :data:`PARTS` numbered in ``parts``, the others ``None``."""
    cpu, cuda, python, numpy = (*rng, None, None)[:4]
    return [cpu if 0 in parts else None, cuda if 0 in parts else None, python if 1 in parts else None,
            numpy if 2 in parts else None]


def merged(received: tuple | None, own: tuple | None) -> tuple | None:
    """Each part of ``received``, or where it has none, ``own``'s (either may be ``None``)."""
    if received is None or own is None:
        return own if received is None else received
    (cpu, cuda, python, numpy), mine = (*received, None, None)[:4], (*own, None, None)[:4]
    return (*((cpu, cuda) if cpu is not None else mine[:2]), python if python is not None else mine[2],
            numpy if numpy is not None else mine[3])


def same(a: tuple | None, b: tuple | None) -> bool:
    """Two records (or ``None``) equal, bit for bit."""
    if a is None or b is None:
        return a is b
    return all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y)) for x, y in zip(groups(a), groups(b)))


def checked(value: Any) -> tuple | None:
    """A record read from another rank (a transfer's list, a snapshot's tuple), ``None`` when it is malformed:
    not 2 or 4 parts, torch's CPU state not a uint8 vector of its generator's size (or ``None`` with the
    CUDA states), a CUDA state not a uint8 vector, Python's or numpy's not an MT19937 tensor in range."""
    if type(value) not in (list, tuple) or len(value) not in (2, 4):
        return None
    cpu, cuda, python, numpy = (*value, None, None)[:4]

    def vector(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1

    if not (cuda is None if cpu is None else vector(cpu) and cpu.numel() == torch.get_rng_state().numel()):
        return None
    if cuda is not None and not (type(cuda) in (list, tuple) and all(vector(t) for t in cuda)):
        return None
    if any(t is not None and _unmt(t) is None for t in (python, numpy)):
        return None
    return cpu, None if cuda is None else list(cuda), python, numpy
