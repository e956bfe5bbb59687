"""The agreement's wire format: what each rank contributes to the one ``all_reduce(MAX)`` of an
agreement (:meth:`.session.Session.agree`), and what the reduced pair says.

Every rank contributes two int64s (:func:`pack_agreement`): ``failing rank + 1`` (0 when it did
not fail) and, to catch ranks that are out of step, the section's hash (:func:`section_hash`) and
agreement number, once as they are and once subtracted from a constant (their smallest).
"""

from __future__ import annotations

import zlib


def section_hash(kind: str, name: str) -> int:
    return zlib.crc32(f"{kind}\0{name}".encode("utf-8", "replace"))


#: Bits of the section hash and of the agreement's sequence number in the agreement's two integers.
_FIELD_BITS = 20
_FIELD = (1 << _FIELD_BITS) - 1
#: The largest flag (a rank + 1) the first integer holds above them.
MAX_FLAG = (1 << (63 - 2 * _FIELD_BITS)) - 1


def pack_agreement(flag: int, digest: int, seq: int) -> tuple[int, int]:
    """The two int64 every rank contributes to one agreement (reduced by MAX).

    ``a = flag | hash | seq`` (high to low bits) and ``b = (M - hash) | (M - seq)``: the MAX of
    ``a`` carries the largest flag and, when no rank failed, the largest (hash, seq) pair; the MAX
    of ``b`` the smallest. Every rank is in the same section and agreement exactly when the two
    pairs are the same (hash and seq kept to 20 bits). Two integers, not five: a gloo all_reduce of
    two elements costs what one does, of five about twice as much."""
    h, s = digest & _FIELD, seq & _FIELD
    return (flag << 2 * _FIELD_BITS) | (h << _FIELD_BITS) | s, ((_FIELD - h) << _FIELD_BITS) | (_FIELD - s)


def unpack_agreement(a: int, b: int) -> tuple[int, bool]:
    """``(the largest flag, whether every rank was in step)`` from the reduced pair."""
    flag = a >> 2 * _FIELD_BITS
    hmax, smax = (a >> _FIELD_BITS) & _FIELD, a & _FIELD
    hmin, smin = _FIELD - ((b >> _FIELD_BITS) & _FIELD), _FIELD - (b & _FIELD)
    return flag, (hmax, smax) == (hmin, smin)

