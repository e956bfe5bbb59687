"""Every use of torch's private API, in one place, checked when a session starts.

Checked against torch 2.13.0 (the version the test suite runs). ``Store.clone`` exists from torch
2.8 on, which is why the project requires ``torch>=2.8``; the private names below are looked up by
:func:`check` when the first fail-together session starts, and a torch that lacks one fails there
with an error naming it, never later and never silently.

=====================================================  ==============================================
``torch.distributed.distributed_c10d._get_default_store``  the store the default group was created with
``torch.distributed.distributed_c10d._get_default_group``  the default process group (registry key)
``torch.distributed.distributed_c10d._world.pg_map``        every process group of this process (release)
``torch.distributed.distributed_c10d._abort_process_group`` abort an NCCL/XCCL group (release)
``torch.distributed.Store.clone``                            a new connection to the same store (public, 2.8+)
``torch.multiprocessing.spawn._wrap``, local ``error_file``  a rank started by ``mp.spawn`` and its error file
=====================================================  ==============================================

``_wrap`` is only looked for on the main thread's stack (:func:`spawn_error_file`): a torch whose
``mp.spawn`` no longer has it is reported as not spawned, so the rank's report is printed by the
interpreter as under any other launcher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

CHECKED_AGAINST = ("2.13.0",)

_REQUIRED = (
    ("torch.distributed.distributed_c10d", "_get_default_store"),
    ("torch.distributed.distributed_c10d", "_get_default_group"),
    ("torch.distributed.distributed_c10d", "_world"),
    ("torch.distributed.distributed_c10d._world", "pg_map"),
    ("torch.distributed.distributed_c10d", "_abort_process_group"),
    ("torch.distributed.Store", "clone"),
)

_checked = False


def _resolve(path: str) -> Any:
    from torch.distributed import distributed_c10d

    objects = {
        "torch.distributed.distributed_c10d": distributed_c10d,
        "torch.distributed.distributed_c10d._world": getattr(distributed_c10d, "_world", None),
        "torch.distributed.Store": dist.Store,
    }
    return objects[path]


def check() -> None:
    """Raise ``RuntimeError`` naming every private torch attribute this version lacks."""
    global _checked
    if _checked:
        return
    missing = [f"{owner}.{name}" for owner, name in _REQUIRED if not hasattr(_resolve(owner), name)]
    if missing:
        raise RuntimeError(
            f"fault-tolerant-handlers needs {', '.join(missing)}, which torch {torch.__version__} does not have "
            f"(checked against torch {', '.join(CHECKED_AGAINST)}; torch>=2.8 is required)"
        )
    _checked = True


def default_store() -> dist.Store:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def default_group() -> dist.ProcessGroup:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_group()


def process_groups() -> list[dist.ProcessGroup]:
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map.keys())


def abort_process_group(group: dist.ProcessGroup) -> None:
    from torch.distributed import distributed_c10d

    distributed_c10d._abort_process_group(group)


def spawn_error_file() -> str | None:
    """``None`` unless the main thread runs inside ``torch.multiprocessing.spawn._wrap`` (``mp.spawn``
    and ``start_processes``); then the path of the error file that ``_wrap`` would write and the parent
    reads (a pickled ``str``), or ``""`` when that frame holds none."""
    import os
    import sys
    import threading

    frame = sys._current_frames().get(threading.main_thread().ident)
    suffix = os.path.join("torch", "multiprocessing", "spawn.py")
    depth = 0
    while frame is not None and depth < 256:
        code = frame.f_code
        if code.co_name == "_wrap" and code.co_filename.endswith(suffix):
            path = frame.f_locals.get("error_file")
            return path if isinstance(path, str) else ""
        frame = frame.f_back
        depth += 1
    return None


def tcp_store_of(store: dist.Store | None) -> dist.TCPStore | None:
    """The ``TCPStore`` under ``store``'s ``PrefixStore`` wrappers (public ``underlying_store``)."""
    for _ in range(16):
        if store is None or isinstance(store, dist.TCPStore):
            return store
        store = getattr(store, "underlying_store", None)
    return None


def backend_error_types() -> tuple[type[BaseException], ...]:
    """torch's ``DistError`` family (public): what NCCL, the store and the network raise."""
    return tuple(t for t in (getattr(dist, "DistError", None),) if isinstance(t, type))
