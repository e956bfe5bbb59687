"""How often torchrun's "Root Cause" names the rank that failed (raise, SIGKILL, hang).

    PYTHONPATH=. python bench/torchrun_root_cause.py --runs 20 --monitor-interval 0.1 1 --faults raise kill hang

Each run is a real 2-rank Ignite DDP training (``tests/ignite_main.py``) under
``python -m torch.distributed.run --nproc-per-node 2 --monitor-interval M``, with rank 1 failing at
iteration 3; ``USE_FT=0`` runs stock Ignite for comparison. A run counts as right when the Root
Cause block names rank 1 and the fault (the exception's text, ``SIGKILL`` or ``RankHung``), with the
library read from the file it wrote (``killed by SIGKILL``; for a kill, who wrote it is counted).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from launch import free_port, torchrun_root_cause as root_cause  # noqa: E402 - the tests' harness

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "ignite_main.py"
#: What the Root Cause must show for each fault (rank 1's own failure); with the library, read from
#: the error file it wrote (``killed by SIGKILL`` is its text; torch's own is ``Signal 9 (SIGKILL)``).
EXPECTED = {"raise": "CUDA-like failure", "kill": "SIGKILL", "hang": "RankHung"}
EXPECTED_OURS = dict(EXPECTED, kill="killed by SIGKILL")
FAULT_ENV = {
    "raise": dict(FAULT="step"),
    "kill": dict(FAULT="kill"),
    "hang": dict(FAULT="hang", HANG="3"),
}


def run_once(fault: str, monitor_interval: float, use_ft: bool, timeout: float = 90.0) -> tuple[int | None, str, str]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, USE_FT="1" if use_ft else "0", RERAISE="1", LINGER="0", PYTHONUNBUFFERED="1",
                   FTH_TEST_PG_TIMEOUT="20", **FAULT_ENV[fault])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               f"--monitor-interval={monitor_interval}", f"--master-port={free_port()}", str(SCRIPT), out]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            output += "\n(timed out)"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    rank, block = root_cause(output)
    return rank, block, output


def right(fault: str, rank: int | None, block: str, use_ft: bool = True) -> bool:
    if not use_ft:
        return rank == 1 and EXPECTED[fault] in block
    return rank == 1 and EXPECTED_OURS[fault] in block and "error_file: <N/A>" not in block


def writer(block: str) -> str:
    """Who wrote a killed rank's file: its liveness helper or a same-host survivor."""
    return "helper" if "written by its liveness helper" in block else "survivor" if "which saw it end" in block else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--monitor-interval", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--faults", nargs="+", default=list(EXPECTED), choices=list(EXPECTED))
    parser.add_argument("--stock", action="store_true", help="also run stock Ignite (USE_FT=0)")
    args = parser.parse_args()
    print(f"{'fault':6} {'monitor':>7} {'library':>8} {'right':>7}  root-cause ranks")
    for fault in args.faults:
        for interval in args.monitor_interval:
            for use_ft in ([True, False] if args.stock else [True]):
                ranks, good, start, writers = [], 0, time.monotonic(), []
                for _ in range(args.runs):
                    rank, block, output = run_once(fault, interval, use_ft)
                    ranks.append(rank)
                    writers.append(writer(block))
                    if right(fault, rank, block, use_ft):
                        good += 1
                    elif os.environ.get("VERBOSE"):
                        print(output[-4000:])
                wrote = (f"  file written by: helper {writers.count('helper')}, survivor {writers.count('survivor')}"
                         if fault == "kill" and use_ft else "")
                print(f"{fault:6} {interval:7.1f} {'ours' if use_ft else 'stock':>8} {good:3d}/{args.runs:<3d}  {ranks}"
                      f"  ({time.monotonic() - start:.0f} s){wrote}", flush=True)


if __name__ == "__main__":
    main()
