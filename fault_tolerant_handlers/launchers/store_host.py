"""The job's c10d store on a host of its own, so that losing any training host leaves it standing
(``docs/recovering.md``)::

    python -m fault_tolerant_handlers.launchers.store_host --port 29400          # on node-s
    torchrun --nnodes N --node-rank i --rdzv-backend static --rdzv-endpoint node-s:29400 ... train.py

Served as torchrun serves its own, waiting for no workers, until ``SIGTERM`` or ``SIGINT`` (exit 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from typing import Sequence

import torch.distributed as dist

from ..core.config import STORE_HOST_CONNECT_TIMEOUT
from ..core.hooks import first_line

DEFAULT_PORT = 29400  # torchrun's rendezvous endpoint's when none is given


class StoreHostArgumentError(ValueError):
    """An argument of the store host is out of its range."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fault_tolerant_handlers.launchers.store_host",
        description="Serve a job's c10d store (torchrun's agent store) on a host of its own.")
    parser.add_argument("--port", type=str, default=str(DEFAULT_PORT),
                        help=f"TCP port to serve on, 1-65535 (default {DEFAULT_PORT})")
    parser.add_argument("--host", type=str, default="0.0.0.0",
                        help="the address this host's own client connects to and the log names (default 0.0.0.0; "
                             "the server listens on every interface, as torchrun's does)")
    args = parser.parse_args(argv)
    port, host = args.port, args.host
    if not port.strip().isdigit() or not 1 <= int(port) <= 65535:
        raise StoreHostArgumentError(f"store_host --port {port!r}: the port must be an integer in [1, 65535]")
    if not host or not host.strip() or any(c.isspace() for c in host):
        raise StoreHostArgumentError(f"store_host --host {host!r}: the host must be a non-empty address or name "
                                     "without spaces")
    args.port = int(port)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except StoreHostArgumentError as exc:
        print(f"fault-tolerant-handlers: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    stopped_by: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopped_by.append(signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:  # made as torchrun makes its own
            store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False, multi_tenant=True,
                                  use_libuv=True, timeout=STORE_HOST_CONNECT_TIMEOUT)
        except (RuntimeError, ValueError, OSError) as exc:  # the port is taken, the host unknown
            print(f"fault-tolerant-handlers: store_host --host {args.host} --port {args.port}: the store could not "
                  f"be served: {type(exc).__name__}: {first_line(exc, None)}",
                  file=sys.stderr, flush=True)
            return 1
        endpoint = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host  # an address others reach
        print(f"fault-tolerant-handlers: store host {socket.gethostname()} serves the job's c10d store on "
              f"{args.host}:{store.port} (pid {os.getpid()}); torchrun on every training host: "
              f"--rdzv-backend static --rdzv-endpoint {endpoint}:{store.port}", flush=True)
        while not stop.wait(1.0):  # a timed wait: the signal handler runs between waits
            pass
        print(f"fault-tolerant-handlers: store host {socket.gethostname()} stops ({stopped_by[0]})", flush=True)
        del store
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
