"""The few torch.distributed details the core relies on, in one place.

Private API: ``torch.distributed.distributed_c10d._get_default_store`` (checked against torch
2.4-2.13). It returns the store the default process group was created with, which every rank of
the job already shares; the core only adds a few keys under its own prefix to it.
"""

from __future__ import annotations

import os

import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def launcher_world_size() -> int:
    """The world size a launcher (torchrun, Lightning, idist) announced in the environment."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def default_store() -> dist.Store:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def default_group():
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_group()
