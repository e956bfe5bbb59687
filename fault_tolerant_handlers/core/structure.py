"""One codec for a nested training state: its structure as bounded JSON (never pickled, every node of
a peer's checked), its tensors as leaves a caller's hook describes and rebuilds. Containers are tagged:
``{"l": [...]}`` list, ``{"t": [...]}`` tuple, ``{"d": [[key, node], ...]}`` dict, ``{"o": pairs, "m":
_metadata}`` OrderedDict, ``{"b": base64}`` bytes; any other tag is a leaf's."""

from __future__ import annotations

import base64
import collections
import json
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch

#: The deepest nesting of containers a structure may have.
MAX_DEPTH = 64
#: The largest structure (bytes of JSON), from a peer or not.
MAX_BYTES = 16 * 2**20
#: The dtypes a leaf may have, by name (``str(torch.float32)`` minus the ``torch.`` prefix).
DTYPES = {name: getattr(torch, name) for name in (
    "float64", "float32", "float16", "bfloat16", "float8_e5m2", "float8_e4m3fn", "complex32", "complex64",
    "complex128", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool")
    if hasattr(torch, name)}

_SCALARS = (bool, int, float, str)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dense(t: torch.Tensor, path: str, what: str) -> None:
    """Refuse ``t`` unless its bytes can be read in place: strided, with memory, a dtype of :data:`DTYPES`."""
    if t.layout is not torch.strided or t.is_quantized or t.is_meta or t.is_nested or dtype_name(t.dtype) not in DTYPES:
        raise TypeError(f"{path} is a tensor {what} cannot carry (layout {t.layout}, dtype {t.dtype}"
                        f"{', meta' if t.is_meta else ''}): only dense tensors with data")


def from_numpy(obj: Any) -> torch.Tensor | None:
    """A numpy array as a row-major tensor (copied only when not contiguous); ``None`` for no array or
    elements torch has no dtype for."""
    numpy = sys.modules.get("numpy")
    if numpy is None or type(obj) is not numpy.ndarray:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only array: read, never written through
        try:
            return torch.from_numpy(numpy.ascontiguousarray(obj))
        except (TypeError, ValueError):  # object, strings, another byte order
            return None


def _key(key: Any, path: str, what: str) -> Any:
    if key is None or type(key) in _SCALARS:
        return key
    if type(key) is tuple:
        return {"t": [_key(k, path, what) for k in key]}
    raise TypeError(f"{path} has a key {key!r} of type {type(key).__qualname__}, which {what} cannot carry "
                    "(dict keys: None, bool, int, float, str or tuples of them)")


def encode(obj: Any, leaf: Callable[[Any, str], Any], what: str, *, loose: bool = False,
           path: str = "state", depth: int = 0) -> Any:
    """The JSON form of ``obj`` (``leaf(obj, path)`` for a leaf); ``what`` names the carrier in errors;
    ``loose``: a subclass of a scalar or container as the plain one. ``TypeError`` naming the path."""
    kind = type(obj)
    if obj is None or kind in _SCALARS or loose and isinstance(obj, _SCALARS):
        return obj
    if depth > MAX_DEPTH:
        raise TypeError(f"{path} is nested deeper than {MAX_DEPTH}")

    def inner(value: Any, where: str) -> Any:
        return encode(value, leaf, what, loose=loose, path=where, depth=depth + 1)

    if kind is list or kind is tuple or loose and isinstance(obj, (list, tuple)):
        return {"t" if isinstance(obj, tuple) else "l": [inner(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if kind is dict or kind is collections.OrderedDict or loose and isinstance(obj, Mapping):
        pairs = [[_key(k, path, what), inner(v, f"{path}[{k!r}]")] for k, v in obj.items()]
        if kind is not collections.OrderedDict:
            return {"d": pairs}
        metadata = getattr(obj, "_metadata", None)
        return {"o": pairs} if metadata is None else {"o": pairs, "m": inner(metadata, f"{path}._metadata")}
    if kind is bytes:
        return {"b": base64.b64encode(obj).decode("ascii")}
    node = leaf(obj, path)
    if node is None:
        raise TypeError(
            f"{path} is a {kind.__module__}.{kind.__qualname__}, which {what} cannot carry: accepted are "
            "tensors, numpy arrays, None, bool, int, float, str, bytes, and dict (or OrderedDict), list and "
            "tuple of those (dict keys: None, bool, int, float, str or tuples of them). Convert it, or leave "
            "it out of the state")
    return node


def dumps(tree: Any) -> bytes:
    """``tree`` as canonical JSON (ASCII, no spaces); a ``TypeError`` beyond :data:`MAX_BYTES`."""
    data = json.dumps(tree, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode("ascii")
    if len(data) > MAX_BYTES:
        raise TypeError(f"the state's structure is {len(data)} bytes of JSON, more than {MAX_BYTES}")
    return data


def loads(data: bytes, error: type[Exception] = ValueError) -> Any:
    """The JSON in ``data`` (from a peer), read only when at most :data:`MAX_BYTES` (else ``error``)."""
    if len(data) > MAX_BYTES:
        raise error(f"the structure is {len(data)} bytes, more than {MAX_BYTES}")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise error(f"the structure is not JSON: {type(e).__name__}: {str(e)[:200]}") from None


def _unkey(key: Any, path: str, error: type[Exception], depth: int) -> Any:
    if key is None or type(key) in _SCALARS:
        return key
    if depth <= MAX_DEPTH and type(key) is dict and list(key) == ["t"] and type(key["t"]) is list:
        return tuple(_unkey(k, path, error, depth + 1) for k in key["t"])
    raise error(f"{path} has a malformed key: {str(key)[:200]}")


def decode(node: Any, leaf: Callable[[str, Any, Any, str], Any], error: type[Exception] = ValueError,
           local: Any = None, path: str = "state", depth: int = 0) -> Any:
    """The object :func:`encode` gave ``node`` for; ``local``: the receiver's own object at this place
    (or ``None``), handed to ``leaf`` to be written into. A malformed node raises ``error``, naming its path."""
    if node is None or type(node) in _SCALARS:
        return node
    if depth > MAX_DEPTH or type(node) is not dict or not (len(node) == 1 or len(node) == 2 and set(node) == {"o", "m"}):
        raise error(f"{path} is a malformed node: {str(node)[:200]}")
    tag = "o" if len(node) == 2 else next(iter(node))
    value = node[tag]

    def inner(value: Any, mine: Any, where: str) -> Any:
        return decode(value, leaf, error, mine, where, depth + 1)

    if tag in ("l", "t") and type(value) is list:
        items = local if isinstance(local, (list, tuple)) else ()
        out = [inner(v, items[i] if i < len(items) else None, f"{path}[{i}]") for i, v in enumerate(value)]
        return out if tag == "l" else tuple(out)
    if tag in ("d", "o") and type(value) is list and all(type(kv) is list and len(kv) == 2 for kv in value):
        mapping = local if isinstance(local, dict) else {}
        out: dict = {} if tag == "d" else collections.OrderedDict()
        for k, v in value:
            key = _unkey(k, path, error, depth)
            out[key] = inner(v, mapping.get(key), f"{path}[{key!r}]")
        if "m" in node:
            out._metadata = inner(node["m"], None, f"{path}._metadata")  # type: ignore[attr-defined]
        return out
    if tag == "b" and type(value) is str:
        try:
            return base64.b64decode(value.encode("ascii"), validate=True)
        except ValueError:
            raise error(f"{path} is not base64: {value[:200]}") from None
    if tag in ("l", "t", "d", "o", "b"):
        raise error(f"{path} is a malformed node: {str(node)[:200]}")
    return leaf(tag, value, local, path)
