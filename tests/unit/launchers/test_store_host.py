"""The store host (``python -m fault_tolerant_handlers.launchers.store_host``) as an operator meets
it: a bad argument is named with its range before anything is served; a taken port ends it with the
reason; served, clients of other processes share one store, a client that goes does not end it, and
SIGTERM or SIGINT stops it with exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from fault_tolerant_handlers.launchers import store_host

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("argv, named", [
    (["--port", "0"], "--port '0': the port must be an integer in [1, 65535]"),
    (["--port", "65536"], "--port '65536': the port must be an integer in [1, 65535]"),
    (["--port", "x29400"], "--port 'x29400': the port must be an integer in [1, 65535]"),
    (["--host", ""], "--host '': the host must be a non-empty address or name without spaces"),
    (["--host", "node s"], "--host 'node s': the host must be a non-empty address or name without spaces"),
])
def test_an_argument_out_of_range_is_named_with_its_range_and_nothing_is_served(argv, named, capsys):
    with pytest.raises(store_host.StoreHostArgumentError, match=named.replace("[", r"\[").replace("]", r"\]")):
        store_host.parse_args(argv)
    assert store_host.main(argv) == 2
    assert f"fault-tolerant-handlers: store_host {named}" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "fault_tolerant_handlers.launchers.store_host", "--port", str(port),
                             "--host", "127.0.0.1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _serving(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The store host's first line, once it serves (bounded: the process is killed on the way out)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"the store host ended with {proc.returncode}: {proc.stderr.read()}")
        line = proc.stdout.readline()
        if line:
            return line
    pytest.fail("the store host said nothing")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clients_share_the_store_one_leaving_ends_nothing_and_a_signal_stops_it_with_exit_0(sig):
    port = _free_port()
    proc = _start(port)
    try:
        line = _serving(proc)
        assert f"serves the job's c10d store on 127.0.0.1:{port} (pid {proc.pid})" in line, line
        first = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        first.set("fth/probe", b"from the first client")
        del first  # a client that goes (a lost host's rank): the store stays
        second = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        assert second.get("fth/probe") == b"from the first client"
        assert proc.poll() is None
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        assert f"stops ({sig.name})" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.timeout(120)
def test_a_taken_port_ends_the_store_host_with_exit_1_naming_the_port():
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        taken.bind(("0.0.0.0", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _start(port)
        try:
            assert proc.wait(timeout=60) == 1
            err = proc.stderr.read()
            assert f"store_host --host 127.0.0.1 --port {port}: the store could not be served: " in err, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
