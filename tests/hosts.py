"""Simulated hosts on one machine: a rig for multi-host runs, bounded in time, removed afterwards.

A simulated host is a network namespace (``ip netns``) plus its own hostname and pid namespace
(``unshare --uts --pid --fork --mount-proc`` inside it): with a shared hostname or pid namespace
the library's same-host pid check would "see" a remote rank and a test would lie. Two hosts are
joined by a veth pair, more by a bridge in a namespace of the rig's own; every host has the address
``10.231.0.<i+1>/24`` on its ``eth0``, ``/etc/hosts`` naming every host (bind-mounted in its mount
namespace, so nothing waits for DNS) and runs one ``torchrun`` agent with c10d rendezvous on host
0. With ``store_host=True`` the job's store has a host of its own, ``node-s`` (``10.231.0.254``, on
the bridge too): it runs only ``python -m fault_tolerant_handlers.launchers.store_host``, no
torchrun, and every host's torchrun uses the static rendezvous at it (``--rdzv-backend static
--rdzv-endpoint node-s:29400 --node-rank i``), so that the workers' store (``MASTER_ADDR``) is
node-s's and no training host's. All traffic stays inside namespaces made here.

Faults from outside: :meth:`Rig.kill_host` (SIGKILL the first process of the host's pid namespace:
the kernel kills everything in it), :meth:`Rig.cut_link` (``ip link set eth0 down``),
:meth:`Rig.drop_packets` (``tc qdisc add dev eth0 root pfifo limit 0``: every packet the host sends
is dropped), :meth:`Rig.kill_store_host` (node-s, with ``store_host=True``); a rank's own fault
(raise, SIGKILL, hang) comes from ``FTH_INJECT``.

:func:`run_hosts` runs one scenario and returns what every rank recorded (``multihost_main.py``
writes ``<outdir>/rank<r>.jsonl``), when each rank's process and each host's agent ended, and each
host's log. Namespaces are named ``fthmh<creator pid>x<n>...``; :func:`cleanup_leftovers` removes
those whose creator is gone (a run killed before its own cleanup). Needs root, ``ip`` and
``unshare``: :func:`unavailable` says why not.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch import read_events

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MAIN = HERE / "multihost_main.py"
PREFIX = "fthmh"
SUBNET = "10.231.0"
DEV = "eth0"
RDZV_PORT = 29400
#: the hostname of the store's own host (``Rig(..., store_host=True)``)
STORE_HOST = "node-s"
#: how long the store host may take to serve (it imports torch: seconds on a loaded machine)
STORE_START_SEC = 60.0
#: Process-group timeout of the ranks (stock gloo's default is 30 minutes).
PG_TIMEOUT_SEC = 60
_seq = itertools.count()


def unavailable() -> str | None:
    """Why the rig cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return "simulated hosts need Linux network and pid namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns, unshare --pid)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool!r} on PATH"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=20)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_namespace(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns`` (by pid), then delete it (and its links)."""
    for _ in range(20):
        out = _ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in out.stdout.split() if p.isdigit()]
        if not pids:
            break
        for pid in pids:
            _kill(pid)
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def cleanup_leftovers() -> list[str]:
    """Remove rig namespaces whose creating process no longer runs; return their names."""
    removed = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX):
            continue
        creator = ns[len(PREFIX) :].split("x", 1)[0]
        if creator.isdigit() and int(creator) != os.getpid() and _alive(int(creator)):
            continue
        if creator.isdigit() and int(creator) == os.getpid():
            continue  # this process's own rigs clean up after themselves
        _remove_namespace(ns)
        removed.append(ns)
    return removed


@dataclass
class Host:
    index: int
    name: str  # its hostname, e.g. node-a
    ns: str
    addr: str
    proc: subprocess.Popen | None = None
    log: Path | None = None
    #: pid (in the machine's pid namespace) of the first process of the host's pid namespace
    init_pid: int | None = None
    ended_at: float | None = None  # when its torchrun agent (hence the host's pid namespace) ended
    killed: bool = False  # killed by a fault or at the deadline, not ended by itself


class Rig:
    """``n`` simulated hosts (and, with ``store_host``, the store's own host ``node-s``, not in
    :attr:`hosts`: :attr:`store`); a context manager that removes every namespace and process it made."""

    def __init__(self, n: int, workdir: Path, *, store_host: bool = False) -> None:
        if n < 2 or n > 26:
            raise ValueError(f"Rig(n={n}): n must be in [2, 26]")
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        tag = f"{PREFIX}{os.getpid()}x{next(_seq)}"
        self.bridge_ns = f"{tag}br" if n > 2 or store_host else None
        self.hosts = [Host(i, f"node-{chr(ord('a') + i)}", f"{tag}h{i}", f"{SUBNET}.{i + 1}") for i in range(n)]
        #: the store's host (``store_host=True``): no torchrun, only the store module
        self.store = Host(n, STORE_HOST, f"{tag}s", f"{SUBNET}.254") if store_host else None
        self._hosts_file = workdir / "etc-hosts"
        self._resolv_file = workdir / "etc-resolv.conf"

    # -- network ------------------------------------------------------------------------------

    def __enter__(self) -> Rig:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _all_hosts(self) -> list[Host]:
        return self.hosts + ([self.store] if self.store is not None else [])

    def _build(self) -> None:
        cleanup_leftovers()
        for h in self._all_hosts():
            _ip("netns", "add", h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
        if self.bridge_ns is None:
            a, b = self.hosts
            _ip("link", "add", DEV, "netns", a.ns, "type", "veth", "peer", "name", DEV, "netns", b.ns)
        else:
            _ip("netns", "add", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for h in self._all_hosts():
                port = f"p{h.index}"
                _ip("link", "add", DEV, "netns", h.ns, "type", "veth", "peer", "name", port, "netns", self.bridge_ns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", port, "up")
        for h in self._all_hosts():
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", DEV)
            _ip("-n", h.ns, "link", "set", DEV, "up")
        self._hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in self._all_hosts()))
        self._resolv_file.write_text("")  # no name server: nothing waits for DNS

    def close(self) -> None:
        """Kill every process of every host (by pid) and remove every namespace; idempotent."""
        for h in self._all_hosts():
            if h.init_pid is not None and _alive(h.init_pid):
                _kill(h.init_pid)
                h.killed = True
            if h.proc is not None and h.proc.poll() is None:
                _kill(h.proc.pid)
                h.killed = True
        for h in self._all_hosts():
            if h.proc is not None:
                try:
                    h.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # pragma: no cover
                    pass
        for ns in [h.ns for h in self._all_hosts()] + ([self.bridge_ns] if self.bridge_ns else []):
            if ns in _namespaces():
                _remove_namespace(ns)

    # -- processes ----------------------------------------------------------------------------

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        host_env = dict(os.environ)
        host_env.update(
            PYTHONPATH=str(ROOT) + os.pathsep + host_env.get("PYTHONPATH", ""),
            PYTHONUNBUFFERED="1",
            GLOO_SOCKET_IFNAME=DEV,
            FTH_TEST_PG_TIMEOUT=str(PG_TIMEOUT_SEC),
        )
        host_env.update(env or {})
        return host_env

    def _spawn(self, h: Host, argv: list[str], env: dict[str, str]) -> None:
        """Run ``argv`` as the first process of host ``h`` (its hostname, /etc/hosts, pid namespace)."""
        inner = (f"mount --bind {self._hosts_file} /etc/hosts && "
                 f"mount --bind {self._resolv_file} /etc/resolv.conf && hostname {h.name} && exec \"$@\"")
        h.log = self.workdir / f"{h.name}.log"
        with open(h.log, "w") as log:
            h.proc = subprocess.Popen(
                ["ip", "netns", "exec", h.ns, "unshare", "--uts", "--pid", "--fork", "--mount-proc",
                 "sh", "-c", inner, "sh", *argv],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def start_store(self) -> None:
        """Start the store module on node-s and wait (bounded) until it serves."""
        h = self.store
        self._spawn(h, [sys.executable, "-m", "fault_tolerant_handlers.launchers.store_host", "--port", str(RDZV_PORT),
                        "--host", h.addr], self._env(None))
        h.init_pid = self._first_child(h.proc.pid)
        end = time.monotonic() + STORE_START_SEC
        while "serves the job's c10d store" not in h.log.read_text(errors="replace"):
            if h.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the store host did not serve (exit {h.proc.poll()}): {h.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def start(self, argv: list[str], *, nproc_per_node: int = 1, env: dict[str, str] | None = None) -> None:
        """Start ``torchrun ... <argv>`` on every host (``argv``: the script and its arguments); with a
        store host, the store first, and every torchrun's static rendezvous at it."""
        if self.store is not None:
            self.start_store()
        for h in self.hosts:
            if self.store is None:
                rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0].addr}:{RDZV_PORT}",
                        "--rdzv-conf", f"is_host={'true' if h.index == 0 else 'false'}"]
            else:
                rdzv = ["--rdzv-backend", "static", "--rdzv-endpoint", f"{self.store.addr}:{RDZV_PORT}",
                        "--node-rank", str(h.index)]
            torchrun = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(len(self.hosts)), "--nproc-per-node", str(nproc_per_node), *rdzv,
                "--local-addr", h.addr, "--max-restarts", "0", "--monitor-interval", "0.1",
                *argv,
            ]
            self._spawn(h, torchrun, self._env(env))
        for h in self.hosts:
            h.init_pid = self._first_child(h.proc.pid)

    @staticmethod
    def _first_child(pid: int, timeout: float = 10.0) -> int | None:
        """The child ``unshare --fork`` made: pid 1 of the host's pid namespace."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                return None
            if children:
                return int(children[0])
            time.sleep(0.02)
        return None

    def host_pids(self, h: Host) -> dict[int, int]:
        """{pid inside the host: pid on the machine} for every process of host ``h``."""
        if h.init_pid is None:
            return {}
        try:
            ns = os.readlink(f"/proc/{h.init_pid}/ns/pid")
        except OSError:
            return {}
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                    continue
                for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                    if line.startswith("NSpid:"):
                        found[int(line.split()[-1])] = int(entry)
            except (OSError, ValueError):
                continue
        return found

    # -- faults -------------------------------------------------------------------------------

    def kill_host(self, i: int) -> None:
        """Everything on host ``i`` dies at once (SIGKILL to its pid namespace's first process)."""
        h = self.hosts[i]
        if h.init_pid is None:
            raise RuntimeError(f"host {h.name} has no running process")
        _kill(h.init_pid)
        h.killed = True

    def kill_store_host(self) -> None:
        """Everything on the store's own host (node-s) dies at once."""
        if self.store is None or self.store.init_pid is None:
            raise RuntimeError("the rig has no store host running")
        _kill(self.store.init_pid)
        self.store.killed = True

    def cut_link(self, i: int, restore: bool = False) -> None:
        """Host ``i``'s network link goes down (both ends see it); ``restore``: it comes back up."""
        _ip("-n", self.hosts[i].ns, "link", "set", DEV, "up" if restore else "down")

    def freeze_host(self, i: int, thaw: bool = False) -> None:
        """Every process of host ``i`` stops (SIGSTOP, by pid), as a host that hangs whole; ``thaw``:
        they go on (SIGCONT)."""
        for pid in self.host_pids(self.hosts[i]).values():
            try:
                os.kill(pid, signal.SIGCONT if thaw else signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass

    def drop_packets(self, i: int) -> None:
        """Every packet host ``i`` sends is dropped; its link stays up."""
        subprocess.run(["ip", "netns", "exec", self.hosts[i].ns, "tc", "qdisc", "add", "dev", DEV, "root",
                        "pfifo", "limit", "0"], check=True, capture_output=True, timeout=20)


# -- one scenario -------------------------------------------------------------------------------

#: faults the rig injects from outside, at a host (``fault_host``)
HOST_FAULTS = ("kill_host", "cut_link", "drop_packets")
#: faults a rank injects itself (``FTH_INJECT``), at rank ``fault_rank``
RANK_FAULTS = ("raise", "kill", "hang")
FAULTS = HOST_FAULTS + RANK_FAULTS + ("none",)


@dataclass
class RankOutcome:
    rank: int
    host: str | None
    events: list[dict] = field(default_factory=list)
    #: when its process was seen gone (wall clock), None if it was alive at the deadline
    ended_at: float | None = None
    #: it ended by itself (not with its host killed by the fault, nor at the deadline)
    ended_by_itself: bool = False

    def has(self, name: str) -> bool:
        return any(e.get("event") == name for e in self.events)

    def event(self, name: str) -> dict | None:
        found = [e for e in self.events if e.get("event") == name]
        return found[-1] if found else None

    @property
    def raised(self) -> dict | None:
        return self.event("run_raised")


@dataclass
class MultiHostResult:
    fault: str
    fault_at: float | None  # wall clock of the fault
    fault_host: int
    fault_rank: int
    hosts: list[Host]
    ranks: list[RankOutcome]
    nproc_per_node: int

    def host_of(self, rank: int) -> Host:
        return self.hosts[rank // self.nproc_per_node]

    def host_dead_at(self, host: int) -> float | None:
        """When the killed host ``host`` was dead: the fault, or the last of its ranks' processes
        seen gone if that was later (under load the kernel can take seconds to end a pid namespace;
        its peers see nothing, no reset and no silence, before its processes have ended)."""
        ends = [r.ended_at for r in self.ranks if self.host_of(r.rank).index == host]
        if self.fault_at is None or any(t is None for t in ends):
            return None
        return max([self.fault_at] + ends)

    def log(self, host: int) -> str:
        p = self.hosts[host].log
        return p.read_text(errors="replace") if p and p.exists() else ""

    def describe(self) -> str:
        lines = [f"fault {self.fault} at {self.fault_at}"]
        for r in self.ranks:
            lines.append(f"rank {r.rank} on {r.host}: ended_at={r.ended_at} by_itself={r.ended_by_itself} "
                         f"events={[e['event'] for e in r.events]} raised={r.raised}")
        for i, h in enumerate(self.hosts):
            lines.append(f"--- {h.name} (agent ended_at={h.ended_at}, killed={h.killed}) ---\n{self.log(i)[-3000:]}")
        return "\n".join(lines)


def run_hosts(
    workdir: Path,
    fault: str,
    *,
    hosts: int = 2,
    nproc_per_node: int = 1,
    fault_host: int = 1,
    fault_rank: int | None = None,
    fault_iter: int = 15,
    use_ft: bool = True,
    framework: str = "ignite",
    after_fault: float = 30.0,
    start_timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> MultiHostResult:
    """Run ``multihost_main.py`` on ``hosts`` simulated hosts, inject ``fault``, and return what
    every rank saw.

    Host faults are injected at ``fault_host`` once every rank has reached ``READY_ITER``; rank
    faults (``raise``/``kill``/``hang``) by ``FTH_INJECT`` at ``fault_rank`` (default: the first
    rank of ``fault_host``), iteration ``fault_iter``. The run lasts until every rank's process and
    every agent has ended, or ``after_fault`` seconds after the fault; then everything is killed.
    """
    if fault not in FAULTS:
        raise ValueError(f"run_hosts(fault={fault!r}): fault must be one of {', '.join(FAULTS)}")
    if framework not in ("ignite", "lightning"):
        raise ValueError(f"run_hosts(framework={framework!r}): framework must be 'ignite' or 'lightning'")
    if fault_rank is None:
        fault_rank = fault_host * nproc_per_node
    world = hosts * nproc_per_node
    outdir = workdir / f"{framework}-{'ft' if use_ft else 'stock'}-{fault}-{hosts}x{nproc_per_node}"
    outdir.mkdir(parents=True, exist_ok=True)
    run_env = dict(FRAMEWORK=framework, USE_FT="1" if use_ft else "0", FTH_INJECT="")
    if fault in RANK_FAULTS:
        run_env["FTH_INJECT"] = f"{fault}@rank={fault_rank},iteration={fault_iter}"
    run_env.update(env or {})
    ranks = [RankOutcome(r, None) for r in range(world)]
    fault_at = None
    with Rig(hosts, outdir) as rig:
        rig.start([str(MAIN), str(outdir)], nproc_per_node=nproc_per_node, env=run_env)
        pids: dict[int, int] = {}  # rank -> pid on the machine
        gone: dict[int, float] = {}
        end = time.monotonic() + start_timeout
        while time.monotonic() < end:
            now = time.time()
            for r in ranks:
                r.events = read_events(outdir, r.rank)
                start = r.event("start")
                if start and r.rank not in pids:
                    r.host = start["host"]
                    inner = rig.host_pids(rig.hosts[r.rank // nproc_per_node])
                    if start["pid"] in inner:
                        pids[r.rank] = inner[start["pid"]]
                if r.rank in pids and r.rank not in gone and not _alive(pids[r.rank]):
                    gone[r.rank] = now
            for h in rig.hosts:
                if h.ended_at is None and h.proc is not None and h.proc.poll() is not None:
                    h.ended_at = now
            if fault_at is None:
                if fault in HOST_FAULTS and all(r.has("ready") for r in ranks) and len(pids) == world:
                    getattr(rig, fault)(fault_host)
                    fault_at = time.time()
                    end = time.monotonic() + after_fault
                elif fault in RANK_FAULTS and ranks[fault_rank].has("fault"):
                    fault_at = ranks[fault_rank].event("fault")["t"]
                    end = time.monotonic() + after_fault
                elif fault == "none" and all(r.has("ready") for r in ranks):
                    fault_at = time.time()
                    end = time.monotonic() + after_fault
                elif all(h.ended_at is not None for h in rig.hosts):
                    break  # everything ended before the fault: the test reports it
            elif len(gone) == world and all(h.ended_at is not None for h in rig.hosts):
                break
            time.sleep(0.05)
        rig.close()
        for r in ranks:
            r.events = read_events(outdir, r.rank)
            host = rig.hosts[r.rank // nproc_per_node]
            r.ended_at = gone.get(r.rank)
            killed_by_fault = ((fault == "kill_host" and host.index == fault_host)
                               or (fault == "kill" and r.rank == fault_rank))
            r.ended_by_itself = r.ended_at is not None and not killed_by_fault
        return MultiHostResult(fault, fault_at, fault_host, fault_rank, rig.hosts, ranks, nproc_per_node)
