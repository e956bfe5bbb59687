"""``latest_checkpoint(dirname)``: the newest complete checkpoint to resume from, the same on every rank.

A job restarted by ``torchrun --max-restarts`` (or requeued by its cluster) resumes from the newest
checkpoint its previous attempt left. That attempt may have been killed while writing one: a
truncated file, or a leftover temporary file (Ignite's ``DiskSaver`` writes ``tmpXXXXXXXX`` in the
checkpoint directory and renames it). ``latest_checkpoint`` skips those with a warning naming them.

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
not read). Ignite's ``Checkpoint.load_objects`` loads with ``weights_only=True`` too; a Lightning
checkpoint may hold objects the restricted unpickler refuses (hyper-parameters of custom types):
such a file, complete by its CRCs, is accepted and left to Lightning's own loading, never
unpickled here without the restriction.

Every rank gets the same answer: with a process group up, rank 0 decides and broadcasts the path
(a byte tensor on the default group). Without one but under torchrun (Lightning creates its group
inside ``fit``, after this is called), rank 0 publishes it in torchrun's store under a key that
names the attempt (``TORCHELASTIC_RESTART_COUNT``) and the call's number, and the other ranks read
it: bytes, length-checked, decoded as UTF-8, never unpickled. Otherwise each process decides alone.

After a recovery in place that carries on from live state (:mod:`.live`), the answer is a name in
``dirname`` that no file has, ``live-state-step=<step>.pt``: :func:`~fault_tolerant_handlers.load_checkpoint`
and Lightning's ``fit(ckpt_path=...)`` hand over the live state for it. Every rank answers so without
communicating (they agreed on it in the recovery).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
import zipfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..core import attempts, config, interrupts
from ..core.log import log
from . import live

__all__ = ["latest_checkpoint"]

SUFFIXES = (".pt", ".pth", ".ckpt")
#: DCP's metadata file, written last (a distributed checkpoint is complete once it exists).
DCP_METADATA = ".metadata"
#: What Lightning's sharded strategies write into a distributed checkpoint after DCP's shards.
LIGHTNING_META = "meta.pt"
#: Longest path the ranks exchange (bytes).
MAX_PATH_BYTES = 4096
#: How long a rank waits for rank 0's answer in torchrun's store (``FTH_CKPT_AGREE_TIMEOUT_SEC``,
#: default 300 s, see :mod:`..core.config`); read when it is needed.
_STEP = re.compile(r"(?:step=|_)(\d+)(?=[.-]|$)")
_calls: dict[str, int] = {}  # calls of latest_checkpoint per attempt (its namespace)


def _step_of(name: str) -> int:
    found = _STEP.findall(Path(name).stem)
    return int(found[-1]) if found else -1


def _is_temporary(name: str) -> bool:
    return name.startswith("tmp") and Path(name).suffix not in SUFFIXES or name.endswith((".tmp", ".part"))


def check_file(path: Path) -> str | None:
    """``None`` if ``path`` is a complete checkpoint, else why not."""
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
        torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:  # noqa: BLE001
        text = str(err)
        if "Weights only load failed" in text and "unsupported global" in text.lower() and zipfile.is_zipfile(path):
            return None  # complete (CRCs checked); objects beyond tensors: left to the framework's own load
        first = text.splitlines()[0][:200] if text else ""
        return f"does not load: {type(err).__name__}: {first}"
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


def _decide(dirname: Path) -> str | None:
    if not dirname.is_dir():
        return None
    candidates, skipped = [], []
    for entry in dirname.iterdir():
        is_dir = entry.is_dir()
        if not entry.is_file() and not (is_dir and _is_distributed(entry)):
            continue
        if _is_temporary(entry.name):
            skipped.append((entry, f"a temporary {'directory' if is_dir else 'file'} (a write that did not finish)"))
            continue
        if is_dir or entry.suffix in SUFFIXES:
            candidates.append(entry)
    candidates.sort(key=lambda p: (_mtime_ns(p), _step_of(p.name), p.name), reverse=True)
    chosen = None
    for path in candidates:
        why = check_dir(path) if path.is_dir() else check_file(path)
        if why is None:
            chosen = path
            break
        skipped.append((path, why))
    for path, why in skipped:
        message = f"latest_checkpoint({str(dirname)!r}): skipping {path.name}: {why}"
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        log(logging.WARNING, "%s", message)
    return str(chosen) if chosen is not None else None


def _encode(path: str | None) -> bytes:
    data = b"" if path is None else path.encode("utf-8")
    if len(data) > MAX_PATH_BYTES:
        raise ValueError(f"latest_checkpoint: path longer than {MAX_PATH_BYTES} bytes: {path[:100]}...")
    return b"\x00" if path is None else b"\x01" + data


def _decode(data: bytes) -> str | None:
    if not data or len(data) > MAX_PATH_BYTES + 1 or data[:1] not in (b"\x00", b"\x01"):
        raise RuntimeError(f"latest_checkpoint: rank 0's answer is malformed ({len(data)} bytes)")
    return None if data[:1] == b"\x00" else data[1:].decode("utf-8")


def _broadcast(answer: str | None) -> str | None:
    rank = dist.get_rank()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    payload = _encode(answer) if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if not 0 < n <= MAX_PATH_BYTES + 1:
        raise RuntimeError(f"latest_checkpoint: rank 0 announced an answer of {n} bytes")
    buf = torch.zeros(n, dtype=torch.uint8, device=device)
    if rank == 0:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return _decode(bytes(buf.cpu().tolist()))


def _torchrun_store():
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("WORLD_SIZE", "1")) <= 1:
        return None
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=config.ckpt_agree_timeout())


def latest_checkpoint(dirname: str | os.PathLike) -> str | None:
    """The newest complete, loadable checkpoint in ``dirname`` (a file, or a distributed checkpoint's
    directory), or ``None``; the same on every rank.

    Torn files (a kill during the write) and leftover temporary files are skipped with a
    ``RuntimeWarning`` naming them. Call it on every rank, the same number of times (like a
    collective), before or after the process group is set up.

    Examples:
        .. code-block:: python

            # Ignite
            path = latest_checkpoint("ckpts")
            if path:
                Checkpoint.load_objects(to_load=to_save, checkpoint=path)
            trainer.run(loader, max_epochs=3)

            # Lightning
            trainer.fit(model, loader, ckpt_path=latest_checkpoint("ckpts"))

    Raises:
        TypeError: ``dirname`` is not a str or path.
    """
    if not isinstance(dirname, (str, os.PathLike)):
        raise TypeError(f"latest_checkpoint(dirname={dirname!r}): expected a str or os.PathLike")
    folder = Path(dirname)
    live_name = live.latest_checkpoint_answer(folder)
    if live_name is not None:  # recovering in place from live state: every rank holds the same plan
        return live_name
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return _broadcast(_decide(folder) if dist.get_rank() == 0 else None)
    store = _torchrun_store()
    if store is None:
        return _decide(folder)
    # The n-th call of this attempt (torchrun's restart and the recoveries in place: a replacement
    # process counts from 1 in the attempt it joins, like its peers).
    namespace = attempts.namespace()
    _calls[namespace] = count = _calls.get(namespace, 0) + 1
    key = f"fth/latest_checkpoint/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{namespace}/{count}"
    if int(os.environ.get("RANK", "0")) == 0:
        answer = _decide(folder)
        with interrupts.SECTION:  # a main-thread store call: a hung rank's interrupt waits for it
            store.set(key, _encode(answer))
        return answer
    return _decode(store.get(key))
