"""Benchmark: several recoveries in place in one run, each attempt's start phase by phase (is the first
recovery slower than the later ones, and where).

    .venv/bin/python bench/recoveries_in_one_run.py                      # Lightning, 4 ranks, 3 raises
    .venv/bin/python bench/recoveries_in_one_run.py --framework ignite --reps 3

``torchrun --standalone --nproc-per-node N --max-restarts 0 tests/resume_main.py`` with
``INPLACE=5``, one epoch of 70 iterations, a checkpoint every 10, and rank 1 raising at iteration
37, rank 2 at 44 (attempt 1), rank 3 at 51 (attempt 2): three recoveries in the same processes, each
from live state. Per recovery, from the start of the failing iteration (the failing rank's last traced
step + its median step time) to the slowest rank's: the training function called again
(``imported``), ``latest_checkpoint`` answered, and for Lightning the callbacks' ``setup`` (after
the library's session start), ``on_fit_start`` (the DDP wrapped), ``on_train_start`` (the state
restored, the loader's workers started), the first batch's start, the first trained step and the
second (the end of the first batch after a recovery in between).
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

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "resume_main.py"
FAULTS = "raise@rank=1,iteration=37; raise@rank=2,iteration=44,attempt=1; raise@rank=3,iteration=51,attempt=2"
NAMES = ("imported", "latest_checkpoint", "setup", "fit_start", "train_start", "first_batch")


def one_run(framework: str, world: int, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PG_TIMEOUT_SEC="20", EPOCHS="1", EVERY="10",
               SAMPLES=str(4 * world * 70), INPLACE="5", FTH_INJECT=FAULTS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "--max-restarts", "0", "--monitor-interval", "0.5", str(SCRIPT), framework, str(out)]
    with open(out / "log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}; see {out / 'log'}")
    rows = []
    for a in (1, 2, 3):
        starts = [json.loads((out / f"attempt{a}_rank{r}.json").read_text()) for r in range(world)]
        failing = [json.loads(line) for line in (out / f"batches{a}.jsonl").read_text().splitlines()]
        before = [e for e in failing if e["attempt"] == a - 1]
        steps = sorted(y["t"] - x["t"] for x, y in zip(before, before[1:]))
        fault = before[-1]["t"] + steps[len(steps) // 2]
        row = {n: max(s["marks"].get(n, float("nan")) - fault for s in starts) for n in NAMES}
        row["first step"] = max(s["first_step_at"] for s in starts) - fault
        row["second step"] = max([e["t"] for e in map(json.loads, (out / f"batches{r}.jsonl").read_text().splitlines())
                                  if e["attempt"] == a][1] for r in range(world)) - fault
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="lightning", choices=["lightning", "ignite"])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for a, row in enumerate(one_run(args.framework, args.world, Path(tmp) / f"run{rep}"), start=1):
                cells = ", ".join(f"{k} {v:.2f}" for k, v in row.items() if v == v)
                print(f"run {rep + 1}, recovery {a} (s after the fault): {cells}, load {os.getloadavg()[0]:.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
