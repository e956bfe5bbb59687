"""Every setting of the library: its argument or environment variable, default and accepted range.

Timeouts are ``datetime.timedelta`` values; each environment override is a number of seconds, in a
documented range. Every ``FTH_*`` variable is read and checked when a fail-together session starts
(and when an adapter is constructed), so a bad value stops the job at once with an error naming the
variable and its accepted range, never later inside a watchdog thread.

==============================  =========  ====================  ======================================
variable                        default    accepted              meaning
==============================  =========  ====================  ======================================
``FTH_WATCHDOG_INTERVAL_SEC``   0.1        0.01 .. 10            watchdog poll period
``FTH_HANG_TIMEOUT_SEC``        (off)      1 .. 604800, auto     opt-in hang detection (``auto``: learned)
``FTH_AUTO_HANG_MULTIPLE``      10         1 .. 1000             ``auto``: deadline = multiple x longest
``FTH_AUTO_HANG_FLOOR_SEC``     60         1 .. 604800           ``auto``: no deadline below this
``FTH_AUTO_HANG_WARMUP``        20         1 .. 1000000          ``auto``: training steps before judging
``FTH_EXIT_GRACE_SEC``          3          0.1 .. 3600           released rank: time to take the failure
``FTH_WRITE_GRACE_SEC``         120        0 .. 3600             reported exit waits for a checkpoint write
``FTH_HEARTBEAT_TIMEOUT_SEC``   3          1 .. 86400            a peer whose heartbeat stops is lost
``FTH_STORE_LOST_SEC``          4          1 .. 86400            a store that does not answer is lost
``FTH_SYNC_TIMEOUT_SEC``        (group's)  1 .. 2592000          the side group's timeout
``FTH_RELEASE``                 auto       auto, exit            how blocked collectives are released
``FTH_INJECT``                  (none)     see ``inject.py``     rehearse a failure
``FTH_CKPT_AGREE_TIMEOUT_SEC``  300        1 .. 86400            ranks wait this long for rank 0's
                                                                 ``latest_checkpoint`` answer
``FTH_ATTEMPT_STORE``           1          0, 1                  one store namespace per torchrun attempt
==============================  =========  ====================  ======================================
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from datetime import timedelta

from . import inject
from .log import log

INTERVAL_ENV = "FTH_WATCHDOG_INTERVAL_SEC"
HANG_TIMEOUT_ENV = "FTH_HANG_TIMEOUT_SEC"
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
#: ``hang_timeout="auto"``: the deadline is learned from the run (:mod:`.autohang`).
AUTO = "auto"

RELEASE_CHOICES = ("auto", "exit")

#: (low, high) in seconds, inclusive, for every timeout setting (argument and variable alike).
RANGES: dict[str, tuple[float, float]] = {
    "interval": (0.01, 10.0),
    "hang_timeout": (1.0, 7 * 86400.0),
    "exit_grace": (0.1, 3600.0),
    "write_grace": (0.0, 3600.0),
    "heartbeat_timeout": (1.0, 86400.0),
    "store_lost_after": (1.0, 86400.0),
    "sync_timeout": (1.0, 30 * 86400.0),
    "ckpt_agree_timeout": (1.0, 86400.0),
}
_ENV_OF = {
    "interval": INTERVAL_ENV,
    "hang_timeout": HANG_TIMEOUT_ENV,
    "exit_grace": EXIT_GRACE_ENV,
    "write_grace": WRITE_GRACE_ENV,
    "heartbeat_timeout": HEARTBEAT_TIMEOUT_ENV,
    "store_lost_after": STORE_LOST_ENV,
    "sync_timeout": SYNC_TIMEOUT_ENV,
    "ckpt_agree_timeout": CKPT_AGREE_TIMEOUT_ENV,
}
KNOWN_ENV = (*_ENV_OF.values(), RELEASE_ENV, INJECT_ENV, ATTEMPT_STORE_ENV, AUTO_HANG_MULTIPLE_ENV,
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


def check_hang_timeout(value: object, *, what: str = "hang_timeout") -> timedelta | str | None:
    """``hang_timeout``: ``None`` (off), a ``timedelta`` in range, or ``"auto"`` (learned)."""
    if value == AUTO and isinstance(value, str):
        return AUTO
    if value is None or isinstance(value, timedelta):
        return check_timedelta("hang_timeout", value, allow_none=True, what=what)
    raise TypeError(f"{what} must be None (off), a datetime.timedelta (e.g. timedelta(minutes=5)) or "
                    f"{AUTO!r} (a deadline learned from the run), got {value!r}")


@dataclass(frozen=True)
class AutoHang:
    """The rule of ``hang_timeout="auto"`` (:class:`~.autohang.AutoHangProbe`)."""

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
    """``FTH_HANG_TIMEOUT_SEC``: a number of seconds, or ``auto``."""
    if os.environ.get(HANG_TIMEOUT_ENV, "").strip().lower() == AUTO:
        return AUTO
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


def ckpt_agree_timeout() -> timedelta:
    return env_timedelta("ckpt_agree_timeout") or timedelta(seconds=300)


def release_mode() -> str:
    raw = os.environ.get(RELEASE_ENV, "")
    mode = raw.strip().lower() or "auto"
    if mode not in RELEASE_CHOICES:
        raise ValueError(f"{RELEASE_ENV}={raw!r}: expected one of {', '.join(RELEASE_CHOICES)}")
    return mode


#: How long a gone rank's liveness helper stays under ``mp.spawn``, keeping the rank a zombie its
#: parent cannot reap yet (so that same-host peers read how it ended).
ZOMBIE_HOLD = 0.5

DEFAULTS = {
    "interval": timedelta(seconds=0.1),
    "exit_grace": timedelta(seconds=3),
    "write_grace": timedelta(seconds=120),
    "heartbeat_timeout": timedelta(seconds=3),
    "store_lost_after": timedelta(seconds=4),
}


@dataclass(frozen=True)
class Config:
    """The checked settings of one process (environment overrides applied)."""

    interval: timedelta
    hang_timeout: timedelta | str | None
    exit_grace: timedelta
    write_grace: timedelta
    heartbeat_timeout: timedelta
    store_lost_after: timedelta
    sync_timeout: timedelta | None
    release: str


def load() -> Config:
    """Read and check every ``FTH_*`` variable. Raises ``ValueError`` naming the first bad one."""
    inject.Injector.from_env()  # FTH_INJECT is checked with the rest
    unknown = sorted(k for k in os.environ if k.startswith("FTH_") and k not in KNOWN_ENV and not k.startswith("FTH_TEST"))
    if unknown:
        log(logging.WARNING, "ignoring unknown environment variable(s) %s; known: %s", ", ".join(unknown),
            ", ".join(KNOWN_ENV))
    values = {name: env_timedelta(name) for name in _ENV_OF if name != "hang_timeout"}
    values["hang_timeout"] = env_hang_timeout()
    auto_hang()
    attempt_store()
    return Config(
        interval=values["interval"] or DEFAULTS["interval"],
        hang_timeout=values["hang_timeout"],
        exit_grace=values["exit_grace"] or DEFAULTS["exit_grace"],
        write_grace=values["write_grace"] if values["write_grace"] is not None else DEFAULTS["write_grace"],
        heartbeat_timeout=values["heartbeat_timeout"] or DEFAULTS["heartbeat_timeout"],
        store_lost_after=values["store_lost_after"] or DEFAULTS["store_lost_after"],
        sync_timeout=values["sync_timeout"],
        release=release_mode(),
    )
