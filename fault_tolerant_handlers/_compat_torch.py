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
=====================================================  ==============================================
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


def backend_error_types() -> tuple[type[BaseException], ...]:
    """torch's ``DistError`` family (public): what NCCL, the store and the network raise."""
    return tuple(t for t in (getattr(dist, "DistError", None),) if isinstance(t, type))
