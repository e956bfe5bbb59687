"""Fault detection, stock vs. with the handlers: how long after a fault every process of a 2-rank job
has exited (or the run recovered), whether every rank reported the root cause, and what was left running.

    python bench/detection.py             # the full matrix (about 25 minutes on 2 cores)
    python bench/detection.py --quick     # one launcher per framework (Ignite torchrun, Lightning ddp)
    python bench/detection.py --launchers lightning/ddp --scenarios hang oec   # a few cells

Scenarios x launchers (2 ranks, gloo, CPU): every cell starts the real rank program
(``tests/ignite_main.py`` or ``tests/lightning_main.py``) as its own process tree in a new session, once
stock (no ``FaultTolerance``, process-group timeout ``--pg-timeout``, 20 s by default) and once with the
handlers (``FaultTolerance``, the default 30-minute timeout, hang detection at ``--hang-timeout`` for the
hang). Faults that ``FTH_INJECT`` can express (raise, kill, hang, worker-kill) are injected with it, at
iteration 3 on rank 1; stock programs fire the same injection themselves at the same point. The rank
programs run as real scripts would: the failing rank does not linger, and what a rank's run raised is
re-raised (``LINGER=0 RERAISE=1``), so launchers see the failure.

Measured per run, from the fault (the rank program's ``fault`` event, wall clock):
* **seconds** until every rank process and the launcher have exited (or, for a restarted DataLoader
  worker, until the failing rank completed its first iteration after the restart: "recovered");
  ``>N`` when the job was still running at the deadline (then killed);
* **root cause on every rank**: every rank that can speak (not a SIGKILLed one) said what happened:
  what its run raised, or its reported exit on stderr, contains the fault's message;
* **leaked processes**: processes of the job (descendants of the launched process, and members of any
  session they were in) still alive ``--grace`` seconds after that; every one is then killed by PID.

Writes ``bench/out/detection.md``, ``bench/out/detection.png`` and ``bench/out/detection.json`` (per-rank
details); ``--docs`` (the default for a full run) also copies the table and chart to ``docs/``. Runs'
outputs stay in ``bench/out/detection-runs/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import free_port  # noqa: E402
from launch import read_events  # noqa: E402 - via _ranks, which puts tests/ on the path
from fault_tolerant_handlers.core import procfs as _procfs

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
DOCS = ROOT / "docs"
PROGRAMS = {"ignite": ROOT / "tests" / "ignite_main.py", "lightning": ROOT / "tests" / "lightning_main.py"}
#: The rank that fails and the iteration at which it fails (1-based, as FTH_INJECT counts).
FAULT_RANK, FAULT_ITER = 1, 3
OURS_PG_TIMEOUT = 1800.0  # torch's gloo default: the handlers must not need a short one


@dataclass(frozen=True)
class Launcher:
    framework: str  # ignite | lightning
    name: str  # torchrun | idist.Parallel | ddp | ddp_spawn

    @property
    def key(self) -> str:
        return f"{self.framework}/{self.name}"

    @property
    def label(self) -> str:
        return f"{self.framework.capitalize()} {self.name}"


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    signature: str  # text every rank's report must contain to count as naming the root cause
    fault_rank: int = FAULT_RANK
    inject: str | None = None  # FTH_INJECT kind


LAUNCHERS = [Launcher("ignite", "torchrun"), Launcher("ignite", "idist.Parallel"),
             Launcher("lightning", "ddp"), Launcher("lightning", "ddp_spawn")]
QUICK = ("ignite/torchrun", "lightning/ddp")
SCENARIOS = [
    Scenario("raise", "raise in step", f"raise@rank={FAULT_RANK},iteration={FAULT_ITER}", inject="raise"),
    Scenario("rank_first", "raise in rank-first section", "mirror unreachable", fault_rank=0),
    Scenario("exc_collective", "raise + collective in exception handler", "CUDA-like failure"),
    Scenario("oec", "raise with OnExceptionCheckpoint", f"raise@rank={FAULT_RANK},iteration={FAULT_ITER}",
             inject="raise"),
    Scenario("kill", "SIGKILL", "SIGKILL", inject="kill"),
    Scenario("hang", "hang", "hung", inject="hang"),
    Scenario("worker_kill", "DataLoader worker SIGKILL", "DataLoader worker", inject="worker-kill"),
]
#: (launcher key or framework, scenario key) -> why the cell does not apply
NOT_APPLICABLE = {
    ("ignite", "oec"): "OnExceptionCheckpoint is a Lightning callback",
    ("lightning/ddp_spawn", "exc_collective"): "with ddp_spawn Lightning runs on_exception in the parent only, "
                                               "outside the process group: no collective to block on",
}


def not_applicable(launcher: Launcher, scenario: Scenario) -> str | None:
    return NOT_APPLICABLE.get((launcher.key, scenario.key)) or NOT_APPLICABLE.get((launcher.framework, scenario.key))


def run_env(launcher: Launcher, scenario: Scenario, ours: bool, *, pg_timeout: float, hang_timeout: float) -> dict:
    """The rank program's environment for one cell (see the programs' docstrings)."""
    env = dict(USE_FT="1" if ours else "0", LINGER="0", RERAISE="1", FAULT="none", FAULT_RANK=str(scenario.fault_rank),
               FTH_TEST_PG_TIMEOUT=str(OURS_PG_TIMEOUT if ours else pg_timeout), PYTHONUNBUFFERED="1")
    if scenario.inject:
        env["FTH_INJECT"] = f"{scenario.inject}@rank={scenario.fault_rank},iteration={FAULT_ITER}"
    if scenario.key in ("rank_first", "exc_collective"):
        env["FAULT"] = scenario.key
        env["FAULT_ITER"] = str(FAULT_ITER)  # Ignite: engine.state.iteration
        env["FAULT_STEP"] = str(FAULT_ITER - 1)  # Lightning: trainer.global_step
    if scenario.key == "oec":
        env["OEC"] = "1"
    if scenario.key == "hang" and ours:
        env["FTH_HANG_TIMEOUT_SEC"] = str(hang_timeout)
    if scenario.key == "worker_kill":
        env.update(WORKERS="2", ITER_EVENTS="1", RESTARTABLE="1" if ours else "0")
    if launcher.key == "ignite/idist.Parallel":
        env["LAUNCH"] = "parallel"
    if launcher.framework == "lightning":
        env.update(LAUNCH=launcher.name, FTH_TEST_TOP="1")
    return env


# -- the job's processes -------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, session id, start time) of a process, or None if it is gone."""
    fields = _procfs.stat_fields(pid)
    if fields is None:
        return None
    return (fields[_procfs.STATE], int(fields[_procfs.PPID]), int(fields[_procfs.SESSION]),
            int(fields[_procfs.START_TIME]))


def _all_processes() -> dict[int, tuple[str, int, int, int]]:
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                procs[int(name)] = st
    return procs


class JobProcesses:
    """Every process of a job: descendants of the process started (seen while their parent lived) and
    the members of every session a job process was in (so orphans are still found). Processes are
    identified by pid and start time, so a reused pid is not mistaken for a job process."""

    def __init__(self, top_pid: int) -> None:
        st = _stat(top_pid)
        self.known: dict[int, int] = {top_pid: st[3] if st else -1}
        self.sessions: set[int] = {top_pid} if st and st[2] == top_pid else set()
        self.first_dead: dict[int, float] = {}

    def poll(self) -> set[int]:
        """Scan /proc; return the job's live (non-zombie) pids."""
        procs = _all_processes()
        now = time.time()
        grown = True
        while grown:
            grown = False
            for pid, (state, ppid, sid, start) in procs.items():
                if pid in self.known:
                    continue
                parent_known = ppid in self.known and procs.get(ppid, (None, 0, 0, None))[3] == self.known[ppid]
                if parent_known or sid in self.sessions:
                    self.known[pid] = start
                    if sid != os.getsid(0):
                        self.sessions.add(sid)
                    grown = True
        alive = {pid for pid, start in self.known.items()
                 if pid in procs and procs[pid][3] == start and procs[pid][0] not in ("Z", "X")}
        for pid in self.known:
            if pid not in alive:
                self.first_dead.setdefault(pid, now)
        return alive

    def kill_all(self) -> int:
        """SIGKILL every live job process by pid (and the session the bench created); return how many."""
        alive = self.poll()
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return len(alive)


# -- one run -------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    seconds: float | None = None  # fault -> every process exited (or recovered); None: no fault seen
    timed_out: bool = False  # still running at the deadline (then killed)
    recovered: bool = False
    cause_ranks: int = 0  # ranks that reported the root cause
    speaking_ranks: int = 0  # ranks that could (a SIGKILLed rank cannot)
    leaked: int = 0  # job processes alive `grace` s after the end (or at the deadline, if timed_out)
    deadline_after_fault: float | None = None
    ranks: dict = field(default_factory=dict)  # per-rank details for the JSON
    returncode: int | None = None
    error: str | None = None  # the run did not go as designed (e.g. the fault never fired)


def _rank_pids(outdir: Path, world: int) -> dict[int, int]:
    pids = {}
    for r in range(world):
        for e in read_events(outdir, r):
            if e.get("pid"):
                pids[r] = int(e["pid"])
                break
    return pids


def reported_exit(output: str, rank: int) -> str | None:
    """The watchdog's reported exit of ``rank`` on the job's stderr, if any."""
    marker = f"[rank {rank}] fault-tolerant-handlers: ending this process"
    i = output.find(marker)
    return output[i:i + 1500] if i >= 0 else None


def logged_cause(output: str, rank: int, signature: str) -> str | None:
    """A line ``rank`` logged (the library's ``[rank R]``/``[rank R step S]`` prefix) naming the fault,
    other than the injection's own announcement."""
    for line in output.splitlines():
        if (line.startswith((f"[rank {rank}]", f"[rank {rank} step ")) and signature in line
                and "injecting" not in line):
            return line[:160]
    return None


def judge_rank(events: list[dict], output: str, rank: int, signature: str) -> tuple[bool | None, str]:
    """Did ``rank`` report the root cause? (True/False, what it said); None when its run completed."""
    raised = [e for e in events if e.get("event") == "run_raised"]
    if raised:
        e = raised[0]
        text = " ".join(str(e.get(k, "")) for k in ("raised", "message", "exc_type", "exc_message"))
        return signature in text, f"{e.get('raised')}: {str(e.get('message', '')).splitlines()[0][:160] if e.get('message') else ''}"
    exit_report = reported_exit(output, rank)
    if exit_report is not None and signature in exit_report:
        return True, exit_report.splitlines()[1][:160] if "\n" in exit_report else exit_report
    line = logged_cause(output, rank, signature)
    if line is not None:  # e.g. a hung rank that its launcher ended before its reported exit
        return True, f"logged: {line}"
    if any(e.get("event") == "run_returned" for e in events):
        return None, "run completed"
    return False, "ended without a word"


def run_cell(launcher: Launcher, scenario: Scenario, ours: bool, *, pg_timeout: float, hang_timeout: float,
             deadline: float, grace: float, workdir: Path) -> RunResult:
    outdir = workdir / f"{launcher.key.replace('/', '-')}-{scenario.key}-{'ours' if ours else 'stock'}"
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    port = free_port()
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "FTH_INJECT",
                "FTH_HANG_TIMEOUT_SEC", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.update(run_env(launcher, scenario, ours, pg_timeout=pg_timeout, hang_timeout=hang_timeout))
    script = PROGRAMS[launcher.framework]
    cmd = [sys.executable]
    if launcher.name == "torchrun":
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}"]
    cmd += [str(script), str(outdir)]
    log = open(outdir / "output.log", "w+")
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    job = JobProcesses(proc.pid)
    result = RunResult()
    top_exit = None
    ended_at = None
    try:
        while time.time() - started < deadline:
            alive = job.poll()
            if top_exit is None and proc.poll() is not None:
                top_exit = time.time()
            ranks = _rank_pids(outdir, 2)
            if top_exit is not None and not any(pid in alive for pid in ranks.values()):
                ended_at = max([top_exit] + [job.first_dead.get(pid, top_exit) for pid in ranks.values()])
                break
            time.sleep(0.05)
        if ended_at is None:
            result.timed_out = True
            result.leaked = len(job.poll())
        else:
            until = time.time() + grace
            while time.time() < until:
                alive = job.poll()
                time.sleep(0.1)
            result.leaked = len(job.poll())
    finally:
        job.kill_all()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        time.sleep(0.2)
        job.kill_all()  # anything started while the first pass ran
    result.returncode = proc.returncode
    log.seek(0)
    output = log.read()
    log.close()

    events = {r: read_events(outdir, r) for r in range(2)}
    faults = [e["t"] for r in range(2) for e in events[r] if e.get("event") == "fault"]
    if not faults:
        result.error = "the fault never fired"
        (outdir / "error.txt").write_text(output[-5000:])
        return result
    t_fault = min(faults)
    result.deadline_after_fault = started + deadline - t_fault
    returned = [any(e.get("event") == "run_returned" for e in events[r]) for r in range(2)]
    if all(returned):
        result.recovered = True
        restart = [e["t"] for e in events[scenario.fault_rank] if e.get("event") == "dataloader_restart"]
        after = restart[0] if restart else t_fault
        done = [e["t"] for e in events[scenario.fault_rank]
                if e.get("event") == "iteration_completed" and e["t"] > after]
        result.seconds = (done[0] if done else after) - t_fault
    elif ended_at is not None:
        result.seconds = max(0.0, ended_at - t_fault)
    for r in range(2):
        if scenario.key == "kill" and r == scenario.fault_rank:
            result.ranks[r] = dict(said="SIGKILLed (cannot report)", cause=None)
            continue
        cause, said = judge_rank(events[r], output, r, scenario.signature)
        said = said if cause is not False or result.timed_out else said + f" (job exit code {proc.returncode})"
        result.ranks[r] = dict(said=said, cause=cause)
        if cause is not None:
            result.speaking_ranks += 1
            result.cause_ranks += bool(cause)
    return result


# -- formatting ----------------------------------------------------------------------------------------


def format_seconds(r: RunResult | None) -> str:
    if r is None:
        return "n/a"
    if r.error:
        return f"error: {r.error}"
    if r.timed_out and not r.recovered:
        return f">{r.deadline_after_fault:.0f} (killed)"
    text = f"{r.seconds:.2f}" if r.seconds < 10 else f"{r.seconds:.1f}"
    return f"{text} recovered" if r.recovered else text


def format_cause(r: RunResult | None) -> str:
    if r is None:
        return "n/a"
    if r.error:
        return "?"
    if r.recovered:
        return "(recovered)"
    if r.speaking_ranks == 0:
        return "no"
    every = r.cause_ranks == r.speaking_ranks
    return f"{'yes' if every else 'no'} ({r.cause_ranks}/{r.speaking_ranks})"


def format_leaked(r: RunResult | None) -> str:
    if r is None:
        return "n/a"
    if r.timed_out and not r.recovered:
        return f"{r.leaked} alive at deadline"
    return str(r.leaked)


@dataclass
class Cell:
    launcher: Launcher
    scenario: Scenario
    stock: RunResult | None  # None: not applicable
    ours: RunResult | None


def table_rows(cells: list[Cell]) -> list[list[str]]:
    return [[c.launcher.label, c.scenario.label, format_seconds(c.stock), format_seconds(c.ours),
             format_cause(c.stock), format_cause(c.ours), format_leaked(c.stock), format_leaked(c.ours)]
            for c in cells]


def markdown_table(cells: list[Cell], pg_timeout: float) -> str:
    head = ["framework / launcher", "scenario", f"stock s (pg timeout {pg_timeout:g} s)", "ours s",
            "root cause on every rank: stock", "ours", "leaked processes: stock", "ours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(cells)]
    return "\n".join(lines)


def notes(cells: list[Cell], args) -> str:
    out = [
        f"Seconds from the fault until every process of the job exited (or, marked *recovered*, until the failing "
        f"rank completed its first iteration after a DataLoader restart). Stock: process-group timeout "
        f"{args.pg_timeout:g} s (torch's default for gloo is 30 minutes); ours: the default 30 minutes, and "
        f"`FTH_HANG_TIMEOUT_SEC={args.hang_timeout:g}` for the hang. `>N (killed)`: still running at the "
        f"deadline ({args.deadline:g} s after the start), then killed. Root cause: ranks that named the fault "
        f"(what their run raised, or their reported exit) out of the ranks that could speak (a SIGKILLed rank "
        f"cannot). Leaked: processes of the job still alive {args.grace:g} s after the last rank and the launcher "
        f"exited. 2 ranks, gloo, CPU; faults on rank 1 at iteration {FAULT_ITER} (rank 0 for the rank-first "
        f"section), injected with `FTH_INJECT` where it can express them.",
        "",
    ]
    seen = set()
    for c in cells:
        why = not_applicable(c.launcher, c.scenario)
        if why and (c.launcher.framework, c.scenario.key) not in seen:
            seen.add((c.launcher.framework, c.scenario.key))
            where = c.launcher.key if (c.launcher.key, c.scenario.key) in NOT_APPLICABLE else c.launcher.framework
            out.append(f"* n/a, {where}, {c.scenario.label}: {why}.")
    return "\n".join(out)


def chart(cells: list[Cell], path: Path, *, pg_timeout: float, title_extra: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    launchers = list(dict.fromkeys(c.launcher for c in cells))
    scenarios = list(dict.fromkeys(c.scenario for c in cells))
    fig, axes = plt.subplots(len(launchers), 1, figsize=(12, 2.9 * len(launchers) + 1.2), squeeze=False)
    floor, top = 0.01, 2000.0
    colors = {"stock": "#c0504d", "ours": "#4f81bd"}
    for ax, launcher in zip(axes[:, 0], launchers):
        row = {c.scenario: c for c in cells if c.launcher == launcher}
        for i, scenario in enumerate(scenarios):
            c = row.get(scenario)
            for j, side in enumerate(("stock", "ours")):
                r = getattr(c, side) if c else None
                x = i + (j - 0.5) * 0.38
                if r is None:
                    ax.text(x, floor * 1.5, "n/a", ha="center", va="bottom", fontsize=7, color="grey")
                    continue
                if r.error or r.seconds is None and not r.timed_out:
                    ax.text(x, floor * 1.5, "error", ha="center", va="bottom", fontsize=7)
                    continue
                value = r.deadline_after_fault if (r.timed_out and not r.recovered) else max(r.seconds, floor)
                ax.bar(x, value, width=0.36, color=colors[side], hatch="//" if r.timed_out else None,
                       edgecolor="white" if r.timed_out else colors[side], label=side if i == 0 else None)
                text = format_seconds(r).replace(" (killed)", " killed").replace(" recovered", "\nrecovered")
                mark = "" if r.recovered else ("\ncause ✓" if r.speaking_ranks and r.cause_ranks == r.speaking_ranks
                                               else "\ncause ✗")
                if r.leaked:
                    mark += f"\n{r.leaked} left alive" if r.timed_out else f"\n{r.leaked} leaked"
                ax.text(x, value * 1.15, text + mark, ha="center", va="bottom", fontsize=6.5)
        ax.set_yscale("log")
        ax.set_ylim(floor, top)
        ax.set_xticks(range(len(scenarios)))
        ax.set_xticklabels([s.label.replace(" + ", "\n+ ").replace(" with ", "\nwith ").replace(" in ", "\nin ")
                            for s in scenarios], fontsize=8)
        ax.set_ylabel("seconds (log)")
        ax.set_title(launcher.label, fontsize=10, loc="left")
        ax.axhline(pg_timeout, color="grey", lw=0.6, ls="--")
        ax.grid(axis="y", which="major", lw=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors["stock"]), plt.Rectangle((0, 0), 1, 1, color=colors["ours"]),
               plt.Line2D([0], [0], color="grey", lw=0.6, ls="--")]
    fig.legend(handles, ["stock", "with fault-tolerant-handlers", f"stock process-group timeout ({pg_timeout:g} s)"],
               loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"Fault until every process exited, 2 ranks gloo CPU; stock with a {pg_timeout:g} s "
                 f"process-group timeout, ours with the default 30 min\n{title_extra}", fontsize=10, x=0.01,
                 ha="left")
    fig.tight_layout(rect=(0, 0.03, 1, 1 - 0.45 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ----------------------------------------------------------------------------------------------


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--launchers", nargs="+", choices=[launcher.key for launcher in LAUNCHERS])
    p.add_argument("--scenarios", nargs="+", choices=[s.key for s in SCENARIOS])
    p.add_argument("--pg-timeout", type=float, default=20.0, help="stock runs' process-group timeout, s")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="ours: FTH_HANG_TIMEOUT_SEC for the hang")
    p.add_argument("--deadline", type=float, default=None, help="per run, from its start (default 40 + 2 x pg)")
    p.add_argument("--grace", type=float, default=3.0, help="seconds after the end before counting leaks")
    p.add_argument("--replot", type=Path, help="rewrite the table and chart from a detection.json (no runs)")
    p.add_argument("--docs", action=argparse.BooleanOptionalAction, default=None,
                   help="also write docs/detection.{md,png} (default: on for the full matrix)")
    args = p.parse_args(argv)
    if args.deadline is None:
        args.deadline = 40 + 2 * args.pg_timeout
    return args


def cells_from_json(data: dict) -> list[Cell]:
    launchers = {launcher.key: launcher for launcher in LAUNCHERS}
    scenarios = {s.key: s for s in SCENARIOS}
    return [Cell(launchers[c["launcher"]], scenarios[c["scenario"]],
                 RunResult(**c["stock"]) if c["stock"] else None, RunResult(**c["ours"]) if c["ours"] else None)
            for c in data["cells"]]


def write_outputs(cells: list[Cell], args, header: str, title_extra: str, docs: bool) -> str:
    table = markdown_table(cells, args.pg_timeout)
    md = f"{header}\n\n![fault detection, stock vs. ours](detection.png)\n\n{table}\n\n{notes(cells, args)}\n"
    (OUT / "detection.md").write_text(md)
    chart(cells, OUT / "detection.png", pg_timeout=args.pg_timeout, title_extra=title_extra)
    if docs:
        DOCS.mkdir(exist_ok=True)
        shutil.copy(OUT / "detection.md", DOCS / "detection.md")
        shutil.copy(OUT / "detection.png", DOCS / "detection.png")
    return table


def main(argv=None) -> None:
    args = _parse(argv)
    if args.replot:
        data = json.loads(args.replot.read_text())
        for key in ("pg_timeout", "hang_timeout", "deadline", "grace"):
            setattr(args, key, data["args"][key])
        OUT.mkdir(parents=True, exist_ok=True)
        cells = cells_from_json(data)
        table = write_outputs(cells, args, data["header"], f"{data['date']}, {data['machine']}", bool(args.docs))
        print(data["header"])
        print(table)
        print()
        print(notes(cells, args))
        return
    keys = args.launchers or (QUICK if args.quick else [launcher.key for launcher in LAUNCHERS])
    launchers = [launcher for launcher in LAUNCHERS if launcher.key in keys]
    scenarios = [s for s in SCENARIOS if not args.scenarios or s.key in args.scenarios]
    full = not (args.quick or args.launchers or args.scenarios)
    docs = full if args.docs is None else args.docs
    OUT.mkdir(parents=True, exist_ok=True)
    workdir = OUT / "detection-runs"
    began = time.time()
    cells = []
    for launcher in launchers:
        for scenario in scenarios:
            runs = {}
            for side in ("stock", "ours"):
                if not_applicable(launcher, scenario):
                    runs[side] = None
                    continue
                t0 = time.time()
                runs[side] = run_cell(launcher, scenario, side == "ours", pg_timeout=args.pg_timeout,
                                      hang_timeout=args.hang_timeout, deadline=args.deadline, grace=args.grace,
                                      workdir=workdir)
                print(f"  {launcher.key:22} {scenario.key:15} {side:5}: {format_seconds(runs[side]):>18}  "
                      f"cause {format_cause(runs[side]):12} leaked {format_leaked(runs[side])}  "
                      f"(run {time.time() - t0:.0f} s)", flush=True)
            cells.append(Cell(launcher, scenario, runs["stock"], runs["ours"]))
    elapsed = time.time() - began
    today = date.today().isoformat()
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores"
    import torch

    versions = [f"torch {torch.__version__}"]
    for mod in ("ignite", "lightning"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001
            pass
    command = " ".join(["python bench/detection.py", *(sys.argv[1:] if argv is None else argv)])
    header = f"Measured {today} on {machine} ({', '.join(versions)}) with `{command}` ({elapsed / 60:.0f} min)."
    table = write_outputs(cells, args, header, f"{today}, {machine}", docs)
    details = [dict(launcher=c.launcher.key, scenario=c.scenario.key,
                    stock=dataclasses.asdict(c.stock) if c.stock else None,
                    ours=dataclasses.asdict(c.ours) if c.ours else None) for c in cells]
    (OUT / "detection.json").write_text(json.dumps(dict(date=today, machine=machine, args=vars(args), header=header,
                                                        elapsed_sec=elapsed, cells=details), indent=1, default=str))
    print()
    print(header)
    print(table)
    print()
    print(notes(cells, args))
    print(f"\nwrote {OUT / 'detection.md'}, {OUT / 'detection.png'}" + (f", {DOCS}/detection.{{md,png}}" if docs else ""))


if __name__ == "__main__":
    main()
