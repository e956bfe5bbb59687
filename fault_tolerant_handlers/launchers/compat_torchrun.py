"""torchrun restarts: one store namespace per attempt (torch's private rendezvous table, in one place).

**The cause of ``Gloo connectFullMesh failed ... Connection refused`` on a restarted attempt.**
torchrun's rendezvous (``--standalone`` or ``--rdzv-backend c10d``) creates one ``TCPStore`` server
in the agent for the whole job and hands it to the workers (``TORCHELASTIC_USE_AGENT_STORE=True``,
``MASTER_PORT`` is that store). A restart re-uses the same store: it is created again only when the
agent's rank changes. The workers' ``env://`` / ``tcp://`` rendezvous (``_create_c10d_store``)
connect to it *without* a per-attempt prefix (its comment assumes "a new TCPStore for every
retry"). So every key of attempt N-1 is still there in attempt N, under the same names: the
default group's (``default_pg/0/...``) and those of every ``new_group``, named by a counter
(``1/``, ``2/``, ...: Lightning's groups, this library's side group). Gloo's ``connectFullMesh``
publishes each rank's listening address under such a key and reads its peers'; a rank that reads
before its peer of *this* attempt has written gets the address of the dead process of the attempt
before, and fails with ``Connection refused`` to a port nobody listens on. Whether it happens is a
race between the ranks' start-up times: Lightning's ranks (slower imports, a second group) lose it
often, and each extra group (the side group) is one more chance to lose it.

**The fix.** Under torchrun with the agent store, the ``env`` and ``tcp`` rendezvous handlers are
wrapped so that the store they give ``init_process_group`` is
``PrefixStore("fth/attempt_<TORCHELASTIC_RESTART_COUNT>", store)``: every key of every group of
an attempt lives in that attempt's namespace, and nothing of an earlier attempt can be read.
Installed when ``fault_tolerant_handlers`` is imported (before ``init_process_group``: Lightning
calls it inside ``fit``; for your own ``init_process_group``, import the library first).
``FTH_ATTEMPT_STORE=0`` turns it off; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's own
environment is the launcher-side alternative (a new store per attempt, on a new port).

It assumes every node counts the same attempts (a fixed number of nodes): with elastic membership
(``--nnodes MIN:MAX``) a node that joins later counts from 0 and would not meet the others' prefix;
use ``FTH_ATTEMPT_STORE=0`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` there.

Private API: ``torch.distributed.rendezvous._rendezvous_handlers`` (the scheme -> handler table that
``init_process_group`` consults at each call), checked against torch 2.13.0.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

from ..core import config
from ..core.log import log

#: Set to ``0`` to leave torch's rendezvous alone.
ATTEMPT_STORE_ENV = "FTH_ATTEMPT_STORE"
_WRAPPED_ATTR = "_fth_attempt_wrapped"
_SCHEMES = ("env", "tcp")


def attempt() -> int:
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return int(value) if value.isdigit() else 0


def prefix() -> str:
    return f"fth/attempt_{attempt()}"


def _needed() -> bool:
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and config.attempt_store())


def _table() -> dict:
    import importlib

    try:  # the module (``torch.distributed.rendezvous`` the attribute is a function of the same name)
        rendezvous = importlib.import_module("torch.distributed.rendezvous")
    except ImportError:  # torch built without distributed
        return {}
    table = getattr(rendezvous, "_rendezvous_handlers", None)
    missing = [s for s in _SCHEMES if not isinstance(table, dict) or s not in table]
    if missing:
        raise RuntimeError(
            "fault_tolerant_handlers: torch.distributed.rendezvous._rendezvous_handlers "
            f"{'is missing' if not isinstance(table, dict) else 'has no handler for ' + ', '.join(missing)} "
            f"(torch {__import__('torch').__version__}); restarts under torchrun cannot be isolated per attempt. "
            f"Set {ATTEMPT_STORE_ENV}=0 to go on without it, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun"
        )
    return table


def _wrap(handler):
    def per_attempt(url: str, **kwargs: Any) -> Iterator[tuple]:
        import torch.distributed as dist

        for store, rank, world_size in handler(url, **kwargs):
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                store = dist.PrefixStore(prefix(), store)
            yield store, rank, world_size

    setattr(per_attempt, _WRAPPED_ATTR, True)
    per_attempt.__wrapped__ = handler  # type: ignore[attr-defined]
    return per_attempt


def install() -> bool:
    """Wrap the rendezvous handlers (idempotent). True when installed."""
    if not _needed():
        return False
    table = _table()
    if not table:
        return False
    for scheme in _SCHEMES:
        if not getattr(table[scheme], _WRAPPED_ATTR, False):
            table[scheme] = _wrap(table[scheme])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        log(logging.WARNING, "the process group was initialized before fault_tolerant_handlers was imported: "
            "under torchrun its keys are not isolated per attempt, and a restarted attempt may fail in gloo's "
            "connectFullMesh; import fault_tolerant_handlers before init_process_group")
    return True
