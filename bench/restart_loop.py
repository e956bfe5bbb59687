"""Do restarted attempts come up? One torchrun job that fails and restarts N times in a row.

    .venv/bin/python bench/restart_loop.py                     # Lightning, 20 restarts, the fix on
    .venv/bin/python bench/restart_loop.py --framework ignite
    .venv/bin/python bench/restart_loop.py --no-fix            # FTH_ATTEMPT_STORE=0: torch's shared store as is

``torchrun --standalone --nproc_per_node 2 --max-restarts N tests/resume_main.py`` with
``FaultTolerance`` attached; rank 1 raises at iteration 5 of attempts 0 .. N-1 (``FTH_INJECT`` with
one ``attempt=`` per attempt), attempt N trains to the end. An attempt *came up* when both its ranks
trained their first step (the script records it); an attempt that died before, in
``init_process_group`` or in the side group's setup, did not (its log shows
``Gloo connectFullMesh failed``). Prints the count of restarts that came up and the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from launch import kill_workers  # noqa: E402 - the tests' harness

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "resume_main.py"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["ignite", "lightning"], default="lightning")
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--no-fix", action="store_true", help="FTH_ATTEMPT_STORE=0")
    args = parser.parse_args()
    n = args.restarts
    inject = "; ".join(f"raise@rank=1,iteration=5,attempt={a}" for a in range(n))
    with tempfile.TemporaryDirectory(prefix="fth-restart-loop-") as tmp:
        out = Path(tmp)
        env = dict(os.environ, PYTHONPATH=str(ROOT), EPOCHS="1", EVERY="1000", WORKERS="0", RESUME="0",
                   FTH_INJECT=inject, PG_TIMEOUT_SEC="20", FTH_ATTEMPT_STORE="0" if args.no_fix else "1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", str(n), "--monitor-interval", "0.5", str(SCRIPT), args.framework, str(out)]
        with open(out / "log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=60 + 25 * (n + 1))
            except subprocess.TimeoutExpired:
                print("deadline passed: killing the job")
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                kill_workers(out)
        text = (out / "log").read_text()
        up = []
        for a in range(n + 1):
            ranks = [out / f"attempt{a}_rank{r}.json" for r in (0, 1)]
            if all(p.exists() and "first_step_at" in json.loads(p.read_text()) for p in ranks):
                up.append(a)
        restarts_up = len([a for a in up if a > 0])
        print(f"{args.framework}, fix {'off' if args.no_fix else 'on'}: attempts that came up: {up}")
        print(f"restarts that came up: {restarts_up} of {n}; 'connectFullMesh failed' in the log: "
              f"{text.count('connectFullMesh failed')}; torchrun exit status {proc.returncode}")
        return 0 if restarts_up == n and proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
