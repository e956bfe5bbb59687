"""Reading the main thread's frame from another thread never lets the garbage collector run inside
``sys._current_frames()``: a collection there that frees a process group (its destructor lets go of
the GIL) deadlocked a signal's reaction with an exiting thread (CPython 3.11, seen in the suite)."""

import gc
import sys
import threading

from fault_tolerant_handlers.core import procfs


def test_the_collector_is_held_off_while_the_frames_are_read_and_restored_after(monkeypatch):
    seen = []
    real = sys._current_frames
    monkeypatch.setattr(sys, "_current_frames", lambda: seen.append(gc.isenabled()) or real())
    got = []
    reader = threading.Thread(target=lambda: got.append(procfs.main_thread_frame()))
    reader.start()
    reader.join()
    assert seen == [False] and got[0] is not None
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled():
    gc.disable()
    try:
        assert procfs.main_thread_frame() is not None
        assert not gc.isenabled()
    finally:
        gc.enable()
