"""Timeouts are ``datetime.timedelta`` values; environment overrides are positive seconds."""

from __future__ import annotations

import os
from datetime import timedelta


def env_timedelta(name: str, default: timedelta | None) -> timedelta | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds, e.g. {name}=5")
    return timedelta(seconds=seconds)


def check_timedelta(name: str, value: object, *, allow_none: bool = False) -> timedelta | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, timedelta):
        hint = " or None" if allow_none else ""
        raise TypeError(f"{name} must be a datetime.timedelta{hint} (e.g. timedelta(seconds=5)), got {value!r}")
    if value.total_seconds() <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return value
