"""The seeded dataset the resume and recovery programs train on (``resume_main.py``,
``inplace_launchers_main.py``): sample ``i`` is a fixed function of ``i`` only, so two runs that train
the same indices in the same order end with the same weights."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Regression(Dataset):
    """``length`` samples ``(i, x, y)``: ``x`` drawn from a generator seeded with ``i``, ``y`` a linear function of it."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return i, x, x.sum(0, keepdim=True) * 0.5 + 1.0
