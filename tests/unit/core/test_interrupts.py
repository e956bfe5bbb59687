"""The interrupt of a hung main thread (``core/interrupts.py``), with real signals, each case in a
process of its own: a ``HangInterrupted`` that ``except Exception`` cannot swallow, raised again
until the recovery takes it, held back by deferred sections for a bounded time."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from fault_tolerant_handlers import HangInterrupted, deferred_interrupt
from fault_tolerant_handlers.core import config, interrupts

ROOT = Path(__file__).resolve().parents[3]

# Installs the handler as the recovery does, and a "watchdog" thread that interrupts the main thread
# FIRE_AT seconds after start, then signals it again every RESEND seconds until it is taken (STOP).
PRELUDE = textwrap.dedent("""
    import json, signal, sys, threading, time
    from datetime import timedelta
    from fault_tolerant_handlers import HangInterrupted, deferred_interrupt
    from fault_tolerant_handlers.core import interrupts

    SIG = signal.SIGRTMIN + 5
    T0 = time.monotonic()
    STOP = threading.Event()
    out = {}

    def now():
        return round(time.monotonic() - T0, 3)

    def watchdog(fire_at, resend):
        time.sleep(fire_at)
        out["fired"] = now()
        interrupts.interrupt(HangInterrupted("rank 0 hung"))
        while not STOP.wait(resend):
            interrupts.interrupt(None)

    def start(bound=30.0, fire_at=0.2, resend=0.1):
        interrupts.install(SIG, timedelta(seconds=bound))
        threading.Thread(target=watchdog, args=(fire_at, resend), daemon=True).start()

    def taken(err):
        out["raised"] = now()
        out["type"] = type(err).__name__
        out["was_pending"] = interrupts.take() is err
        STOP.set()
""")


# One process imports the library (seconds on a busy machine) and forks a child per case: each case
# runs in a process of its own, with its own signal handler and nothing pending from another.
RUNNER = textwrap.dedent("""
    import json, os, sys, traceback
    import fault_tolerant_handlers, fault_tolerant_handlers.detect.watchdog
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                exec(compile(json.loads(line), "<case>", "exec"), {"__name__": "__case__"})
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("EXIT", os.waitstatus_to_exitcode(status), flush=True)
""")


@pytest.fixture(scope="module")
def runner():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTH_")}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def run_case(runner):
    def run(body: str, timeout: float = 30.0) -> dict:
        program = PRELUDE + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(out), flush=True)\n"
        runner.stdin.write(json.dumps(program) + "\n")
        runner.stdin.flush()
        lines: list[str] = []
        timer = threading.Timer(timeout + 60, runner.kill)  # + the runner's imports, once
        timer.start()
        try:
            for line in runner.stdout:
                if line.startswith("EXIT "):
                    break
                lines.append(line.rstrip("\n"))
        finally:
            timer.cancel()
        text = "\n".join(lines)
        assert line.startswith("EXIT 0"), f"the case failed ({line.strip() or 'killed'}):\n{text[-3000:]}"
        results = [x for x in lines if x.startswith("RESULT ")]
        assert results, text[-3000:]
        return json.loads(results[-1][len("RESULT "):])

    return run


def test_an_except_exception_loop_cannot_swallow_it(run_case):
    out = run_case("""
        start()
        swallowed = 0
        try:
            while True:                      # a user's loop that swallows every error
                try:
                    time.sleep(0.05)
                except Exception:
                    swallowed += 1
        except HangInterrupted as err:
            taken(err)
        out["swallowed"] = swallowed
    """)
    assert out["type"] == "HangInterrupted" and out["was_pending"]
    assert out["swallowed"] == 0
    assert out["raised"] - out["fired"] < 0.5, out


def test_caught_and_carried_on_it_is_raised_again_at_the_next_library_point_and_by_the_next_signal(run_case):
    out = run_case("""
        start(resend=60)                    # no resend: only the library's next point raises it
        caught = 0
        try:
            while True:
                try:
                    time.sleep(0.05)
                except BaseException:        # a bare except that carries on
                    caught += 1
                interrupts.raise_pending()   # an adapter's hook (Guard.beat, a Lightning hook)
        except HangInterrupted as err:
            taken(err)
        out["caught"] = caught
        # without a library point, the watchdog's next signal raises it again, and again
        STOP.clear()
        interrupts.arm()                     # (the recovery calls the training function again)
        threading.Thread(target=watchdog, args=(0.2, 0.2), daemon=True).start()

        def swallowing_loop(seconds):
            n, end = 0, time.monotonic() + seconds  # the first signal at 0.2 s, then every 0.2 s
            while True:
                try:
                    if time.monotonic() >= end:
                        STOP.set()
                        return n, interrupts.take()  # still pending: taken (no later signal raises)
                    time.sleep(0.05)
                except BaseException:
                    n += 1

        out["caught_by_signal"], still = swallowing_loop(1.2)
        out["pending_after"] = still is not None
        interrupts.raise_pending()           # taken: nothing is raised any more
        interrupts.interrupt(None)
        time.sleep(0.1)
        out["after_take"] = "quiet"
    """)
    assert out["caught"] == 1 and out["was_pending"], out
    assert out["caught_by_signal"] >= 3, out  # the first signal, then every resend
    assert out["pending_after"] and out["after_take"] == "quiet"


def test_a_deferred_section_holds_it_back_and_it_is_raised_right_after_the_section(run_case):
    out = run_case("""
        start()
        try:
            with deferred_interrupt():
                out["entered"] = now()
                for _ in range(20):          # 1 s of work: the interrupt arrives at 0.2 s
                    time.sleep(0.05)
                out["section_done"] = now()
            out["after_section"] = now()     # never: the interrupt is raised as the section ends
        except HangInterrupted as err:
            taken(err)
        out["deferred_at_take"] = interrupts.deferred_until()
    """)
    assert "after_section" not in out and out["type"] == "HangInterrupted", out
    assert out["fired"] < out["section_done"] <= out["raised"] < out["section_done"] + 0.5, out
    assert out["deferred_at_take"] is None


def test_nested_sections_and_the_decorator_deliver_it_at_the_outermost_exit(run_case):
    out = run_case("""
        start()

        @deferred_interrupt()
        def write_both():
            with deferred_interrupt():
                time.sleep(0.5)
            out["inner_done"] = now()        # reached: the outer section still holds it back
            time.sleep(0.2)
            out["outer_done"] = now()

        try:
            write_both()
            out["after"] = now()
        except HangInterrupted as err:
            taken(err)
    """)
    assert "inner_done" in out and "outer_done" in out and "after" not in out, out
    assert out["raised"] >= out["outer_done"]


def test_a_section_that_outlasts_the_bound_is_interrupted_inside(run_case):
    out = run_case("""
        start(bound=0.6, fire_at=0.2, resend=0.1)
        try:
            with deferred_interrupt():
                while True:                  # a section that never ends
                    time.sleep(0.05)
        except HangInterrupted as err:
            taken(err)
    """)
    assert out["type"] == "HangInterrupted" and out["was_pending"]
    assert out["fired"] + 0.6 <= out["raised"] < out["fired"] + 0.6 + 1.5, out


def test_it_is_not_raised_again_while_the_main_thread_handles_it_nor_in_a_taking_frame(run_case):
    out = run_case("""
        def hang():                          # the training function, hung
            while True:
                time.sleep(0.05)

        def recovery():                      # stands for _Recovery.run: it takes the interrupt
            try:
                hang()
            except HangInterrupted as err:
                caught = err
                # on its way out: signals and sections leave it be (the frameworks' exception paths)
                with deferred_interrupt():
                    time.sleep(0.05)
                interrupts.interrupt(None)
                time.sleep(0.3)
                out["handled_quietly"] = now()
            t = time.monotonic()             # in the taking frame itself: nothing raised either
            while time.monotonic() - t < 0.3:
                pass
            out["was_pending"] = interrupts.take() is caught
            STOP.set()

        interrupts.install(SIG, timedelta(seconds=30), takers=(recovery.__code__,))
        threading.Thread(target=watchdog, args=(0.2, 0.05), daemon=True).start()
        recovery()
    """)
    assert out["was_pending"] and "handled_quietly" in out, out


def test_a_checkpoint_write_the_stack_shows_holds_it_back_until_the_next_signal(run_case):
    out = run_case("""
        import fault_tolerant_handlers.detect.writes  # registers the stack's checkpoint writes
        start(resend=0.1)
        writes = 0
        try:
            while True:
                def save_checkpoint():       # a write the stack shows (Lightning's name for it)
                    time.sleep(0.3)
                save_checkpoint()
                writes += 1
                time.sleep(0.2)              # the step between two writes
        except HangInterrupted as err:
            taken(err)
        out["writes"] = writes
    """)
    # the signal at 0.2 s finds a write under way; a resend after it (between two writes) raises
    assert out["type"] == "HangInterrupted" and out["writes"] >= 1, out


def test_outside_the_main_thread_and_outside_a_recovery_a_section_is_a_plain_block():
    assert interrupts._pending is None
    with deferred_interrupt():
        interrupts.raise_pending()  # nothing pending: nothing raised
    seen = []

    def other():
        with deferred_interrupt():
            seen.append(interrupts._depth)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [0] and interrupts._depth == 0
    assert issubclass(HangInterrupted, BaseException) and not issubclass(HangInterrupted, Exception)


def test_the_watchdog_waits_past_interrupt_wait_for_a_deferred_section(run_case):
    """A section longer than INTERRUPT_WAIT (2 s) but within its bound: the watchdog does not give the
    rank up (it would end it with EXIT_HUNG); it sees it reach the recovery after the section."""
    out = run_case("""
        from fault_tolerant_handlers.detect.watchdog import Watchdog
        interrupts.install(SIG, timedelta(seconds=30))
        left = threading.Event()

        def dog():
            time.sleep(0.2)
            out["fired"] = now()
            interrupts.interrupt(HangInterrupted("rank 0 hung"))
            out["reached"] = Watchdog._interrupted(left)
            out["judged"] = now()

        thread = threading.Thread(target=dog)
        thread.start()
        try:
            with deferred_interrupt():
                time.sleep(3.0)
        except HangInterrupted as err:
            taken(err)
            left.set()
        thread.join()
    """)
    assert out["reached"] is True and out["raised"] >= 3.0 and out["judged"] < out["raised"] + 0.5, out


def test_the_bound_is_a_setting_with_an_env_override(monkeypatch, caplog):
    monkeypatch.delenv(config.INTERRUPT_DEFER_ENV, raising=False)
    assert config.settings().interrupt_defer == timedelta(seconds=30)
    monkeypatch.setenv(config.INTERRUPT_DEFER_ENV, "5")
    assert config.settings().interrupt_defer == timedelta(seconds=5)
    monkeypatch.setenv(config.INTERRUPT_DEFER_ENV, "0")
    with pytest.raises(ValueError, match="FTH_INTERRUPT_DEFER_SEC='0': expected a number of seconds from 0.1 to 3600"):
        config.load()
    monkeypatch.setenv(config.INTERRUPT_DEFER_ENV, "59")
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        problems = config.check_timings(config.load())
    assert any("FTH_INTERRUPT_DEFER_SEC=59" in p and "FTH_RECOVER_JOIN_SEC=60" in p for p in problems), problems


def test_after_the_recovery_took_one_no_interrupt_is_raised_in_its_callees_until_the_next_attempt(run_case):
    # A rank waiting in the all-reduce behind a hung peer: its own watchdog declares it hung a moment
    # after the peer's failure reached it, while its recovery stops that watchdog (a thread join).
    # Measured: the HangInterrupted raised in the join ended the recovery (exit 1, the job over).
    out = run_case("""
        def stopping_the_watchdog():        # a callee of the recovery, not its frame
            t = time.monotonic()
            while time.monotonic() - t < 0.4:
                time.sleep(0.01)

        interrupts.install(SIG, timedelta(seconds=30), takers=())
        interrupts.take()                    # the attempt ended: the recovery took it
        out["accepted"] = interrupts.interrupt(HangInterrupted("rank 3 hung"))
        out["taken"] = interrupts.taken()
        stopping_the_watchdog()
        out["recovered_quietly"] = True
        interrupts.arm()                     # the training function is called again
        out["armed"] = not interrupts.taken()
        try:
            interrupts.interrupt(HangInterrupted("rank 3 hung in the next attempt"))
            stopping_the_watchdog()
        except HangInterrupted as err:
            out["next_attempt"] = str(err)
    """)
    assert out["accepted"] is False and out["taken"] and out["recovered_quietly"], out
    assert out["armed"] and out["next_attempt"] == "rank 3 hung in the next attempt", out
