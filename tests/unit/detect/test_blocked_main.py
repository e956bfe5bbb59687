"""The watchdog's blocked-main-thread probe, polled from a thread while the main thread sleeps: a main
thread asleep in user code after a release (a handler's ``time.sleep``, where the interrupt may be
held while the rank handles its own failure) is never taken for one blocked in a collective."""

from __future__ import annotations

import threading
import time

from fault_tolerant_handlers.core import interrupts
from fault_tolerant_handlers.detect.watchdog import BlockedMainProbe


def _poll_while_the_main_thread_sleeps(probe: BlockedMainProbe, seconds: float) -> list[bool]:
    seen: list[bool] = []

    def poll() -> None:
        end = time.monotonic() + seconds - 0.2
        while time.monotonic() < end:
            seen.append(probe.poll(time.monotonic()))
            time.sleep(0.05)

    thread = threading.Thread(target=poll)
    thread.start()
    time.sleep(seconds)  # no bytecode, no CPU: only the frame tells this from a collective's wait
    thread.join()
    return seen


def test_a_main_thread_asleep_in_user_code_after_a_release_is_not_blocked(monkeypatch):
    # a release found a connection, and it is closed now (no fd of this process is inode -1)
    monkeypatch.setattr(interrupts, "_released_connections", {-1})
    assert interrupts.release_spent()
    seen = _poll_while_the_main_thread_sleeps(BlockedMainProbe(0.2), 1.2)
    assert len(seen) > 10 and not any(seen)


def test_without_a_released_connection_nothing_is_spent(monkeypatch):
    monkeypatch.setattr(interrupts, "_released_connections", set())
    assert not interrupts.release_spent()
