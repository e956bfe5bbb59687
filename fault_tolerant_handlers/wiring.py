"""How the package is assembled: every part a layer plays at the core's hooks (:mod:`.core.hooks`),
in one table, in the order each hook runs them (docs/architecture.md, "The wiring").

No layer adds itself to a hook when it is imported: :func:`install` adds :data:`WIRING` once, when the
package is imported. A step marked :data:`TOLERATE` is logged when it fails and the recovery goes on
(a framework the next attempt may not use must not stop it); a provider is the last one listed. Only
a user adds to a hook outside the table (:func:`~.core.recoveries.on_recovery`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from . import adapters
from .adapters import compat_ignite
from .core import hooks, recoveries
from .data import compat_dataloader, live, snapshots
from .detect import watchdog, writes
from .launchers import compat_torchrun, reports, signals
from .recover import inplace, keeper

#: A recovery step whose failure is logged while the recovery goes on.
TOLERATE = True


def _framework(module: str, name: str) -> Callable[..., Any]:
    """``<module>.<name>``, called only once ``module`` (an adapter whose framework may not be
    installed) was imported: before that no engine or trainer of its framework exists to be told."""
    path = f"{__package__}.{module}"

    def call(*args: Any) -> Any:
        found = sys.modules.get(path)
        return None if found is None else getattr(found, name)(*args)

    call.__qualname__ = f"{module}.{name}"
    return call


_ignite_hook = _framework("ignite", "_hook")  # Ignite's FAILURE_SEEN / RECOVERY_STARTED events
_lightning_hook = _framework("lightning", "_hook")  # Lightning's on_failure_seen / on_recovery_started

#: Every hook registration of the package: ``(hook, callback)`` or ``(hook, step, TOLERATE)``.
WIRING: tuple[tuple[Any, ...], ...] = (
    # -- announcements ----------------------------------------------------------------------------------
    (hooks.SESSION_STARTED, signals.install),  # SIGTERM/SIGINT handlers, in front
    (hooks.SESSION_STARTED, reports.on_session_started),  # mp.spawn: this rank reports itself; torchrun, imported late
    (hooks.SESSION_STARTED, keeper.on_session_started),  # a keeper's child: its peers may wait for a replacement
    # the launchers' part of a failure, in one module: torchrun's error files, mp.spawn's report
    (hooks.RANK_FAILED, reports.on_rank_failed),  # this rank's own file; a launcher's SIGTERM after it: exit code 1
    (hooks.PEER_FAILED, reports.on_peer_failed),  # a killed same-host peer's file; mp.spawn: the report
    (hooks.ACKNOWLEDGED, reports.on_acknowledged),  # a survivor's file; mp.spawn: the report
    (hooks.JOB_FAILED, reports.on_job_failed),  # torchrun, imported late: the next attempt comes up
    (hooks.EXITING, reports.on_exiting),  # a survivor's file (exit 87); mp.spawn: the report into torch's file
    (hooks.RANK_KILLED, reports.write_killed),  # in the liveness helper: the killed rank's torchrun file
    (hooks.RANK_ENDED, reports.hold_zombie),  # in the liveness helper: mp.spawn's file, the zombie held
    (hooks.SESSION_CLOSED, reports.on_session_closed),  # torchrun, imported late: its store connection
    # a recovery made visible: the history first (a subscriber that reads it finds its info there)
    (hooks.FAILURE_SEEN, recoveries._record),
    (hooks.FAILURE_SEEN, _ignite_hook),
    (hooks.FAILURE_SEEN, _lightning_hook),
    (hooks.RECOVERY_STARTED, recoveries._record),
    (hooks.RECOVERY_STARTED, _ignite_hook),
    (hooks.RECOVERY_STARTED, _lightning_hook),
    (hooks.RECOVERED, recoveries._record),
    # -- the steps of a recovery in place, in the order the recovery reaches them -------------------------
    (hooks.BEGIN, compat_torchrun.begin_recovery),  # keep the first rendezvous's store
    (hooks.CAPTURE_LIVE, live.capture_live),  # this rank's live state of the failed attempt, or why none
    (hooks.SETTLE_LIVE, live.settle_live),  # hold what the next attempt resumes from
    # Ignite's Checkpoint.load_objects resolves the live state's name (a keeper's replacement runs no teardown)
    (hooks.SETTLE_LIVE, adapters._resolve_live_names, TOLERATE),
    (hooks.TEAR_DOWN, compat_torchrun.forget_addresses_of_attempt),  # before the groups go: this rank's keys
    (hooks.RESET_FRAMEWORKS, compat_ignite.reset_idist, TOLERATE),  # idist's model back to a fresh process's
    (hooks.RESET_FRAMEWORKS, adapters._resolve_live_names, TOLERATE),
    (hooks.RESET_FRAMEWORKS, adapters.keep_logger_versions, TOLERATE),  # Lightning's loggers keep their version
    (hooks.COLLECTED, compat_dataloader.reap_workers),  # DataLoader workers of the failed attempt still running
    (hooks.RE_FORM, compat_torchrun.re_form),  # init_process_group is given the store under the new namespace
    (hooks.RE_FORM, reports.forget_own_file),  # torchrun: the recovered failure's file goes (a later one writes)
    (hooks.RE_FORM, adapters.take_logger_versions, TOLERATE),  # a replacement: rank 0's logger versions
    (hooks.END, compat_torchrun.end_recovery),  # the first rendezvous's store forgotten
    (hooks.END, snapshots.end_recovery),  # the checkpoint's copy in memory and the live state forgotten
    (hooks.END, adapters.forget_logger_versions, TOLERATE),
    # -- providers ------------------------------------------------------------------------------------------
    (hooks.WORLD, compat_torchrun.first_rendezvous),  # the store, rank and world size a recovery's attempts share
    (hooks.WATCHDOG, watchdog.Watchdog),  # what Session.start_watchdog starts
    (hooks.DEFER, writes.stack_writes),  # the interrupt of a hung main thread waits for a write its stack shows
    (hooks.INTERRUPT, inplace.interrupt),  # recovering in place: the hung main thread raises into the recovery
    (hooks.LOSE, keeper.lose),  # a keeper's child lost for good: its keeper does not replace it
    (hooks.KEEPER_PID, keeper.keeper_pid),  # a keeper's child: the process that would replace it
)


def install() -> None:
    """Add :data:`WIRING` to the hooks (once: adding a callback again changes nothing)."""
    for hook, callback, *tolerate in WIRING:
        hooks.add(hook, callback, tolerate=bool(tolerate))
