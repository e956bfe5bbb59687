"""Every setting of the library: its argument or environment variable, default and accepted range.

Timeouts are ``datetime.timedelta`` values; each environment override is a number of seconds, in a
documented range. Every ``FTH_*`` variable is read and checked when a fail-together session starts
(and when an adapter is constructed), so a bad value stops the job at once with an error naming the
variable and its accepted range, never later inside a watchdog thread.

==============================  =========  ====================  ======================================
variable                        default    accepted              meaning
==============================  =========  ====================  ======================================
``FTH_WATCHDOG_INTERVAL_SEC``   0.1        0.01 .. 10            watchdog poll period
``FTH_HANG_TIMEOUT_SEC``        (off)      1 .. 604800, auto     opt-in hang detection (``auto``: learned;
                                 DD:HH:MM:SS also)
``FTH_START_TIMEOUT_SEC``       600        1 .. 604800           a set ``hang_timeout`` applies from the
                                                                 first completed iteration; before it
                                                                 (workers starting, DDP's first pass, a
                                                                 cold store, a compile) this one does
``FTH_AUTO_HANG_MULTIPLE``      10         1 .. 1000             ``auto``: deadline = multiple x longest
``FTH_AUTO_HANG_FLOOR_SEC``     60         1 .. 604800           ``auto``: no deadline below this
``FTH_AUTO_HANG_WARMUP``        20         1 .. 1000000          ``auto``: training steps before judging
``FTH_EXIT_GRACE_SEC``          3          0.1 .. 3600           released rank: time to take the failure
``FTH_WRITE_GRACE_SEC``         120        0 .. 3600             reported exit waits for a checkpoint write
``FTH_HEARTBEAT_TIMEOUT_SEC``   2          1 .. 86400            a peer whose heartbeat stops is lost
``FTH_STORE_LOST_SEC``          4          1 .. 86400            a store that does not answer, its port
                                                                 refused or unreachable all along, is
                                                                 lost (a slow store never is)
``FTH_SYNC_TIMEOUT_SEC``        (group's)  1 .. 2592000          the side group's timeout
``FTH_RELEASE``                 auto       auto, exit            how blocked collectives are released
``FTH_INJECT``                  (none)     see ``inject.py``     rehearse a failure
``FTH_CKPT_AGREE_TIMEOUT_SEC``  300        1 .. 86400            ``latest_checkpoint``: rank 0 waits
                                                                 this long for every rank's question,
                                                                 the others twice as long for its answer
``FTH_ATTEMPT_STORE``           1          0, 1                  one store namespace per torchrun attempt
``FTH_RECOVER_JOIN_SEC``        60         1 .. 86400            recovering in place: every rank must reach
                                                                 the recovery this soon after the first
``FTH_SNAPSHOT``                1          0, 1                  recovering in place: the newest checkpoint
                                                                 also kept in memory (data.snapshots)
``FTH_INTERRUPT_DEFER_SEC``     30         0.1 .. 3600           recovering in place: a deferred section
                                                                 (a checkpoint write, a store call,
                                                                 ``deferred_interrupt``) holds a hung
                                                                 rank's interrupt back this long at most
``FTH_LIVE_STATE``              1          0, 1                  recovering in place: carry on from the
                                                                 ranks' live state at the last completed
                                                                 step, not the newest checkpoint
                                                                 (data.live)
==============================  =========  ====================  ======================================
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from datetime import timedelta

from . import attempts, inject
from .log import log

INTERVAL_ENV = "FTH_WATCHDOG_INTERVAL_SEC"
HANG_TIMEOUT_ENV = "FTH_HANG_TIMEOUT_SEC"
START_TIMEOUT_ENV = "FTH_START_TIMEOUT_SEC"
EXIT_GRACE_ENV = "FTH_EXIT_GRACE_SEC"
WRITE_GRACE_ENV = "FTH_WRITE_GRACE_SEC"
HEARTBEAT_TIMEOUT_ENV = "FTH_HEARTBEAT_TIMEOUT_SEC"
STORE_LOST_ENV = "FTH_STORE_LOST_SEC"
SYNC_TIMEOUT_ENV = "FTH_SYNC_TIMEOUT_SEC"
RELEASE_ENV = "FTH_RELEASE"
INJECT_ENV = "FTH_INJECT"
CKPT_AGREE_TIMEOUT_ENV = "FTH_CKPT_AGREE_TIMEOUT_SEC"
ATTEMPT_STORE_ENV = "FTH_ATTEMPT_STORE"
ATTEMPT_STORE_CHOICES = ("0", "1")
AUTO_HANG_MULTIPLE_ENV = "FTH_AUTO_HANG_MULTIPLE"
AUTO_HANG_FLOOR_ENV = "FTH_AUTO_HANG_FLOOR_SEC"
AUTO_HANG_WARMUP_ENV = "FTH_AUTO_HANG_WARMUP"
RECOVER_JOIN_ENV = "FTH_RECOVER_JOIN_SEC"
SNAPSHOT_ENV = "FTH_SNAPSHOT"
INTERRUPT_DEFER_ENV = "FTH_INTERRUPT_DEFER_SEC"
LIVE_STATE_ENV = "FTH_LIVE_STATE"
SPARE_WAIT_ENV = "FTH_SPARE_WAIT_SEC"
#: ``hang_timeout="auto"``: the deadline is learned from the run (:mod:`..detect.autohang`).
AUTO = "auto"

RELEASE_CHOICES = ("auto", "exit")

#: (low, high) in seconds, inclusive, for every timeout setting (argument and variable alike).
RANGES: dict[str, tuple[float, float]] = {
    "interval": (0.01, 10.0),
    "hang_timeout": (1.0, 7 * 86400.0),
    "start_timeout": (1.0, 7 * 86400.0),
    "exit_grace": (0.1, 3600.0),
    "write_grace": (0.0, 3600.0),
    "heartbeat_timeout": (1.0, 86400.0),
    "store_lost_after": (1.0, 86400.0),
    "sync_timeout": (1.0, 30 * 86400.0),
    "ckpt_agree_timeout": (1.0, 86400.0),
    "recover_join_timeout": (1.0, 86400.0),
    "interrupt_defer": (0.1, 3600.0),
    "spare_wait": (1.0, 3600.0),
}
_ENV_OF = {
    "interval": INTERVAL_ENV,
    "hang_timeout": HANG_TIMEOUT_ENV,
    "start_timeout": START_TIMEOUT_ENV,
    "exit_grace": EXIT_GRACE_ENV,
    "write_grace": WRITE_GRACE_ENV,
    "heartbeat_timeout": HEARTBEAT_TIMEOUT_ENV,
    "store_lost_after": STORE_LOST_ENV,
    "sync_timeout": SYNC_TIMEOUT_ENV,
    "ckpt_agree_timeout": CKPT_AGREE_TIMEOUT_ENV,
    "recover_join_timeout": RECOVER_JOIN_ENV,
    "interrupt_defer": INTERRUPT_DEFER_ENV,
    "spare_wait": SPARE_WAIT_ENV,
}
KNOWN_ENV = (*_ENV_OF.values(), RELEASE_ENV, INJECT_ENV, ATTEMPT_STORE_ENV, SNAPSHOT_ENV, LIVE_STATE_ENV,
             AUTO_HANG_MULTIPLE_ENV,
             AUTO_HANG_FLOOR_ENV, AUTO_HANG_WARMUP_ENV)


def _range_text(name: str) -> str:
    low, high = RANGES[name]
    return f"{low:.15g} and {high:.15g} seconds"


def check_timedelta(name: str, value: object, *, allow_none: bool = False, what: str | None = None) -> timedelta | None:
    """``value`` as a timedelta in the accepted range of setting ``name``; a clear error otherwise."""
    label = what or name
    if value is None and allow_none:
        return None
    if not isinstance(value, timedelta):
        hint = " or None" if allow_none else ""
        raise TypeError(f"{label} must be a datetime.timedelta{hint} (e.g. timedelta(seconds=5)), got {value!r}")
    seconds = value.total_seconds()
    low, high = RANGES[name]
    if not low <= seconds <= high:
        raise ValueError(f"{label} must be between {_range_text(name)}, got {value!r}")
    return value


#: The forms ``hang_timeout`` accepts, as error messages name them.
HANG_TIMEOUT_FORMS = ("None (off), a datetime.timedelta (e.g. timedelta(minutes=5)), a number of seconds (e.g. 300), "
                      "a 'DD:HH:MM:SS' string (e.g. '00:00:05:00'), a dict of timedelta arguments (e.g. "
                      "{'minutes': 5}) or 'auto' (a deadline learned from the run)")
#: The forms ``recover_in_place(join_timeout=...)`` accepts: those of ``hang_timeout`` but ``'auto'``
#: (no deadline is learned for ranks meeting at a recovery).
JOIN_TIMEOUT_FORMS = ("None (FTH_RECOVER_JOIN_SEC, else 60 s), a datetime.timedelta (e.g. timedelta(minutes=2)), "
                      "a number of seconds (e.g. 120), a 'DD:HH:MM:SS' string (e.g. '00:00:02:00') or a dict of "
                      "timedelta arguments (e.g. {'minutes': 2})")
_DHMS = re.compile(r"\s*(\d+):(\d+):(\d+):(\d+)\s*")


def _as_timedelta(value: object) -> timedelta | None:
    """A number of seconds, a ``"DD:HH:MM:SS"`` string or a dict of ``timedelta`` arguments (the
    forms Lightning's ``Timer(duration=...)`` takes, for YAML, LightningCLI and Hydra configs) as a
    ``timedelta``; ``None`` for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value) if math.isfinite(value) and abs(value) < 1e12 else timedelta.max
    if isinstance(value, str):
        match = _DHMS.fullmatch(value)
        if match is None:
            return None
        days, hours, minutes, seconds = (int(part) for part in match.groups())
        try:
            return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        except OverflowError:
            return timedelta.max
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        try:
            return timedelta(**value)
        except (TypeError, ValueError, OverflowError):
            return None
    return None


#: The keys a dict duration may have (``datetime.timedelta``'s keyword arguments).
TIMEDELTA_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def _check_dict_keys(value: object, what: str, forms: str) -> None:
    """A dict duration with a key ``timedelta`` does not take: ``TypeError`` naming the key and the valid ones."""
    if not isinstance(value, dict):
        return
    bad = [key for key in value if key not in TIMEDELTA_KEYS]
    if bad:
        raise TypeError(f"{what} must be {forms}; unknown key(s) {', '.join(repr(k) for k in bad)} (the keys are "
                        f"{', '.join(TIMEDELTA_KEYS)}: datetime.timedelta's arguments), got {value!r}")


def _check_duration(name: str, value: object, what: str, forms: str) -> timedelta | None:
    """``value`` (``None``, a ``timedelta``, seconds, ``"DD:HH:MM:SS"``, a dict) as a ``timedelta``
    in the range of setting ``name``: ``TypeError`` naming ``forms`` for any other value,
    ``ValueError`` for a duration out of range."""
    if value is None or isinstance(value, timedelta):
        return check_timedelta(name, value, allow_none=True, what=what)
    duration = _as_timedelta(value)
    if duration is None:
        raise TypeError(f"{what} must be {forms}, got {value!r}")
    low, high = RANGES[name]
    if not low <= duration.total_seconds() <= high:
        raise ValueError(f"{what} must be between {_range_text(name)}, got {value!r}")
    return duration


def check_hang_timeout(value: object, *, what: str = "hang_timeout") -> timedelta | str | None:
    """``hang_timeout`` as ``None`` (off), ``"auto"`` (learned) or a ``timedelta`` in range (1 s to
    7 days). Accepted: ``None``, ``"auto"``, a ``timedelta``, a number of seconds, a
    ``"DD:HH:MM:SS"`` string, a dict of ``timedelta`` arguments (``{"minutes": 5}``).

    Raises:
        TypeError: any other value (the message lists the accepted forms).
        ValueError: a duration outside 1 s to 7 days.
    """
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    _check_dict_keys(value, what, HANG_TIMEOUT_FORMS)
    return _check_duration("hang_timeout", value, what, HANG_TIMEOUT_FORMS)


def check_join_timeout(value: object, *, what: str = "join_timeout") -> timedelta | None:
    """``recover_in_place(join_timeout=...)`` as ``None`` (``FTH_RECOVER_JOIN_SEC``, else 60 s) or a
    ``timedelta`` from 1 s to 1 day. Accepted: the forms of ``hang_timeout`` but ``"auto"``: ``None``,
    a ``timedelta``, a number of seconds, a ``"DD:HH:MM:SS"`` string, a dict of ``timedelta``
    arguments (``{"minutes": 2}``).

    Raises:
        TypeError: any other value (the message lists the accepted forms).
        ValueError: ``"auto"`` (a learned deadline is for ``hang_timeout`` only); a duration outside
            1 s to 1 day.
    """
    if isinstance(value, str) and value.strip().lower() == AUTO:
        raise ValueError(f"{what} has no {AUTO!r} (a learned deadline is for hang_timeout only): it must be "
                         f"{JOIN_TIMEOUT_FORMS}, got {value!r}")
    _check_dict_keys(value, what, JOIN_TIMEOUT_FORMS)
    return _check_duration("recover_join_timeout", value, what, JOIN_TIMEOUT_FORMS)


@dataclass(frozen=True)
class AutoHang:
    """The rule of ``hang_timeout="auto"`` (:class:`~..detect.autohang.AutoHangProbe`)."""

    multiple: float
    floor: float
    warmup: int


#: (default, low, high) of each parameter of the ``auto`` rule, and its variable.
AUTO_HANG_RANGES = {
    "multiple": (AUTO_HANG_MULTIPLE_ENV, 10.0, 1.0, 1000.0),
    "floor": (AUTO_HANG_FLOOR_ENV, 60.0, 1.0, 7 * 86400.0),
    "warmup": (AUTO_HANG_WARMUP_ENV, 20, 1, 1_000_000),
}


def auto_hang() -> AutoHang:
    """The ``auto`` rule's parameters, with their ``FTH_AUTO_HANG_*`` overrides, range-checked."""
    values = {}
    for name, (variable, default, low, high) in AUTO_HANG_RANGES.items():
        raw = os.environ.get(variable, "").strip()
        if not raw:
            values[name] = default
            continue
        try:
            value = int(raw) if isinstance(default, int) else float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            kind = "an integer" if isinstance(default, int) else "a number"
            raise ValueError(f"{variable}={raw!r}: expected {kind} from {low:.15g} to {high:.15g}, "
                             f"e.g. {variable}={default:.15g}")
        values[name] = value
    return AutoHang(**values)


def env_hang_timeout() -> timedelta | str | None:
    """``FTH_HANG_TIMEOUT_SEC``: a number of seconds, a ``DD:HH:MM:SS`` string (the form the argument
    takes too), or ``auto``."""
    raw = os.environ.get(HANG_TIMEOUT_ENV, "").strip()
    if raw.lower() == AUTO:
        return AUTO
    if _DHMS.fullmatch(raw):
        return _check_duration("hang_timeout", raw, f"{HANG_TIMEOUT_ENV}={raw!r}", HANG_TIMEOUT_FORMS)
    try:
        return env_timedelta("hang_timeout")
    except ValueError as err:
        raise ValueError(f"{err}, or {AUTO} (a deadline learned from the run)") from None


def env_timedelta(name: str) -> timedelta | None:
    """The environment override of setting ``name`` (``None`` when unset), range-checked."""
    variable = _ENV_OF[name]
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    low, high = RANGES[name]
    if not (math.isfinite(seconds) and low <= seconds <= high):
        raise ValueError(f"{variable}={raw!r}: expected a number of seconds from {low:.15g} to {high:.15g}, e.g. {variable}=5")
    return timedelta(seconds=seconds)


def attempt_store() -> bool:
    raw = os.environ.get(ATTEMPT_STORE_ENV, "")
    value = raw.strip() or "1"
    if value not in ATTEMPT_STORE_CHOICES:
        raise ValueError(f"{ATTEMPT_STORE_ENV}={raw!r}: expected one of {', '.join(ATTEMPT_STORE_CHOICES)}")
    return value == "1"


def snapshot() -> bool:
    """``FTH_SNAPSHOT``: keep the newest checkpoint in memory while recovering in place (default 1)."""
    raw = os.environ.get(SNAPSHOT_ENV, "")
    value = raw.strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{SNAPSHOT_ENV}={raw!r}: expected one of 0, 1")
    return value == "1"


def live_state() -> bool:
    """``FTH_LIVE_STATE``: recovering in place, carry on from the ranks' live state (default 1)."""
    raw = os.environ.get(LIVE_STATE_ENV, "")
    value = raw.strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"{LIVE_STATE_ENV}={raw!r}: expected 0 (resume from the newest checkpoint) or 1 (from "
                         "the ranks' live state, the default)")
    return value == "1"


def recover_join_timeout() -> timedelta:
    return env_timedelta("recover_join_timeout") or timedelta(seconds=60)


#: Recovering in place, the longest a deferred section (:class:`~.interrupts.deferred_interrupt`: the
#: library's checkpoint writes and main-thread store calls, a user's own section) holds a hung rank's
#: interrupt back, counted from the interrupt's first arrival; past it the section is interrupted
#: inside. Below the peers' ``FTH_RECOVER_JOIN_SEC`` (60 s) with room for the exception path, so
#: that a section that hangs itself still lets the rank reach the recovery in time. A checkpoint
#: write of more than this is interrupted (its file is either complete or a temporary file that
#: :func:`~..data.checkpoints.latest_checkpoint` skips, for the library's writes and Ignite's
#: ``DiskSaver``). ``FTH_INTERRUPT_DEFER_SEC`` overrides it.
INTERRUPT_DEFER = timedelta(seconds=30)


def interrupt_defer() -> timedelta:
    """``FTH_INTERRUPT_DEFER_SEC``, or :data:`INTERRUPT_DEFER`."""
    return env_timedelta("interrupt_defer") or INTERRUPT_DEFER


def ckpt_agree_timeout() -> timedelta:
    return env_timedelta("ckpt_agree_timeout") or timedelta(seconds=300)


def release_mode() -> str:
    raw = os.environ.get(RELEASE_ENV, "")
    mode = raw.strip().lower() or "auto"
    if mode not in RELEASE_CHOICES:
        raise ValueError(f"{RELEASE_ENV}={raw!r}: expected one of {', '.join(RELEASE_CHOICES)}")
    return mode


DEFAULTS = {
    "interval": timedelta(seconds=0.1),
    # The start (until the first iteration completes) is not judged by hang_timeout: at 8 ranks on
    # a loaded machine it took 78 s here (imports, the side group, DDP's first pass), and a compile
    # takes minutes on a GPU. Ten minutes still names a rank stuck at start before a 30-minute
    # collective timeout would.
    "start_timeout": timedelta(seconds=600),
    "exit_grace": timedelta(seconds=3),
    "write_grace": timedelta(seconds=120),
    "heartbeat_timeout": timedelta(seconds=2),
    "store_lost_after": timedelta(seconds=4),
}


@dataclass(frozen=True)
class Config:
    """The checked settings of one process (environment overrides applied)."""

    interval: timedelta
    hang_timeout: timedelta | str | None
    start_timeout: timedelta
    exit_grace: timedelta
    write_grace: timedelta
    heartbeat_timeout: timedelta
    store_lost_after: timedelta
    sync_timeout: timedelta | None
    release: str


def load() -> Config:
    """Read and check every ``FTH_*`` variable. Raises ``ValueError`` naming the first bad one."""
    inject.Injector.from_env()  # FTH_INJECT is checked with the rest
    unknown = sorted(k for k in os.environ if k.startswith("FTH_") and k not in KNOWN_ENV
                     and k != attempts.RUNNING_ENV and not k.startswith("FTH_TEST"))
    if unknown:
        warn_once("ignoring unknown environment variable(s) %s; known: %s" % (", ".join(unknown), ", ".join(KNOWN_ENV)))
    values = {name: env_timedelta(name) for name in _ENV_OF
              if name not in ("hang_timeout", "recover_join_timeout", "interrupt_defer")}
    recover_join_timeout()
    interrupt_defer()
    snapshot()
    live_state()
    values["hang_timeout"] = env_hang_timeout()
    auto_hang()
    attempt_store()
    cfg = Config(
        interval=values["interval"] or DEFAULTS["interval"],
        hang_timeout=values["hang_timeout"],
        start_timeout=values["start_timeout"] or DEFAULTS["start_timeout"],
        exit_grace=values["exit_grace"] or DEFAULTS["exit_grace"],
        write_grace=values["write_grace"] if values["write_grace"] is not None else DEFAULTS["write_grace"],
        heartbeat_timeout=values["heartbeat_timeout"] or DEFAULTS["heartbeat_timeout"],
        store_lost_after=values["store_lost_after"] or DEFAULTS["store_lost_after"],
        sync_timeout=values["sync_timeout"],
        release=release_mode(),
    )
    for problem in check_timings(cfg):
        warn_once(problem)
    return cfg


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A configuration warning, once per process (every session reads the configuration again: a
    job that makes several, or recovers in place, would repeat it at each)."""
    if message not in _warned:
        _warned.add(message)
        log(logging.WARNING, "%s", message)

# -- Fixed timings of the failure path ---------------------------------------------------------------
# Every timeout and wait of the library that no variable sets, defined here once (the modules that
# use one import it from here) and checked against each other and the settings above when a session
# starts (:func:`check_timings`). Seconds unless a ``timedelta``.
#
# ===========================  =======  ===========================  ==============================================
# name                         value    used by                      what it bounds
# ===========================  =======  ===========================  ==============================================
# MAIN_STORE_TIMEOUT           5 s      core.session                 the main thread's store calls (publish, read)
# FAILURE_PATH_STORE_TIMEOUT   1 s      core.session                 store calls while explaining a broken collective
# BACKGROUND_CONNECT_TIMEOUT   5 s      core.session                 a loop's connect (watchdog, liveness helper)
# EXPLAIN_WAIT                 2.0      core.session                 a broken collective waits for its cause
# SUSPECT_SILENCE              1.2      core.session                 a suspect's heartbeat stands still: it is lost
# SUSPECT_OBSERVED_GAP         0.5      core.session                 reads this close observe a suspect's silence
# EXPLAIN_EVIDENCE_TIMEOUT     0.5      core.session                 the plain connect telling the store is gone
# MISMATCH_WAIT                1.0      core.session                 out-of-step ranks wait for each other's sections
# LEAVE_WAIT                   1.0      core.session                 a rank that finished marks itself left (at exit too)
# RELEASE_GRACE                0.3 s    detect.watchdog              a record waits for a sync point before release
# SILENT_MARGIN                2 s      detect.watchdog              on top of hang_timeout before a silent rank
# HEARTBEAT_EVERY              0.5 s    detect.watchdog, liveness    the helper's heartbeat and ring check period
# LIVENESS_STORE_TIMEOUT       2 s      detect.watchdog              the pid loop's store calls (declarations)
# STORE_CHECK_EVERY            0.5      detect.watchdog              a silent store's port is tried this often
# STORE_EVIDENCE_TIMEOUT       1.5      detect.watchdog              each such try (past one lost SYN)
# STORE_WARN_EVERY             30.0     detect.watchdog              a slow (not gone) store is warned about
# HELPER_STORE_TIMEOUT         1 s      detect.liveness              the helper's store calls
# RANK_EXIT_WAIT               0.05     detect.liveness              the kernel shows a dead rank's exit status
# SIGNAL_STORE_TIMEOUT         1 s      launchers.signals            store calls on a signal
# CAUSE_LINGER                 0.6      launchers.signals            a signalled cause stays for its peers to read
# SAME_DELIVERY                0.3      launchers.signals            peers' signals this close are one delivery
# SIGNALLED_TOGETHER           1.0      launchers.signals            the same, behind a framework's handler
# REPORT_WAIT                  1.5      launchers.signals            a signalled survivor waits for the explanation
# REACTION_WAIT                5.0      launchers.signals            the main thread waits for the signal thread
# MAIN_STUCK_WAIT              1.0      launchers.signals            a signal waits for a blocked main thread
# SIGNAL_EXIT_WAIT             2.0      launchers.signals            ... then, released, for it to take the signal
# SIGTERM_CAUSE_WAIT           1.0      launchers.spawned            under mp.spawn, a SIGTERM waits for the cause
# ZOMBIE_HOLD                  0.5      launchers.spawned, liveness  a dead rank is held a zombie for its peers
# CONNECT_TRIES, CONNECT_SLACK 3x, 1.0  core.schema                  a store connect (kept there: its own logic)
# CALL_SLACK                   0.5      core.schema                  a store call past its connection's timeout
# RECOVER_POLL                 0.01     recover.inplace              rank 0 counts the ranks that reached a recovery
# RECOVER_TEARDOWN_SEC         10       recover.inplace              destroying a failed attempt's groups
# RECOVER_TELL_SEC             2.0      recover.inplace              a rank that ends tells its peers why (store calls)
# INTERRUPT_WAIT               2.0      detect.watchdog              a hung main thread leaves its hang when interrupted
# INTERRUPT_RESEND             0.5      detect.watchdog              the interrupt's signal again, until it is taken
# ATTEMPT_KEYS_WAIT            3.0      launchers.compat_torchrun    one try at deleting the read gloo keys (fth-attempt-keys)
# ATTEMPT_KEYS_PATIENCE        60       launchers.compat_torchrun    tries at it before leaving it to the way out
# ===========================  =======  ===========================  ==============================================

#: Timeout of the main thread's store calls (publishing a record, reading records on a failure).
MAIN_STORE_TIMEOUT = timedelta(seconds=5)
#: Under torchrun with the library imported after ``init_process_group``: the bound of one try of the
#: ``fth-attempt-keys`` thread at deleting the gloo address keys every peer has read (the way out waits
#: for a try in progress), and how long it tries before leaving them to the way out.
ATTEMPT_KEYS_WAIT = 3.0
ATTEMPT_KEYS_PATIENCE = 60.0
#: Timeout of the store calls made while explaining a broken collective.
FAILURE_PATH_STORE_TIMEOUT = timedelta(seconds=1)
#: The connect of a connection a loop makes in its own thread (the watchdog's, the liveness
#: helper's): nothing waits for it, and 8 ranks starting on a busy store's host took seconds to be
#: answered; a 1 s connect failed and was made again by every rank, adding to that load.
BACKGROUND_CONNECT_TIMEOUT = timedelta(seconds=5)
#: How long a broken collective waits for the cause (a killed peer is declared within ~0.1 s).
EXPLAIN_WAIT = 2.0
#: A rank at the address a backend error names, whose heartbeat (every HEARTBEAT_EVERY, from its
#: liveness process) stands still this long, is lost.
SUSPECT_SILENCE = 1.2
#: How long ranks found out of step wait for each other's section names.
MISMATCH_WAIT = 1.0
#: Bound of the store call of a rank whose watchdog stops cleanly (its left mark), also at the
#: interpreter's exit, where the store's host may already be gone.
LEAVE_WAIT = 1.0
#: Bound of the plain connect that tells whether the store is gone while explaining a broken
#: collective (past it: no answer from the store's host, with a connection from it already broken).
EXPLAIN_EVIDENCE_TIMEOUT = 0.5
#: Two reads of a suspect's heartbeat at most this far apart (seconds) observe the time between
#: them; a longer gap (the store answered slowly) does not count as its silence.
SUSPECT_OBSERVED_GAP = 0.5

#: How long a failure record may stay unconsumed by a sync point before the watchdog releases.
RELEASE_GRACE = timedelta(seconds=0.3)
#: Extra time before a neighbour declares a silent rank, on top of ``hang_timeout``.
SILENT_MARGIN = timedelta(seconds=2)
#: Heartbeat period; the ring check runs at the same period.
HEARTBEAT_EVERY = timedelta(seconds=0.5)
#: Timeout of the liveness loop's store calls (only to publish what it declares).
LIVENESS_STORE_TIMEOUT = timedelta(seconds=2)
#: While the store does not answer, its port is tried this often (a plain TCP connect: evidence
#: that it is gone, or that it is only slow), each try bounded by :data:`STORE_EVIDENCE_TIMEOUT`
#: seconds (past the kernel's first SYN retransmission, 1 s: one lost packet is not evidence).
STORE_CHECK_EVERY = 0.5
STORE_EVIDENCE_TIMEOUT = 1.5
#: A store that is slow but not gone is warned about at most this often (seconds).
STORE_WARN_EVERY = 30.0
#: Timeout of the helper's store calls: a call never blocks it longer than a heartbeat or two.
HELPER_STORE_TIMEOUT = timedelta(seconds=1)
#: How long the helper, woken by its rank's end, waits for the kernel to show the rank's exit
#: status (its files, the pipe, close a moment before it becomes a zombie).
RANK_EXIT_WAIT = 0.05

#: Timeout of the store calls made on a signal (publish the record, look for a peer's).
SIGNAL_STORE_TIMEOUT = timedelta(seconds=1)
#: How long a signalled rank whose signal ends it stays alive after publishing its record: the
#: watchdog's record grace (RELEASE_GRACE) and two polls, so that its peers name the signal.
CAUSE_LINGER = 0.6
#: A peer's record of the same signal received within this many seconds of this rank's is the same
#: delivery (Ctrl-C in a terminal, a scheduler signalling every process): both ranks are causes. A
#: launcher's SIGTERM to the survivors of a signalled rank comes after that rank's exit, so at least
#: CAUSE_LINGER after its record: a consequence.
SAME_DELIVERY = 0.3
#: The same, when a framework's handler (Lightning's) is in front of this one: that handler does not
#: end the process at once (no launcher's SIGTERM follows within a second), and Lightning's ``ddp``
#: rank 0 forwards the signal to the ranks it started, later than a delivery to every process.
SIGNALLED_TOGETHER = 1.0
#: How long a rank ended while it works out a peer's failure waits for that explanation.
REPORT_WAIT = 1.5
#: How long the main thread's handler waits for the reaction under way in the thread (under mp.spawn it
#: may wait for the cause: REPORT_WAIT, SIGTERM_CAUSE_WAIT and a store call).
REACTION_WAIT = 5.0
#: How long the signal thread, its reaction done, waits for the main thread to enter the handler
#: before it takes the main thread for blocked in C (a collective its peer never joins, a store call)
#: and releases it (:mod:`..launchers.signals`). A main thread running Python enters it at once.
MAIN_STUCK_WAIT = 1.0
#: How long it then waits for the released main thread to take the signal before it ends the process
#: itself (the signal's default action only): a signal ends a rank within a few seconds whatever
#: the main thread is blocked in.
SIGNAL_EXIT_WAIT = 2.0
#: How long a SIGTERM that finds a same-host peer gone, and nothing known yet, waits for the cause
#: (the watchdog's finding or the peer's record); well inside the parent's 30 s before SIGKILL.
SIGTERM_CAUSE_WAIT = 1.0
#: How long a gone rank's liveness helper stays under ``mp.spawn``, keeping the rank a zombie its
#: parent cannot reap yet (so that same-host peers read how it ended).
ZOMBIE_HOLD = 0.5

#: Recovering in place: how often rank 0 counts the ranks that reached the recovery.
RECOVER_POLL = 0.01
#: With spares: how often rank 0, waiting for the ranks to reach the recovery, reads the failed
#: attempt's records for more ranks lost with no keeper (each gets a spare).
LOOK_FOR_LOST = 0.5
#: Recovering in place: destroying a failed attempt's process groups (measured: 20 ms) must end
#: within this many seconds, else the process ends (EXIT_TEARDOWN_STUCK) and its launcher relaunches.
RECOVER_TEARDOWN_SEC = 10.0
#: Recovering in place, a rank whose cause is not recovered in place (a rank or the store lost, a
#: signal) ends at once; its store calls only tell its peers why (so that rank 0 ends the job without
#: waiting for the join timeout), and all of them together are given this many seconds: the store may
#: be what is gone, and a read from a store whose host or link is gone blocks for minutes.
RECOVER_TELL_SEC = 2.0
#: Recovering in place, a rank hung in Python is interrupted; if its main thread has not left the
#: hang this many seconds later (stuck in C), it ends as without recovery (EXIT_HUNG).
INTERRUPT_WAIT = 2.0
#: Recovering in place, while a hung rank's interrupt is not taken by the recovery, the watchdog
#: signals the main thread again this often (seconds): an interrupt caught and not re-raised (an
#: ``except BaseException``) is raised again, one held back by a checkpoint write the stack shows is
#: delivered after it. The wait for the main thread (INTERRUPT_WAIT) is extended while a deferred
#: section holds the interrupt back (by INTERRUPT_DEFER at most).
INTERRUPT_RESEND = 0.5


def check_timings(cfg: "Config | None" = None) -> list[str]:
    """The relations the timings above must keep, with each other and with the settings ``cfg``.

    A broken relation between two fixed timings is a bug of the library: ``AssertionError``. One
    that a setting breaks (a poll interval of seconds) is returned, and logged as a warning when a
    session starts: the job runs, but that part of the failure path is slower than it says."""
    seconds = lambda t: t.total_seconds() if isinstance(t, timedelta) else float(t)  # noqa: E731
    fixed = [
        (SAME_DELIVERY < CAUSE_LINGER, "SAME_DELIVERY < CAUSE_LINGER: a launcher's SIGTERM after a signalled "
                                       "rank's exit is told apart from one delivery to every rank"),
        (SAME_DELIVERY <= SIGNALLED_TOGETHER, "SAME_DELIVERY <= SIGNALLED_TOGETHER"),
        (CAUSE_LINGER >= seconds(RELEASE_GRACE), "CAUSE_LINGER >= RELEASE_GRACE"),
        (REPORT_WAIT + SIGTERM_CAUSE_WAIT + seconds(SIGNAL_STORE_TIMEOUT) <= REACTION_WAIT,
         "REPORT_WAIT + SIGTERM_CAUSE_WAIT + SIGNAL_STORE_TIMEOUT <= REACTION_WAIT: the main thread's "
         "handler waits for the whole reaction"),
        (seconds(FAILURE_PATH_STORE_TIMEOUT) < EXPLAIN_WAIT, "FAILURE_PATH_STORE_TIMEOUT < EXPLAIN_WAIT"),
        (SUSPECT_SILENCE > 2 * seconds(HEARTBEAT_EVERY), "SUSPECT_SILENCE > 2 x HEARTBEAT_EVERY: a live "
                                                        "suspect beats at least twice in it"),
        (SUSPECT_OBSERVED_GAP < SUSPECT_SILENCE, "SUSPECT_OBSERVED_GAP < SUSPECT_SILENCE: a silence is observed"),
        (EXPLAIN_EVIDENCE_TIMEOUT < EXPLAIN_WAIT, "EXPLAIN_EVIDENCE_TIMEOUT < EXPLAIN_WAIT"),
        (STORE_CHECK_EVERY < STORE_EVIDENCE_TIMEOUT + STORE_WARN_EVERY, "STORE_CHECK_EVERY < STORE_WARN_EVERY"),
        (SUSPECT_SILENCE < EXPLAIN_WAIT, "SUSPECT_SILENCE < EXPLAIN_WAIT: a silent suspect is declared "
                                         "before the explanation gives up"),
        (seconds(HELPER_STORE_TIMEOUT) <= 2 * seconds(HEARTBEAT_EVERY), "HELPER_STORE_TIMEOUT <= 2 x "
                                                                        "HEARTBEAT_EVERY"),
        (ZOMBIE_HOLD < SIGTERM_CAUSE_WAIT + REPORT_WAIT, "ZOMBIE_HOLD < SIGTERM_CAUSE_WAIT + REPORT_WAIT"),
        (INTERRUPT_RESEND < INTERRUPT_WAIT, "INTERRUPT_RESEND < INTERRUPT_WAIT: a swallowed interrupt is raised "
                                            "again before the hung rank is given up"),
        (seconds(INTERRUPT_DEFER) + INTERRUPT_WAIT < 60, "INTERRUPT_DEFER + INTERRUPT_WAIT < the default "
                                                          "FTH_RECOVER_JOIN_SEC (60 s)"),
    ]
    broken = [what for ok, what in fixed if not ok]
    assert not broken, f"the library's timings contradict each other: {'; '.join(broken)}"
    problems = []
    if cfg is not None:
        poll = seconds(cfg.interval)
        if CAUSE_LINGER < seconds(RELEASE_GRACE) + 2 * poll:
            problems.append(f"{INTERVAL_ENV}={poll:g}: a rank ended by its own SIGTERM/SIGINT lingers "
                            f"{CAUSE_LINGER:g} s for its peers to read its record, less than the record grace and "
                            f"two polls ({seconds(RELEASE_GRACE) + 2 * poll:g} s): its peers may name a process "
                            "gone instead of the signal")
        if seconds(cfg.heartbeat_timeout) < 2 * seconds(HEARTBEAT_EVERY):
            problems.append(f"{HEARTBEAT_TIMEOUT_ENV}: below two heartbeats ({2 * seconds(HEARTBEAT_EVERY):g} s)")
        defer, join = seconds(interrupt_defer()), seconds(recover_join_timeout())
        if defer + INTERRUPT_WAIT >= join:
            problems.append(f"{INTERRUPT_DEFER_ENV}={defer:g}: recovering in place, a hung rank whose deferred section "
                            f"holds its interrupt back that long reaches the recovery after its peers stopped "
                            f"waiting for it ({RECOVER_JOIN_ENV}={join:g} s): the job ends instead of recovering")
        if max(1.0, 5 * poll) > seconds(cfg.store_lost_after):
            problems.append(f"{INTERVAL_ENV}={poll:g}: the watchdog's store calls may take {max(1.0, 5 * poll):g} s, "
                            f"longer than {STORE_LOST_ENV} ({seconds(cfg.store_lost_after):g} s): a lost store is "
                            "declared late")
    return problems
