"""Finding the newest checkpoint to resume from, the same on every rank (:func:`find`, behind
:func:`fault_tolerant_handlers.latest_checkpoint`).

A job restarted by ``torchrun --max-restarts`` (or requeued by its cluster) resumes from the newest
checkpoint its previous attempt left. That attempt may have been killed while writing one: a
truncated file, or a leftover temporary file (Ignite's ``DiskSaver`` writes ``tmpXXXXXXXX`` in the
checkpoint directory and renames it). Those are skipped with a warning naming them.

What is looked at is a :class:`Source`: one folder or several (Lightning's logger versions), the
names a file must start with (a ``prefix``: Ignite's ``Checkpoint`` of the trainer writes
``training_checkpoint_40.pt`` beside the ``best_model_*.pt`` of another ``Checkpoint``) and the keys
the load needs (a file that lacks one, a model-only file, is skipped with a warning naming the key).
Distributed checkpoints (``torch.distributed.checkpoint``: a directory per checkpoint, every rank's
shards and DCP's ``.metadata``) count beside files: a directory holding ``.metadata`` or ``.distcp``
shards, or named like a checkpoint file (Lightning's sharded ``epoch=0-step=10.ckpt``); it is
complete once ``.metadata`` is there (DCP writes it last), and for a ``.ckpt`` directory also
Lightning's ``meta.pt`` (written after it). :class:`~fault_tolerant_handlers.ignite.DCPSaver` writes
into ``tmp-<name>`` first, skipped as a temporary directory. Its age is that of its metadata.

Checkpoint names recognised: anything ending in ``.pt``, ``.pth`` or ``.ckpt``: Ignite's
``Checkpoint``/``DiskSaver`` (``checkpoint_40.pt``, ``best_model_3_val_loss=0.1.pt``), Lightning's
``ModelCheckpoint`` (``epoch=0-step=40.ckpt``, ``last.ckpt``, ``last-v1.ckpt``). Newest means the
latest modification time; a tie goes to the larger step number in the name.

How a file is checked, without running its pickle more than needed: a file written by
``torch.save`` is a zip archive whose directory is written last, so a torn file has none; every
member's CRC is verified (``zipfile.testzip``: bytes only, nothing unpickled). Then the pickle is
loaded with ``torch.load(weights_only=True, mmap=True)`` (the restricted unpickler, tensors mapped,
not read), and its top-level keys are compared with the required ones. A Lightning checkpoint may
hold objects the restricted unpickler refuses (hyper-parameters of custom types): such a file,
complete by its CRCs, is accepted (its keys unchecked) and left to Lightning's own loading, never
unpickled here without the restriction.

Every rank gets the same answer, and no rank waits for a peer that is not coming. Whenever the ranks
can talk (a process group is up: its store; or, before one, torchrun's store), every rank publishes
what it asks for (its folders and filters, as text) under a key naming the attempt and the call's
number, and rank 0 reads them all, then publishes one verdict: the path it chose, ``None``, or an
error. Ranks that asked for different folders all raise the same ``ValueError`` naming
each rank's folder (a folder only rank 0 knows, such as a timestamped output folder made on rank 0,
is such a mismatch: pass the same folder on every rank, or the trainer or its ``Checkpoint``, whose
folder on rank 0 serves every rank since only rank 0 writes it). A rank that does not call within
``FTH_CKPT_AGREE_TIMEOUT_SEC`` (default 300 s) is named in a ``TimeoutError`` on the ranks that did.
Only store keys are exchanged, never a collective, so a rank that skipped the call leaves its peers
waiting in nothing they cannot leave. Values are bytes, length-checked, decoded as UTF-8, never
unpickled. Without a group or torchrun's store each process decides alone.

After a recovery in place that carries on from live state (:mod:`.live`), the answer is a name in
the folder that no file has, ``live-state-step=<step>.pt``: :func:`~fault_tolerant_handlers.load_checkpoint`
and Lightning's ``fit(ckpt_path=...)`` hand over the live state for it. It is given for any folder
and without an exchange: every rank holds live state of the step they agreed on in the recovery.
"""

from __future__ import annotations

import logging
import os
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

SUFFIXES = (".pt", ".pth", ".ckpt")
#: DCP's metadata file, written last (a distributed checkpoint is complete once it exists).
DCP_METADATA = ".metadata"
#: What Lightning's sharded strategies write into a distributed checkpoint after DCP's shards.
LIGHTNING_META = "meta.pt"
#: Longest path or request text the ranks exchange (bytes).
MAX_PATH_BYTES = 4096
#: Longest verdict (an error naming every rank's folder, shortened).
MAX_VERDICT_BYTES = 16384
#: How long a rank waits for its peers' requests and for rank 0's verdict in the store
#: (``FTH_CKPT_AGREE_TIMEOUT_SEC``, default 300 s, see :mod:`..core.config`; the ranks other than 0
#: wait twice as long: rank 0's own wait, then its decision); read when it is needed.
_STEP = re.compile(r"(?:step=|_)(\d+)(?=[.-]|$)")
_calls: dict[str, int] = {}  # calls per attempt (its namespace)
_warned_missing: set[str] = set()  # folders already named as missing (once per process)


@dataclass(frozen=True)
class Source:
    """Where to look and what a usable file is.

    Attributes:
        folders: the folders searched together (the newest file among them wins).
        label: how messages name it; compared across ranks, so it is built from absolute paths.
        prefix: a file's name must start with it (``""``: any name).
        required_keys: top-level keys the load needs; a file without one is skipped with a warning.
        compared: this rank's request must match rank 0's (``False`` where the framework writes on
            rank 0 only, Ignite's ``DiskSaver``: another rank's folder is never read).
    """

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
    return Source((folder,), label_of((folder,), prefix, keys), prefix, keys)


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


def label_of(folders: tuple[Path, ...], prefix: str, keys: tuple[str, ...], kind: str = "") -> str:
    text = kind + (repr(str(folders[0])) if len(folders) == 1 else "[" + ", ".join(repr(str(f)) for f in folders) + "]")
    if prefix:
        text += f" (names starting with {prefix!r})"
    if keys:
        text += f" (keys {', '.join(keys)})"
    return text


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
        elif path.suffix != ".ckpt" and path.suffix not in SUFFIXES:
            return "not a torch.save archive"
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"unreadable: {type(err).__name__}: {err}"
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:  # noqa: BLE001
        text = str(err)
        if "Weights only load failed" in text and "unsupported global" in text.lower() and zipfile.is_zipfile(path):
            return None  # complete (CRCs checked); objects beyond tensors: left to the framework's own load
        first = first_line(text)
        return f"does not load: {type(err).__name__}: {first}"
    if required_keys:
        if not isinstance(loaded, Mapping):
            return f"holds a {type(loaded).__name__}, not the keys the load needs ({', '.join(required_keys)})"
        missing = [k for k in required_keys if k not in loaded]
        if missing:
            return (f"missing key {', '.join(repr(k) for k in missing)} (the load needs {', '.join(required_keys)}: "
                    "a file of another Checkpoint, such as a model-only best-model file?)")
    return None


def _is_distributed(path: Path) -> bool:
    """A directory that is (or was being written as) a distributed checkpoint: DCP's metadata or
    shards in it, or a name a checkpoint file would have (Lightning's sharded ``epoch=0-step=10.ckpt``)."""
    if path.suffix in SUFFIXES or (path / DCP_METADATA).exists():
        return True
    try:
        return any(child.suffix == ".distcp" for child in path.iterdir())
    except OSError:
        return False


def check_dir(path: Path) -> str | None:
    """``None`` if the directory ``path`` is a complete distributed checkpoint, else why not.

    DCP writes every rank's shards, then its ``.metadata`` (to a temporary name, renamed): without
    it the write did not finish. Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` write
    ``meta.pt`` (loops, callbacks) after it: a ``.ckpt`` directory needs it too, complete. The
    metadata is a pickle and is not loaded here."""
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
    """When a checkpoint was completed: a file's modification time; a directory's, of what was
    written last in it (its metadata)."""
    if path.is_dir():
        times = [p.stat().st_mtime_ns for p in (path / LIGHTNING_META, path / DCP_METADATA) if p.exists()]
        return max(times, default=path.stat().st_mtime_ns)
    return path.stat().st_mtime_ns


def candidates(source: Source) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The files and distributed checkpoints' directories of ``source``'s folders that may be
    checkpoints, newest first, and the temporary files
    skipped (with why). Missing folders give nothing."""
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


# -- the live state ----------------------------------------------------------------------------------------
def _live_claim(source: Source) -> str | None:
    """The live state's name while it is held: after a recovery in place every rank holds it for the
    same agreed step (a replaced process receives it), whatever folder each passes (a timestamp made
    at each call, a folder only rank 0 knows), so no exchange is needed."""
    return live.latest_checkpoint_answer(source.folders[0])


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
    spans, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


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


def _torchrun_store():
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("WORLD_SIZE", "1")) <= 1:
        return None
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=config.settings().ckpt_agree_timeout)


def _medium() -> tuple[dist.Store, int, int] | None:
    """(store, rank, world size) to agree over, or ``None`` to decide alone."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return compat_torch.default_store(), dist.get_rank(), dist.get_world_size()
    store = _torchrun_store()
    if store is None:
        return None
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise RuntimeError(f"latest_checkpoint: torchrun's RANK={rank!r} / WORLD_SIZE={world!r} are not a rank and a "
                           "size")
    return store, int(rank), int(world)


def find(source: Source) -> str | None:
    """The newest usable checkpoint of ``source`` (or the live state's name, or ``None``), the same on
    every rank; see the module."""
    name = _live_claim(source)
    if name is not None:
        return name
    medium = _medium()
    if medium is None:
        return _decide(source)
    store, rank, world = medium
    # The n-th call of this attempt (torchrun's restart and the recoveries in place: a replacement
    # process counts from 1 in the attempt it joins, like its peers).
    namespace = attempts.namespace()
    _calls[namespace] = count = _calls.get(namespace, 0) + 1
    key = f"fth/latest_checkpoint/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{namespace}/{count}"
    return agree(store, key, rank, world, source, config.settings().ckpt_agree_timeout)
