"""A DDP model's bucket layout, saved with the checkpoint, so that a resumed run reduces its first
iteration in the buckets the uninterrupted run had rebuilt (docs/recovering.md, "At any world size")."""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ..core import compat_torch as _compat_torch
from ..core.hooks import log

__all__ = ["DDPBucketLayout"]


class DDPBucketLayout:
    """The bucket layout of a ``DistributedDataParallel`` model, as a checkpointable object.

    ``state_dict()`` is ``{"buckets": [[index, ...], ...]}``, the parameter indices of each rebuilt
    bucket (``None`` before, and with ``find_unused_parameters=True``); ``load_state_dict`` gives the
    DDP a reducer built with them. The Ignite and Lightning ``FaultTolerance`` do this by themselves;
    with a loop of your own, put it in the checkpoint beside the model.

    Args:
        ddp: the ``torch.nn.parallel.DistributedDataParallel`` model (what ``idist.auto_model``
            returns under a distributed launcher).

    Raises:
        TypeError: ``ddp`` is not a ``DistributedDataParallel``.
        RuntimeError: this torch lacks a private name the layout needs (named; checked against
            torch 2.13); ``load_state_dict``: a DDP with a builtin comm hook or an optimizer applied in
            backward.
        ValueError: ``load_state_dict``: a layout that does not fit the model's parameters.

    Examples:
        .. code-block:: python

            ddp = idist.auto_model(model)       # or DistributedDataParallel(model)
            to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "loader": loader,
                       "ddp": DDPBucketLayout(ddp)}
            if path := latest_checkpoint("ckpts"):
                Checkpoint.load_objects(to_load=to_save, checkpoint=load_checkpoint(path))
            trainer.run(loader, max_epochs=3)

    .. warning::
        Load it before the first step of the new DDP. Wrong: loading the checkpoint from a handler of
        ``Events.ITERATION_STARTED`` after a step trained. Correct: before ``trainer.run``.
    """

    def __init__(self, ddp: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"DDPBucketLayout(ddp=...) takes a torch.nn.parallel.DistributedDataParallel, "
                            f"got {type(ddp).__name__}")
        _compat_torch.check_ddp(ddp)
        self.ddp = ddp
        self._given: list[list[int]] | None = None  # the layout load_state_dict gave the DDP

    @property
    def buckets(self) -> list[list[int]] | None:
        """The layout the DDP reduces in from now on, if known (see ``state_dict``)."""
        return _compat_torch.ddp_bucket_layout(self.ddp) or self._given

    def state_dict(self) -> dict[str, Any]:
        return {"buckets": self.buckets}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        buckets = state_dict.get("buckets")
        if buckets is None:
            return  # saved before the DDP rebuilt its buckets (or never does): its first layout is right
        if not isinstance(buckets, (list, tuple)) or not all(
                isinstance(b, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in b)
                for b in buckets):
            raise ValueError(f"state_dict['buckets'] must be a list of lists of parameter indices, got {buckets!r}")
        layout = [list(b) for b in buckets]
        if layout == _compat_torch.ddp_bucket_layout(self.ddp) or layout == self._given:
            return  # it reduces in them already
        _compat_torch.use_ddp_bucket_layout(self.ddp, layout)
        self._given = layout
        log(logging.INFO, "DDP reduces in the checkpoint's %d bucket(s) from its first step (as the "
            "uninterrupted run did)", len(layout))
