"""The one table of timings (``core/config.py``): its fixed values agree with each other, and a
setting that breaks a relation with them is named when a session starts."""

from __future__ import annotations

import logging
from datetime import timedelta

from fault_tolerant_handlers.core import config
from fault_tolerant_handlers.detect import liveness, watchdog
from fault_tolerant_handlers.launchers import reports, signals


def test_the_defaults_keep_every_relation(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("FTH_"):
            monkeypatch.delenv(name)
    assert config.check_timings(config.load()) == []


def test_the_fixed_timings_keep_their_relations():
    """A broken relation between two fixed timings is a bug of the library."""
    from fault_tolerant_handlers.core.config import (  # noqa: F401 - the names the relations read
        CAUSE_LINGER, EXPLAIN_EVIDENCE_TIMEOUT, EXPLAIN_WAIT, FAILURE_PATH_STORE_TIMEOUT, HEARTBEAT_EVERY,
        HELPER_STORE_TIMEOUT, INTERRUPT_RESEND, INTERRUPT_WAIT, REACTION_WAIT, RELEASE_GRACE,
        REPORT_WAIT, SAME_DELIVERY, SIGNAL_STORE_TIMEOUT, SIGNALLED_TOGETHER, SIGTERM_CAUSE_WAIT, STORE_CHECK_EVERY,
        STORE_EVIDENCE_TIMEOUT, STORE_WARN_EVERY, SUSPECT_OBSERVED_GAP, SUSPECT_SILENCE, ZOMBIE_HOLD)

    INTERRUPT_DEFER = next(s.default for s in config.SETTINGS if s.field == "interrupt_defer")  # noqa: N806

    def seconds(t):
        return t.total_seconds() if isinstance(t, timedelta) else float(t)

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


def test_each_timing_is_defined_once_and_used_from_the_table():
    assert signals.CAUSE_LINGER is config.CAUSE_LINGER and signals.REACTION_WAIT is config.REACTION_WAIT
    assert reports.ZOMBIE_HOLD is config.ZOMBIE_HOLD and reports.SIGTERM_CAUSE_WAIT is config.SIGTERM_CAUSE_WAIT
    assert watchdog.RELEASE_GRACE is config.RELEASE_GRACE and watchdog.HEARTBEAT_EVERY is config.HEARTBEAT_EVERY
    assert liveness.HELPER_STORE_TIMEOUT is config.HELPER_STORE_TIMEOUT


def test_a_slow_poll_interval_is_named_at_start(monkeypatch, caplog):
    """CAUSE_LINGER is "the record grace and two polls": a 10 s poll breaks it (warned, not refused)."""
    monkeypatch.setenv(config.INTERVAL_ENV, "10")
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        cfg = config.load()
    assert cfg.interval == timedelta(seconds=10)
    problems = config.check_timings(cfg)
    assert any("FTH_WATCHDOG_INTERVAL_SEC=10" in p and "lingers 0.6 s" in p for p in problems), problems
    assert any("lingers 0.6 s" in r.getMessage() for r in caplog.records)


def test_a_configuration_warning_is_logged_once_per_process(monkeypatch, caplog):
    """Every session reads the configuration again (several loops, a recovery in place): its warnings
    are the process's, logged once (issue 46: the unknown variable was warned at every session)."""
    import logging

    monkeypatch.setenv("FTH_NOT_A_SETTING_46", "1")
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        for _ in range(3):
            config.load()
    assert caplog.text.count("ignoring unknown environment variable(s) FTH_NOT_A_SETTING_46") == 1, caplog.text
    monkeypatch.setenv("FTH_NOT_A_SETTING_46B", "1")  # another configuration: its own warning
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        config.load()
    assert "FTH_NOT_A_SETTING_46, FTH_NOT_A_SETTING_46B" in caplog.text
