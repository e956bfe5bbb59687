"""The liveness helper is forked from a rank whose other threads run: what the helper needs must
not be half-imported by one of them at the fork (it would stay locked in the helper for ever)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

#: A rank: the library imported, then a thread inside an import of the idna codec (the first
#: host-name lookup of a process imports it; the watchdog's connect makes one) when the helper is
#: forked; the child then resolves the store's address as its connect does.
FORK_MID_IMPORT = textwrap.dedent("""
    import os, socket, sys, threading, time
    import fault_tolerant_handlers  # noqa: F401

    entered = threading.Event()

    class SlowImport:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "encodings.idna":
                entered.set()
                time.sleep(5)
            return None

    sys.meta_path.insert(0, SlowImport)
    threading.Thread(target=lambda: "store-host".encode("idna"), daemon=True).start()
    entered.wait(1.0)
    pid = os.fork()
    if pid == 0:
        socket.getaddrinfo("127.0.0.1", 29500)
        os._exit(0)
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("resolved" if status == 0 else f"failed {status}")
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("stuck")
""")


def test_a_helper_forked_while_another_thread_imports_can_resolve_the_store_host():
    out = subprocess.run([sys.executable, "-c", FORK_MID_IMPORT], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "resolved", (out.stdout, out.stderr[-2000:])
