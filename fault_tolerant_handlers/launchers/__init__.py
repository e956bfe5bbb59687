"""What launchers read: torchrun's error files (its "Root Cause"), ``torch.multiprocessing``'s
error files and reports, the SIGTERM/SIGINT handler, torchrun's per-attempt store namespace, and
the rendezvous of a recovery in place (its phases' steps: :data:`STEPS`).
They stand on :mod:`..core` only."""

from ..core import events, phases
from ..core.phases import Phase
from . import compat_torchrun, errorfile, signals, spawned

#: What the launchers do on each of the core's events, in this order (emit runs them in order).
SUBSCRIPTIONS = (
    (events.SESSION_STARTED, compat_torchrun.on_session_started),  # torchrun, late import: the read gloo keys go
    (events.SESSION_STARTED, signals.on_session_started),  # SIGTERM/SIGINT handlers, in front
    (events.SESSION_STARTED, spawned.on_session_started),  # under mp.spawn: this rank reports itself
    (events.RANK_FAILED, errorfile.write_failed),  # torchrun: this rank's own file, the failure's time
    (events.RANK_FAILED, signals.on_rank_failed),  # a launcher's SIGTERM after it: exit code 1, not -15
    (events.PEER_FAILED, errorfile.on_peer_failed),  # torchrun: a killed same-host peer's file
    (events.PEER_FAILED, spawned.on_peer_failed),  # mp.spawn: the report, before the launcher's SIGTERM
    (events.ACKNOWLEDGED, errorfile.on_acknowledged),  # torchrun: a survivor's file
    (events.ACKNOWLEDGED, spawned.on_acknowledged),
    (events.JOB_FAILED, compat_torchrun.forget_attempt_keys),  # torchrun, late import: the next attempt comes up
    (events.EXITING, errorfile.on_exiting),
    (events.EXITING, spawned.on_exiting),  # mp.spawn: the report into torch's error file
    (events.RANK_KILLED, errorfile.write_killed),  # in the helper: the killed rank's torchrun file
    (events.RANK_ENDED, spawned.on_rank_ended),  # in the helper: mp.spawn's file, the zombie held
    (events.SESSION_CLOSED, compat_torchrun.on_session_closed),
)


#: What the launchers do in the phases of a recovery in place (:mod:`..core.phases`), registered at import.
STEPS = (
    (Phase.BEGIN, compat_torchrun.begin_recovery),  # keep the first rendezvous's store
    (Phase.WORLD, compat_torchrun.world_of_recovery),  # the store, rank and world size the attempts share
    (Phase.TEAR_DOWN, compat_torchrun.forget_addresses_of_attempt),  # before the groups go: this rank's keys
    (Phase.RE_FORM, compat_torchrun.re_form),  # init_process_group is given the store under the new namespace
    (Phase.END, compat_torchrun.end_recovery),  # the first rendezvous's store forgotten
)


def subscribe() -> None:
    """Subscribe the launchers to the core's events (at import; again after an ``unsubscribe``)."""
    for event, callback in SUBSCRIPTIONS:
        events.subscribe(event, callback)


def unsubscribe() -> None:
    for event, callback in SUBSCRIPTIONS:
        events.unsubscribe(event, callback)


subscribe()
for _phase, _step in STEPS:
    phases.register(_phase, _step)
