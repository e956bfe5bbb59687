"""Start a small job of real rank processes for a benchmark, bounded in time, cleaned up by PID."""

from __future__ import annotations

import os
import signal
from pathlib import Path
import subprocess
import sys
import time


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from launch import free_port  # noqa: E402 - the one free-port helper of the project (tests' harness)


def run_job(world: int, argv: list[str], *, deadline: float, env: dict[str, str] | None = None,
            quiet_ranks: bool = True) -> None:
    """Run ``python <argv>`` once per rank with torchrun's environment; wait up to ``deadline``
    seconds; then kill every process started (its whole session), finished or not."""
    port = free_port()
    procs = []
    try:
        for rank in range(world):
            rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            NODE_RANK="0", **(env or {}))
            quiet = quiet_ranks or rank > 0
            procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL if quiet else None, start_new_session=True))
        end = time.monotonic() + deadline
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.1)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
