"""Finding the newest complete checkpoint to resume from, the same on every rank (:func:`find`, behind
:func:`fault_tolerant_handlers.latest_checkpoint`; docs/recovering.md): rank 0 decides and answers every
rank through the store (bounded bytes, never a collective); while live state is held, its name."""

from __future__ import annotations

import itertools
import logging
import os
import pickletools
import re
import warnings
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ..core import attempts, compat_torch, config, interrupts
from ..core.hooks import first_line, log
from . import live
from .dcp import METADATA as DCP_METADATA

SUFFIXES = (".pt", ".pth", ".ckpt")
#: What Lightning's sharded strategies write into a distributed checkpoint after DCP's shards.
LIGHTNING_META = "meta.pt"
#: Longest path or request text the ranks exchange (bytes).
MAX_PATH_BYTES = 4096
#: Longest verdict (an error naming every rank's folder, shortened).
MAX_VERDICT_BYTES = 16384
#: Largest ``data.pkl`` whose keys are read without loading it (a checkpoint's objects beyond tensors).
MAX_SCANNED_PICKLE_BYTES = 64 << 20
_STEP = re.compile(r"(?:step=|_)(\d+)(?=[.-]|$)")
_calls: dict[str, int] = {}  # calls per attempt (its namespace)
_warned_missing: set[str] = set()  # folders already named as missing (once per process)


@dataclass(frozen=True)
class Source:
    """Where to look (``folders``, names starting with ``prefix``) and what a usable file holds
    (``required_keys``); ``label`` names it in messages and is compared across ranks when ``compared``
    (``False`` where rank 0 alone writes, Ignite's ``DiskSaver``)."""

    folders: tuple[Path, ...]
    label: str
    prefix: str = ""
    required_keys: tuple[str, ...] = ()
    compared: bool = True


def folder_source(dirname: str | os.PathLike, *, prefix: str | None = None,
                  required_keys: Iterable[str] | Mapping | None = None, what: str = "dirname") -> Source:
    """The :class:`Source` of a folder argument (checked: ``TypeError``/``ValueError`` naming it)."""
    if not isinstance(dirname, (str, os.PathLike)):
        raise TypeError(f"latest_checkpoint({what}={dirname!r}): expected a folder (a str or os.PathLike), an ignite "
                        "Engine or Checkpoint, or a Lightning Trainer")
    prefix = check_prefix(prefix)
    keys = check_keys(required_keys)
    folder = Path(os.path.abspath(os.fspath(dirname)))
    return Source((folder,), label_of(folder, prefix, keys), prefix, keys)


def check_prefix(prefix: Any) -> str:
    if prefix is None:
        return ""
    if not isinstance(prefix, str) or os.sep in prefix:
        raise TypeError(f"latest_checkpoint(prefix={prefix!r}): expected a str (the start of a file's name, no "
                        "folder), or None")
    return prefix


def check_keys(required_keys: Any) -> tuple[str, ...]:
    if required_keys is None:
        return ()
    if isinstance(required_keys, str) or not isinstance(required_keys, (Mapping, Iterable)):
        raise TypeError(f"latest_checkpoint(required_keys={required_keys!r}): expected the keys a checkpoint must "
                        "hold (an iterable of str, or the to_save/to_load dict), or None")
    keys = tuple(required_keys)
    if not all(isinstance(k, str) for k in keys):
        raise TypeError(f"latest_checkpoint(required_keys={required_keys!r}): every key must be a str")
    return keys


def label_of(folder: Path, prefix: str, keys: tuple[str, ...]) -> str:
    return (repr(str(folder)) + (f" (names starting with {prefix!r})" if prefix else "")
            + (f" (keys {', '.join(keys)})" if keys else ""))


# -- one decision ------------------------------------------------------------------------------------------
def _step_of(name: str) -> int:
    found = _STEP.findall(Path(name).stem)
    return int(found[-1]) if found else -1


def _is_temporary(name: str) -> bool:
    return name.startswith("tmp") and Path(name).suffix not in SUFFIXES or name.endswith((".tmp", ".part"))


def check_file(path: Path, required_keys: tuple[str, ...] = ()) -> str | None:
    """``None`` if ``path`` is a complete checkpoint holding ``required_keys``, else why not."""
    try:
        if path.stat().st_size == 0:
            return "empty"
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            if bad is not None:
                return f"corrupt member {bad}"
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"unreadable: {type(err).__name__}: {err}"
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:  # noqa: BLE001
        text = str(err)
        if not ("Weights only load failed" in text and "unsupported global" in text.lower() and zipfile.is_zipfile(path)):
            return f"does not load: {type(err).__name__}: {first_line(text)}"
        # complete (CRCs checked); objects beyond tensors are left to the framework's own load, and the
        # keys are looked for among the pickle's strings, which are read, never unpickled
        strings = _pickled_strings(path)
        missing = [k for k in required_keys if strings is not None and k not in strings]
    else:
        if required_keys and not isinstance(loaded, Mapping):
            return f"holds a {type(loaded).__name__}, not the keys the load needs ({', '.join(required_keys)})"
        missing = [k for k in required_keys if k not in loaded]
    if missing:
        return (f"missing key {', '.join(repr(k) for k in missing)} (the load needs {', '.join(required_keys)}: "
                "a model-only file, such as a best model's or a weights-only one?)")
    return None


def _pickled_strings(path: Path) -> set[str] | None:
    """Every string in a torch zip checkpoint's ``data.pkl``, read opcode by opcode (nothing is unpickled),
    or ``None`` when it cannot be read so (too large, no such member, malformed)."""
    try:
        with zipfile.ZipFile(path) as archive:
            info = next((i for i in archive.infolist() if i.filename.endswith("/data.pkl")), None)
            if info is None or info.file_size > MAX_SCANNED_PICKLE_BYTES:
                return None
            data = archive.read(info)
        return {arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}
    except Exception:  # noqa: BLE001 - no verdict: the keys are not judged
        return None


def _is_distributed(path: Path) -> bool:
    """A directory that is (or was being written as) a distributed checkpoint (Lightning's: ``*.ckpt``)."""
    if path.suffix in SUFFIXES or (path / DCP_METADATA).exists():
        return True
    try:
        return any(child.suffix == ".distcp" for child in path.iterdir())
    except OSError:
        return False


def check_dir(path: Path) -> str | None:
    """``None`` if the directory ``path`` is a complete distributed checkpoint (DCP's ``.metadata``, and
    for a ``.ckpt`` directory Lightning's ``meta.pt`` written after it), else why not."""
    try:
        metadata = path / DCP_METADATA
        if not metadata.is_file() or metadata.stat().st_size == 0:
            return f"no {DCP_METADATA} (a distributed checkpoint whose write did not finish)"
        meta = path / LIGHTNING_META
        if meta.exists():
            why = check_file(meta)
            return f"{LIGHTNING_META} {why}" if why else None
        if path.suffix == ".ckpt":
            return f"no {LIGHTNING_META} (Lightning writes it after the shards: a write that did not finish)"
    except OSError as err:
        return f"unreadable: {type(err).__name__}: {err}"
    return None


def _mtime_ns(path: Path) -> int:
    """When a checkpoint was completed (a directory: its metadata's modification time)."""
    if path.is_dir():
        times = [p.stat().st_mtime_ns for p in (path / LIGHTNING_META, path / DCP_METADATA) if p.exists()]
        return max(times, default=path.stat().st_mtime_ns)
    return path.stat().st_mtime_ns


def candidates(source: Source) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The files and directories of ``source``'s folders that may be checkpoints, newest first (the
    larger step in the name on a tie), and the temporary ones skipped, with why."""
    found, skipped = [], []
    for folder in source.folders:
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            name = entry.name[4:] if entry.name.startswith("tmp-") else entry.name  # DCPSaver's temporary
            if not name.startswith(source.prefix):
                continue
            is_dir = entry.is_dir()
            if not entry.is_file() and not (is_dir and _is_distributed(entry)):
                continue
            if _is_temporary(entry.name):
                skipped.append((entry, f"a temporary {'directory' if is_dir else 'file'} (a write that did not finish)"))
            elif is_dir or entry.suffix in SUFFIXES:
                found.append(entry)
    found.sort(key=lambda p: (_mtime_ns(p), _step_of(p.name), p.name), reverse=True)
    return found, skipped


def _decide(source: Source) -> str | None:
    if not any(folder.is_dir() for folder in source.folders):
        if source.label not in _warned_missing:
            _warned_missing.add(source.label)
            what = "not a folder" if any(folder.exists() for folder in source.folders) else "no such folder"
            log(logging.WARNING, "latest_checkpoint(%s): %s: nothing to resume from (a first run starts from "
                "scratch; otherwise check the path)", source.label, what)
        return None
    found, skipped = candidates(source)
    chosen = None
    for path in found:
        why = check_dir(path) if path.is_dir() else check_file(path, source.required_keys)
        if why is None:
            chosen = path
            break
        skipped.append((path, why))
    for path, why in skipped:
        message = f"latest_checkpoint({source.label}): skipping {path.name}: {why}"
        warnings.warn(message, RuntimeWarning, stacklevel=4)
        log(logging.WARNING, "%s", message)
    return str(chosen) if chosen is not None else None


# -- the exchange ------------------------------------------------------------------------------------------
_NONE, _PATH, _MISMATCH, _MISSING = b"\x00", b"\x01", b"\x03", b"\x04"
_COMPARED = 1


def _encode_request(source: Source) -> bytes:
    flags = _COMPARED if source.compared else 0
    text = source.label.encode("utf-8")
    if len(text) > MAX_PATH_BYTES:
        raise ValueError(f"latest_checkpoint: folder longer than {MAX_PATH_BYTES} bytes: {source.label[:100]}...")
    return b"R" + bytes([flags]) + text


def _decode_request(data: bytes, rank: int) -> tuple[int, str]:
    if not 2 <= len(data) <= MAX_PATH_BYTES + 2 or data[:1] != b"R" or data[1] > _COMPARED:
        raise RuntimeError(f"latest_checkpoint: rank {rank}'s request is malformed ({len(data)} bytes)")
    return data[1], data[2:].decode("utf-8", "replace")


def _encode_verdict(kind: bytes, text: str = "") -> bytes:
    data = text.encode("utf-8")
    if kind == _PATH and len(data) > MAX_PATH_BYTES:
        raise ValueError(f"latest_checkpoint: path longer than {MAX_PATH_BYTES} bytes: {text[:100]}...")
    return kind + data[: MAX_VERDICT_BYTES - 1]


def _decode_verdict(data: bytes) -> tuple[bytes, str]:
    if not data or len(data) > MAX_VERDICT_BYTES or data[:1] not in (_NONE, _PATH, _MISMATCH, _MISSING):
        raise RuntimeError(f"latest_checkpoint: rank 0's answer is malformed ({len(data)} bytes)")
    return data[:1], data[1:].decode("utf-8", "replace")


def _ranks_text(ranks: list[int]) -> str:
    """``ranks 1-3, 5`` of sorted ranks."""
    runs = [[r for _, r in run] for _, run in itertools.groupby(enumerate(ranks), lambda ir: ir[1] - ir[0])]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(
        str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _mismatch_text(requests: dict[int, tuple[int, str]]) -> str | None:
    """The error when the compared ranks asked for different things, else ``None``."""
    labels = {r: label for r, (flags, label) in requests.items() if flags & _COMPARED or r == 0}
    if len(set(labels.values())) <= 1:
        return None
    by_label: dict[str, list[int]] = {}
    for r in sorted(labels):
        by_label.setdefault(labels[r], []).append(r)
    named = "; ".join(f"{_ranks_text(ranks)}: {label[:300]}" for label, ranks in by_label.items())
    return (f"latest_checkpoint: the ranks passed different folders ({named}). Every rank must pass the same folder "
            "(one decision serves every rank); a folder made on rank 0 only (a timestamped output folder) must be "
            "given to the other ranks too, or pass the trainer or its Checkpoint (Ignite: the folder of rank 0's "
            "Checkpoint serves every rank)")


def _rank0(store: dist.Store, key: str, world: int, source: Source, timeout: timedelta) -> tuple[bytes, str]:
    keys = [f"{key}/ask/{r}" for r in range(1, world)]
    try:
        if keys:
            store.wait(keys, timeout)
    except Exception:  # noqa: BLE001 - a store timeout (DistStoreError): name who did not ask
        missing = [r for r, k in zip(range(1, world), keys) if not store.check([k])]
        if missing:
            return _MISSING, (f"latest_checkpoint: {_ranks_text(missing)} did not call latest_checkpoint within "
                              f"{timeout.total_seconds():g} s of rank 0 ({config.CKPT_AGREE_TIMEOUT_ENV}): call it on "
                              "every rank, the same number of times")
        raise
    requests = {0: _decode_request(_encode_request(source), 0)}
    for r, k in zip(range(1, world), keys):
        requests[r] = _decode_request(store.get(k), r)
    mismatch = _mismatch_text(requests)
    if mismatch is not None:
        return _MISMATCH, mismatch
    answer = _decide(source)
    return (_NONE, "") if answer is None else (_PATH, answer)


def agree(store: dist.Store, key: str, rank: int, world: int, source: Source, timeout: timedelta) -> str | None:
    """Every rank's one answer for ``source``, exchanged through ``store`` under ``key`` (see the module)."""
    if rank == 0:
        verdict = _rank0(store, key, world, source, timeout)
        with interrupts.SECTION:  # a main-thread store call: a hung rank's interrupt waits for it
            store.set(f"{key}/verdict", _encode_verdict(*verdict))
    else:
        with interrupts.SECTION:
            store.set(f"{key}/ask/{rank}", _encode_request(source))
        try:
            store.wait([f"{key}/verdict"], timeout * 2)
        except Exception as err:  # noqa: BLE001 - a store timeout (DistStoreError)
            if store.check([f"{key}/verdict"]):
                raise
            raise TimeoutError(f"latest_checkpoint({source.label}): no answer from rank 0 within "
                               f"{2 * timeout.total_seconds():g} s ({config.CKPT_AGREE_TIMEOUT_ENV} x 2): did rank 0 "
                               "call latest_checkpoint? Call it on every rank, the same number of times") from err
        verdict = _decode_verdict(store.get(f"{key}/verdict"))
    kind, text = verdict
    if kind == _MISMATCH:
        raise ValueError(text)
    if kind == _MISSING:
        raise TimeoutError(text)
    return text if kind == _PATH else None


def _medium() -> tuple[dist.Store, int, int] | None:
    """(store, rank, world size) to agree over (the default group's, else torchrun's), or ``None`` to decide alone."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return compat_torch.default_store(), dist.get_rank(), dist.get_world_size()
    if not attempts.under_torchrun() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    store = attempts.agent_store(config.settings().ckpt_agree_timeout)
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise RuntimeError(f"latest_checkpoint: torchrun's RANK={rank!r} / WORLD_SIZE={world!r} are not a rank and a "
                           "size")
    return store, int(rank), int(world)


def find(source: Source) -> str | None:
    """The newest usable checkpoint of ``source`` (or the live state's name, or ``None``), the same on every rank."""
    name = live.latest_checkpoint_answer(source.folders[0])  # every rank holds it: no exchange
    if name is not None:
        return name
    medium = _medium()
    if medium is None:
        return _decide(source)
    store, rank, world = medium
    namespace = attempts.namespace()
    _calls[namespace] = count = _calls.get(namespace, 0) + 1  # per attempt: a replacement counts from 1 too
    key = f"fth/latest_checkpoint/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{namespace}/{count}"
    return agree(store, key, rank, world, source, config.settings().ckpt_agree_timeout)
