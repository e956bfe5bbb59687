"""How many of the package's modules a failure runs through: from a raise in an Ignite step to every
rank's exit, on 2 gloo ranks under torchrun with ``FaultTolerance`` attached.

    python bench/module_path.py            # prints the count, the modules and each one's first call

Every rank records every Python call into ``fault_tolerant_handlers`` on every thread
(``sys.setprofile`` and ``threading.setprofile``, installed before anything starts, idle until
armed) and in its forked helpers (the profile function survives ``fork``; the armed flag is a
shared page), from the moment of the raise: rank 1 arms just before it raises in iteration 3, rank 0
as iteration 3 starts. Calls go to ``<out>/calls.<pid>`` as they happen (a process ended with
``os._exit`` keeps what it wrote). ``tests/distributed/test_module_path.py`` keeps the count bounded.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PACKAGE = "fault_tolerant_handlers"
FAULT_RANK, FAULT_ITER = 1, 3


def _arm_tracer(out: Path):
    armed = mmap.mmap(-1, 1)  # MAP_SHARED | MAP_ANONYMOUS: a forked helper sees it armed too
    seen: set = set()
    fds: dict = {}

    def tracer(frame, event, arg):
        if event != "call" or not armed[0]:
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(PACKAGE):
            return
        pid = os.getpid()
        key = (pid, module, frame.f_code.co_qualname)
        if key in seen:
            return
        seen.add(key)
        fd = fds.get(pid)
        if fd is None:
            fd = fds[pid] = os.open(out / f"calls.{pid}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        line = {"rank": int(os.environ.get("RANK", -1)), "pid": pid, "thread": threading.current_thread().name,
                "module": module, "function": frame.f_code.co_qualname}
        os.write(fd, (json.dumps(line) + "\n").encode())

    sys.setprofile(tracer)
    threading.setprofile(tracer)

    def arm() -> None:
        armed[0] = 1

    return arm


def rank_main(out: Path) -> None:
    arm = _arm_tracer(out)
    import torch
    import torch.distributed as dist
    from ignite.engine import Engine, Events
    from torch import nn

    from fault_tolerant_handlers.ignite import FaultTolerance

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(engine, batch):
        if engine.state.iteration == FAULT_ITER:
            arm()
            if rank == FAULT_RANK:
                raise ValueError("bad sample 17")
        opt.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    trainer = Engine(step)
    FaultTolerance().attach(trainer)
    trainer.run([torch.randn(8, 4) for _ in range(10)], max_epochs=1)  # raises on every rank


def measure(timeout: float = 120.0) -> dict:
    """Run the job once; returns ``{"modules": [...], "calls": [...], "returncode": int, "output": str}``
    (killed at ``timeout``: its return code is then the kill's)."""
    with tempfile.TemporaryDirectory(prefix="fth-module-path-") as tmp:
        out = Path(tmp)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "0", __file__, "--rank", str(out)]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the job's whole session, by its leader's pid
            output, _ = proc.communicate()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        calls = []
        for path in sorted(out.glob("calls.*")):
            for line in path.read_text().splitlines():
                try:
                    calls.append(json.loads(line))
                except ValueError:
                    pass
    modules = sorted({c["module"] for c in calls})
    return {"modules": modules, "calls": calls, "returncode": proc.returncode,
            "output": output.decode(errors="replace")}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank":
        rank_main(Path(sys.argv[2]))
        return
    result = measure(float(os.environ.get("TIMEOUT", "240")))
    if result["returncode"] != 1:
        print(result["output"][-4000:])
    print(f"{len(result['modules'])} modules from the raise to every rank's exit (torchrun exit code "
          f"{result['returncode']}):")
    for module in result["modules"]:
        first = next(c for c in result["calls"] if c["module"] == module)
        functions = sorted({c["function"] for c in result["calls"] if c["module"] == module})
        print(f"  {module:55s} {len(functions):3d} functions (first: rank {first['rank']} "
              f"{first['thread']}: {first['function']})")


if __name__ == "__main__":
    main()
