"""Start real ranks as separate processes, bound them in time, and clean up every one by PID.

``run_ranks(world_size, scenario)`` runs ``tests/rank_main.py <scenario>`` once per rank with the
environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Each
rank appends one JSON object per event to ``<outdir>/rank<r>.jsonl`` as it goes, so that what a rank
saw is known even when it is killed. A rank still running at the deadline is killed with its whole
process group and the test fails with every rank's stderr tail.
"""

from __future__ import annotations

import contextlib
import json
import re
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fault_tolerant_handlers.core import procfs as _procfs

HERE = Path(__file__).resolve().parent
RANK_MAIN = HERE / "rank_main.py"
#: Process-group timeout the ranks use: far below the 30-minute gloo default.
PG_TIMEOUT_SEC = 20


ROOT = HERE.parent
#: The rank programs the tests start (``rank_main.py``, ``ignite_main.py``, ...) live beside this file.
PROGRAMS = HERE


def readme_snippet(name: str, page: str = "README.md") -> str:
    """The code block marked ``<!-- snippet: <name> -->`` in ``page`` (the README, or a page such
    as ``docs/fabric.md``), as printed."""
    text = (ROOT / page).read_text()
    match = re.search(rf"<!-- snippet: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"{page} has no '<!-- snippet: {name} -->' code block"
    return match.group(1)


def own_output(path: Path) -> None:
    """In a rank process: its stdout and stderr (file descriptors 1 and 2) go to ``path`` from now
    on (ranks spawned by ``idist.Parallel`` or ``ddp_spawn`` otherwise share their parent's)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)


def read_events(outdir, rank: int) -> list[dict]:
    """The events ``rank`` has recorded so far in ``<outdir>/rank<r>.jsonl`` (it may be writing: a
    line not yet whole, or cut by a SIGKILL, is left out)."""
    path = Path(outdir) / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events


_FREEZER = """
import os, signal, sys, time
mark, after, seconds, me = sys.argv[1].encode(), float(sys.argv[2]), float(sys.argv[3]), os.getpid()
time.sleep(after)
pids = []
for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
            if entry.isdigit() and int(entry) != me and mark in f.read():
                pids.append(int(entry))
    except OSError:
        pass
for sig in (signal.SIGSTOP, signal.SIGCONT):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    if sig == signal.SIGSTOP:
        time.sleep(seconds)
"""


def freeze_job(outdir, *, after: float, seconds: float) -> None:
    """A job suspended and resumed by its scheduler (SLURM's ``scontrol suspend``): ``after`` seconds
    from now, every process whose command line names ``outdir`` (a test's ranks, their helpers and
    DataLoader workers) is stopped (SIGSTOP) for ``seconds``, then continued; from a process of its
    own, which ends by itself."""
    subprocess.Popen([sys.executable, "-c", _FREEZER, str(outdir), str(after), str(seconds)],
                     start_new_session=True)


def linger(outdir, rank: int, world: int, bound: float, grace: float = 1.0) -> None:
    """In the failing rank, after its run raised: stay alive until every other rank has recorded the
    end of its run (``run_raised`` or ``run_returned`` in ``<outdir>/rank<r>.jsonl``), then ``grace``
    seconds more, ``bound`` seconds at most. A peer's end recorded while this process lives was not
    caused by its exit (a stock run's peers record nothing: it stays the whole ``bound``)."""
    end = time.monotonic() + bound
    waiting = {r for r in range(world) if r != rank}
    while waiting and time.monotonic() < end:
        for r in list(waiting):
            if any(e.get("event") in ("run_raised", "run_returned") for e in read_events(outdir, r)):
                waiting.discard(r)
        time.sleep(0.05)
    time.sleep(max(0.0, min(grace, end - time.monotonic())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    events: list[dict] = field(default_factory=list)
    stderr: str = ""
    #: processes of this rank's session still alive after the rank process itself had exited
    leaked: bool = False

    def event(self, name: str) -> dict:
        found = [e for e in self.events if e.get("event") == name]
        assert found, f"rank {self.rank} recorded no event {name!r}; events: {self.events}\nstderr:\n{self.stderr[-3000:]}"
        return found[-1]

    def has(self, name: str) -> bool:
        return any(e.get("event") == name for e in self.events)


def _session_alive(sid: int) -> bool:
    """True if any process of session ``sid`` (a rank started with ``start_new_session``) runs."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _procfs.stat_fields(int(entry))
            if _procfs.is_running(fields) and fields[_procfs.SESSION] == str(sid):
                return True
    return False


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover
        pass


def _default_sigint() -> None:
    """In a rank about to start: SIGINT's default action, as a terminal gives it. A suite started as a
    background job of a non-interactive shell inherits SIGINT ignored, and so would every rank (a rank
    sent SIGINT would then train on)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_ranks(
    world_size: int,
    scenario: str,
    tmp_path: Path,
    *,
    deadline: float = 60.0,
    pg_timeout: float = PG_TIMEOUT_SEC,
    env: dict[str, str] | None = None,
    per_rank_env: dict[int, dict[str, str]] | None = None,
    expect_hang: bool = False,
    script: Path = RANK_MAIN,
    result_ranks: int | None = None,
    launcher: list[str] | None = None,
    stragglers_grace: float | None = None,
    wait_sessions: bool = False,
) -> list[RankResult]:
    """Run ``scenario`` on ``world_size`` real processes; return what every rank recorded.

    ``script`` is the rank program (``rank_main.py`` by default; it gets ``<scenario> <outdir>``,
    or just ``<outdir>`` when ``scenario`` is empty). ``result_ranks`` reads that many ranks'
    records when the processes started here spawn the ranks themselves (``idist.Parallel``, or a
    ``launcher`` such as ``["-m", "torch.distributed.run", "--nproc-per-node", "2"]`` put between the
    interpreter and the script, which is given ``--master-port`` too). With ``stragglers_grace``,
    once all but one process have exited, the last one gets that many seconds before it is killed
    (for a rank frozen on purpose, which only its launcher would end). With ``wait_sessions``, the
    processes those started (Lightning ``ddp``'s rank 1, a child of rank 0) are waited for too, up
    to ``deadline``, once the started ones have exited.

    With ``expect_hang=False`` a rank still alive at ``deadline`` fails the test. Every process
    started here is killed by PID (its whole session) before this returns.
    """
    outdir = tmp_path / f"{scenario or script.stem}-{world_size}"
    outdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen] = []
    errs = []
    leaked: list[int] = []
    try:
        for rank in range(world_size):
            rank_env = dict(os.environ)
            rank_env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                FTH_TEST_PG_TIMEOUT=str(pg_timeout),
                PYTHONUNBUFFERED="1",
            )
            rank_env.update(env or {})
            rank_env.update((per_rank_env or {}).get(rank, {}))
            err = open(outdir / f"rank{rank}.stderr", "w+")
            errs.append(err)
            procs.append(
                subprocess.Popen(
                    [sys.executable, *(launcher + [f"--master-port={port}"] if launcher else []), str(script),
                     *([scenario] if scenario else []), str(outdir)],
                    env=rank_env,
                    stdout=err,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_default_sigint,
                )
            )
        end = time.monotonic() + deadline
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            if stragglers_grace is not None and sum(p.poll() is None for p in procs) == 1 and len(procs) > 1:
                end = min(end, time.monotonic() + stragglers_grace)
                stragglers_grace = None
            time.sleep(0.05)
        while wait_sessions and time.monotonic() < end and any(_session_alive(p.pid) for p in procs):
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None or (wait_sessions and _session_alive(p.pid))]
        time.sleep(0.5)  # children (DataLoader workers) get a moment to follow their rank
        leaked = [r for r, p in enumerate(procs) if r not in hung and _session_alive(p.pid)]
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)
            else:  # the rank exited; anything it left behind in its session goes too
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    results = []
    stderrs = []
    for err in errs:
        err.seek(0)
        stderrs.append(err.read())
        err.close()
    for rank in range(result_ranks or world_size):
        p = procs[min(rank, len(procs) - 1)]
        stderr = stderrs[min(rank, len(procs) - 1)]
        events = []
        path = outdir / f"rank{rank}.jsonl"
        if path.exists():
            events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        index = procs.index(p)
        results.append(RankResult(rank, None if index in hung else p.returncode, events, stderr,
                                  leaked=index in leaked and len(procs) == (result_ranks or world_size)))
    if hung and not expect_hang:
        tails = "\n".join(f"--- rank {r.rank} (rc={r.returncode}) ---\n{r.stderr[-2000:]}" for r in results)
        raise AssertionError(f"ranks {hung} were still running after {deadline:.0f}s (killed):\n{tails}")
    return results


def torchrun_root_cause(output: str) -> tuple[int | None, str]:
    """(rank, text) of the "Root Cause" block torchrun prints when workers fail; ``(None, "")``
    when there is none."""
    match = re.search(r"Root Cause \(first observed failure\):\n(.*?)(?:\n=====|\Z)", output, re.S)
    if not match:
        return None, ""
    block = match.group(1)
    rank = re.search(r"rank\s*:\s*(\d+)", block)
    return (int(rank.group(1)) if rank else None), block


def kill_workers(out: Path, program: str = "resume_main.py") -> None:
    """Kill, by pid, every worker of a torchrun job in ``out`` still running, with its DataLoader
    workers. Each worker writes ``attempt*_rank*.json`` with its pid; torchrun starts each worker in
    a session of its own, so killing torchrun's session leaves them: called once the job is over
    (every pid is checked to be ``program``)."""
    for path in out.glob("attempt*_rank*.json"):
        try:
            pid = int(json.loads(path.read_text())["pid"])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if program.encode() not in f.read():
                    continue
            os.killpg(pid, signal.SIGKILL)  # the worker leads its session and process group
        except (OSError, ValueError, KeyError):
            continue


#: In the environment of a test's processes, so that :func:`dump_stacks` can ask each for its stacks.
STACKS_ENV = {"PYTHONFAULTHANDLER": "1"}
#: The line :func:`dump_stacks` writes before the stacks (what ran before it is the run's own output).
STACKS_MARKER = "\n=== stacks at the deadline, one process at a time (SIGSTOP all, then SIGABRT each) ===\n"


def dump_stacks(pids: list[int], out, wait: float = 2.0) -> None:
    """Every Python thread's stack of each process in ``pids`` (a bounded test's processes still
    running at its deadline, started with :data:`STACKS_ENV`), written to ``out``, the file their
    output goes to, before the test kills them. All are stopped first (SIGSTOP: none reacts to
    another's end, and the stall stays as it was); then each in turn, its core dump disabled, gets
    SIGABRT and SIGCONT, and ``faulthandler`` prints its threads' stacks as it ends (at most ``wait``
    seconds each; a DataLoader worker or helper the process forked is in ``pids`` by itself)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGSTOP)
    headers = {}
    for pid in pids:  # each one's parent while all still stand
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = _procfs.stat_fields(pid) or ["?"] * 2
            headers[pid] = f"--- pid {pid} (parent {stat[_procfs.PPID]}): {cmdline[:200]}\n"
    out.write(STACKS_MARKER)
    for pid, header in headers.items():
        try:
            out.write(header)
            out.flush()
            resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        except OSError:
            continue
        end = time.monotonic() + wait
        while _procfs.is_running(_procfs.stat_fields(pid)) and time.monotonic() < end:
            time.sleep(0.05)
    out.flush()


@contextlib.contextmanager
def cpu_hogs(count: int, seconds: float = 900):
    """``count`` processes that each keep a core busy for the block (a loaded machine), killed by
    pid when it ends; each ends by itself after ``seconds`` (a test process killed before it could)."""
    hog = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", hog], start_new_session=True) for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            _kill_tree(p)


#: What the library prints when it declares a rank lost, silent or hung, or ends a job.
DECLARATIONS = re.compile(r"PeerLost|PeerSilent|RankHung|hosts the c10d store\) lost|the job fails|"
                          r"ending this process|PeerFailedError")

#: What the library logs when a live rank's heartbeat stood still for half the limit (a near miss).
NEAR_MISSES = re.compile(r"heartbeat \(pid \d+[^)]*\) has stood still for")


@dataclass
class HealthyRun:
    """What a healthy job did: exit code, each rank's record (``tests/soak_main.py``), the library's
    declarations found in its output, and its wall time."""

    returncode: int | None
    ranks: dict[int, dict]
    declarations: list[str]
    seconds: float
    output: str

    launched: float = 0.0  # time.time() when the job was started

    def clean(self, world: int, iterations: int) -> bool:
        return (self.returncode == 0 and not self.declarations and len(self.ranks) == world
                and all(r.get("finished") == iterations for r in self.ranks.values()))

    @property
    def near_misses(self) -> list[str]:
        """The library's warnings that a heartbeat stood still for half its limit."""
        return [line for line in self.output.splitlines() if NEAR_MISSES.search(line)]

    def finished(self, iterations: int) -> int:
        return sum(r.get("finished") == iterations for r in self.ranks.values())

    @property
    def first_step(self) -> float | None:
        """Seconds from the launch to the slowest rank's first trained iteration."""
        firsts = [r["first"] for r in self.ranks.values() if "first" in r]
        return max(firsts) - self.launched if firsts and len(firsts) == len(self.ranks) else None

    @property
    def max_lag(self) -> float | None:
        """The most any rank finished an iteration after the first rank that finished it (seconds)."""
        times = [r["times"] for r in self.ranks.values() if r.get("times")]
        if not times or len(times) < len(self.ranks):
            return None
        steps = min(len(t) for t in times)
        return max(max(t[i] for t in times) - min(t[i] for t in times) for i in range(steps))

    def per_rank(self, key: str) -> list:
        return [r[key] for r in self.ranks.values() if key in r]


def healthy_run(framework: str, world: int, outdir: Path, *, deadline: float,
                env: dict[str, str] | None = None) -> HealthyRun:
    """One run of ``tests/soak_main.py`` (Ignite under torchrun, or Lightning ``ddp``) on ``world``
    ranks, no fault, bounded by ``deadline``; every process it started is killed by pid after.
    ``env``: its ``SOAK_*`` settings (see the program's text)."""
    outdir.mkdir(parents=True, exist_ok=True)
    script = str(HERE / "soak_main.py")
    extra = env or {}
    env = dict(os.environ, PYTHONUNBUFFERED="1", SOAK_RANKS=str(world), PYTHONPATH=str(ROOT), **extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if framework == "ignite":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                "--monitor-interval=0.5", script, framework, str(outdir)]
    else:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        argv = [sys.executable, script, framework, str(outdir)]
    log_path = outdir / "output.txt"
    start, launched = time.monotonic(), time.time()
    with open(log_path, "w+") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            pass
        finally:
            returncode = proc.poll()
            _kill_tree(proc)
            # torchrun's workers and Lightning's ranks: every process still holding the output
            for path in outdir.glob("rank*.json"):
                try:
                    pid = int(json.loads(path.read_text())["pid"])
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"soak_main.py" in f.read():
                            os.killpg(pid, signal.SIGKILL)
                except (OSError, ValueError, KeyError):
                    pass
        seconds = time.monotonic() - start
        out.seek(0)
        output = out.read()
    ranks = {}
    for path in outdir.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
            ranks[int(record["rank"])] = record
        except (OSError, ValueError, KeyError):
            continue
    declarations = [line for line in output.splitlines() if DECLARATIONS.search(line)]
    return HealthyRun(returncode, ranks, declarations, seconds, output, launched)


def run_script(script: Path, *, deadline: float, drop_fth: bool = False) -> tuple[int | None, str, float]:
    """Run ``python <script>`` (a snippet from the docs, which launches its other ranks itself) in
    its own folder and session, without the launcher variables this process may carry (and, with
    ``drop_fth``, without ``FTH_*`` settings); every process of the session is killed after it ends
    or at ``deadline``. Returns its exit code, its output and how long it ran."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not (drop_fth and k.startswith("FTH_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], cwd=script.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        try:  # rank 0 and the ranks it started share this session
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)
    return proc.returncode, out, time.monotonic() - start
