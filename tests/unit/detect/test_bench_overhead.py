"""``bench/overhead.py``'s measuring code, on real threads and processes: the ``/proc`` parsing,
finding the library's threads and helper processes by name, their CPU between two samples, the
hook timer and the report tables. And the liveness thread's pidfd wait (``_pidwatch.py``). No
timing targets here: those are the bench's."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fault_tolerant_handlers.detect.watchdog import PidWatcher, WakeEvent

BENCH = Path(__file__).resolve().parents[3] / "bench" / "overhead.py"

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_overhead"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_overhead", None)


def test_stat_and_schedstat_lines_are_parsed(bench):
    # a comm with spaces and a ')' inside: fields are counted from the last ')'
    stat = "4242 (fth-x) (y) S 1 4242 4242 0 -1 4194304 102 0 0 0 250 50 7 9 20 0 3 0 31204 3133440 382"
    assert bench.stat_cpu_seconds(stat) == pytest.approx(300 / os.sysconf("SC_CLK_TCK"))
    assert bench.schedstat_seconds("1500000000 167454 12\n") == pytest.approx(1.5)
    me = Path(f"/proc/self/task/{threading.get_native_id()}")
    assert bench.stat_cpu_seconds((me / "stat").read_text()) >= 0


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_library_threads_and_helper_processes_are_found_and_their_cpu_counted(bench):
    stop = threading.Event()
    ours = threading.Thread(target=_spin, args=(stop,), name="fth-spin", daemon=True)
    other = threading.Thread(target=_spin, args=(stop,), name="user-spin", daemon=True)
    # a helper process that names itself fth-helper (its comm), and one that does not
    helper = subprocess.Popen([sys.executable, "-c", "open('/proc/self/comm', 'w').write('fth-helper')\n"
                               "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)"])
    try:
        ours.start()
        other.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            tasks = bench.library_tasks()
            if any(label.startswith("fth-helper/") for label in tasks):
                break
            time.sleep(0.05)
        labels = sorted(tasks)
        assert f"fth-spin/{ours.native_id}" in labels
        assert f"fth-helper/pid {helper.pid}" in labels
        assert not any(label.startswith("user-spin") or str(plain.pid) in label for label in labels)
        spin, helper_label = f"fth-spin/{ours.native_id}", f"fth-helper/pid {helper.pid}"
        before = bench.cpu_of(tasks)
        start = time.monotonic()
        while time.monotonic() - start < 15:  # a busy machine may give the spinners little CPU
            time.sleep(0.2)
            delta = bench.cpu_delta(before, bench.cpu_of(tasks))
            if delta[spin][1] > 0.02 and delta[helper_label][1] > 0.02:
                break
        elapsed = time.monotonic() - start
        stat, sched = delta[spin]
        assert sched is not None and 0.02 < sched <= elapsed + 0.05  # one thread: never more than the wall time
        assert 0 <= stat <= elapsed + 0.05
        assert delta[helper_label][1] > 0.02  # a whole process, counted from /proc/<pid>
        # a task gone by the second sample is left out; one new in it counts whole
        assert bench.cpu_delta({"gone": (1.0, 1.0)}, {"new": (0.25, 0.5)}) == {"new": (0.25, 0.5)}
    finally:
        stop.set()
        for proc in (helper, plain):
            proc.kill()
            proc.wait()
        ours.join(5)
        other.join(5)


def test_the_hook_timer_subtracts_its_baseline(bench):
    values = bench.per_call_us(lambda: sum(range(200)), lambda: None, calls=200, repeats=3)
    assert len(values) == 3 and all(v > 0 for v in values)
    same = bench.per_call_us(lambda: None, lambda: None, calls=2000, repeats=5)
    assert abs(sorted(same)[2]) < min(values)


def test_report_tables_and_the_last_line_fields(bench):
    rows, worst = bench.ratio_rows({"ignite/small": ([0.010, 0.012], [0.011, 0.012]),
                                    "ignite/large": ([0.100, 0.100], [0.099, 0.101])})
    assert rows[2] == "| ignite/small | 11.00 | 11.50 | 1.050 | 1.000-1.100 |"
    assert worst == {"ignite": pytest.approx(1.05)}
    rank = {"sched": 0.004, "stat": 0.003, "process": 0.3, "store_ops_per_s": 4.0, "steps_per_s": 100.0,
            "windows": [{"sched": 0.003, "stat": 0.0}, {"sched": 0.005, "stat": 0.01}],
            "threads": {"fth-watchdog/11": [0.003, 0.0035], "fth-liveness/12": [0.0, 0.0005]}}
    rows, cpu = bench.cpu_rows({2: [rank, dict(rank, sched=0.002)]})
    assert cpu == pytest.approx(0.004)
    assert rows[2].startswith("| 2 | 0.300 (0.200-0.400) | 0.400 (0.300-0.500) | 0.300 (0.300-0.300) | 30 | 4.0 | 100 |")
    threads = bench.thread_rows({2: [rank]})
    assert threads[2:] == ["| 2 | fth-liveness | 0.050 (0.050-0.050) |", "| 2 | fth-watchdog | 0.350 (0.350-0.350) |"]
    rows, hook = bench.hook_rows({"ignite": {"hook_us": [1.0, 2.0, 3.0], "agreement_us": [400.0] * 3,
                                             "all_reduce_us": [300.0] * 3, "sync_every": 100}})
    assert hook == pytest.approx(6.0) and rows[2].endswith("| 100 | 6.00 |")
    rows, _ = bench.hook_rows({"lightning": {"hook_us": [8.0] * 3, "agreement_us": [700.0] * 3,
                                             "all_reduce_us": [300.0] * 3, "sync_every": 100,
                                             "noop_callback_us": [5.0, 6.0, 7.0], "direct_us": [2.0] * 3}})
    assert rows[3] == ("lightning hooks per step, split: the framework's dispatch of any callback (a no-op Callback) "
                       "6.00 (5.00-7.00) us; the callback's own code called directly 2.00 (2.00-2.00) us")


def test_pid_watcher_wakes_when_a_peer_process_is_killed():
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stop = WakeEvent()
    watcher = PidWatcher([peer.pid], stop, fallback=5.0)
    try:
        assert watcher.polled == []  # a pidfd: no periodic check
        assert watcher.wait() is True  # the first call asks for one check
        threading.Timer(0.3, os.kill, (peer.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        assert watcher.wait() is True  # only the death ends this wait (no periodic wake-up)
        assert 0.25 < time.monotonic() - start < 3.0
        assert watcher.polled == [peer.pid]  # its pidfd stays readable: checked every fallback from now on
    finally:
        watcher.close()
        peer.kill()
        peer.wait()


def test_pid_watcher_returns_when_the_event_is_set_and_polls_pids_without_a_pidfd(monkeypatch):
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stop = WakeEvent()
    watcher = PidWatcher([peer.pid], stop, fallback=5.0)
    try:
        watcher.wait()
        threading.Timer(0.2, stop.set).start()
        start = time.monotonic()
        assert watcher.wait() is False and stop.is_set()
        assert time.monotonic() - start < 3.0
        assert watcher.wait() is False  # set: returns at once
    finally:
        watcher.close()

    def no_pidfd(pid):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    watcher = PidWatcher([peer.pid], WakeEvent(), fallback=0.05)
    try:
        assert watcher.polled == [peer.pid]
        watcher.wait()
        start = time.monotonic()
        assert watcher.wait() is True  # after one fallback period: check the pid
        assert 0.03 < time.monotonic() - start < 3.0
    finally:
        watcher.close()
        peer.kill()
        peer.wait()
