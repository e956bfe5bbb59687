"""What launchers read: torchrun's error files (its "Root Cause"), ``torch.multiprocessing``'s
error files and reports, the SIGTERM/SIGINT handler, torchrun's per-attempt store namespace, and
the rendezvous of a recovery in place. They stand on :mod:`..core` only, and plug into it through
its hooks (:mod:`..core.hooks`): :data:`HOOKS`, added at import."""

from ..core import hooks
from . import compat_torchrun, errorfile, signals, spawned

#: What the launchers do at each of the core's hooks, in this order (emit runs them in order).
HOOKS = (
    (hooks.SESSION_STARTED, compat_torchrun.on_session_started),  # torchrun, late import: the read gloo keys go
    (hooks.SESSION_STARTED, signals.on_session_started),  # SIGTERM/SIGINT handlers, in front
    (hooks.SESSION_STARTED, spawned.on_session_started),  # under mp.spawn: this rank reports itself
    (hooks.RANK_FAILED, errorfile.write_failed),  # torchrun: this rank's own file, the failure's time
    (hooks.RANK_FAILED, signals.on_rank_failed),  # a launcher's SIGTERM after it: exit code 1, not -15
    (hooks.PEER_FAILED, errorfile.on_peer_failed),  # torchrun: a killed same-host peer's file
    (hooks.PEER_FAILED, spawned.on_peer_failed),  # mp.spawn: the report, before the launcher's SIGTERM
    (hooks.ACKNOWLEDGED, errorfile.on_acknowledged),  # torchrun: a survivor's file
    (hooks.ACKNOWLEDGED, spawned.on_acknowledged),
    (hooks.JOB_FAILED, compat_torchrun.forget_attempt_keys),  # torchrun, late import: the next attempt comes up
    (hooks.EXITING, errorfile.on_exiting),
    (hooks.EXITING, spawned.on_exiting),  # mp.spawn: the report into torch's error file
    (hooks.RANK_KILLED, errorfile.write_killed),  # in the helper: the killed rank's torchrun file
    (hooks.RANK_ENDED, spawned.on_rank_ended),  # in the helper: mp.spawn's file, the zombie held
    (hooks.SESSION_CLOSED, compat_torchrun.on_session_closed),
    # recovering in place
    (hooks.WORLD, compat_torchrun.first_rendezvous),  # the store, rank and world size the attempts share
    (hooks.BEGIN, compat_torchrun.begin_recovery),  # keep the first rendezvous's store
    (hooks.TEAR_DOWN, compat_torchrun.forget_addresses_of_attempt),  # before the groups go: this rank's keys
    (hooks.RE_FORM, compat_torchrun.re_form),  # init_process_group is given the store under the new namespace
    (hooks.END, compat_torchrun.end_recovery),  # the first rendezvous's store forgotten
)


for _hook, _callback in HOOKS:
    hooks.add(_hook, _callback)
