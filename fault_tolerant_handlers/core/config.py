"""Every setting in one table (:data:`SETTINGS`), then every fixed timing of the failure path; read and
checked when a session starts or an adapter is made, so that a bad value stops the job at once.
``docs/reference.md`` lists both as they are here (``tests/unit/core/test_settings_table.py``)."""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, make_dataclass
from datetime import timedelta

from . import attempts, inject
from .hooks import log

#: ``hang_timeout="auto"``: the deadline is learned from the run (:mod:`..detect.autohang`).
AUTO = "auto"


@dataclass(frozen=True)
class Setting:
    """One ``FTH_*`` variable: the :class:`Config` field it sets and how its text is read (``kind``:
    ``seconds``, ``number``, ``integer``, ``choice`` (``0``/``1``: a bool), ``hang`` or ``inject``)."""

    variable: str
    field: str
    kind: str
    default: object  #: when unset (``None``: off, or ``shown``)
    meaning: str
    low: float = 0.0
    high: float = 0.0
    choices: tuple[str, ...] = ()
    shown: str = ""  #: the default as the docs say it, where it is not a value
    expected: str = ""  #: a choice's error text, where not "one of ..."

    def read(self, raw: str) -> object:
        """The value of ``raw`` (``""``: unset); ``ValueError`` naming the variable and what it accepts."""
        text = raw.strip()
        if self.kind == "inject":
            inject.parse(raw)  # checked here; fired where an iteration begins (:mod:`.inject`)
            return text
        if not text:
            return self.default
        if self.kind == "choice":
            word = text.lower()
            if word not in self.choices:
                raise ValueError(f"{self.variable}={raw!r}: expected {self.expected or 'one of ' + ', '.join(self.choices)}")
            return word == "1" if self.choices == ("0", "1") else word
        if self.kind == "hang":
            if text.lower() == AUTO:
                return AUTO
            if _DHMS.fullmatch(text):
                return _check_duration("hang_timeout", text, f"{self.variable}={text!r}", HANG_TIMEOUT_FORMS)
        try:
            value = int(text) if self.kind == "integer" else float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and self.low <= value <= self.high):
            what = {"integer": "an integer", "number": "a number"}.get(self.kind, "a number of seconds")
            example = 5 if self.kind in ("seconds", "hang") else self.default
            message = f"{self.variable}={raw!r}: expected {what} from {self.low:.15g} to {self.high:.15g}, " \
                      f"e.g. {self.variable}={example:.15g}"
            raise ValueError(message + (f", or {AUTO} (a deadline learned from the run)" if self.kind == "hang" else ""))
        return value if self.kind in ("integer", "number") else timedelta(seconds=value)


_S = timedelta(seconds=1)
#: Every ``FTH_*`` variable, in the order ``docs/reference.md`` lists them.
SETTINGS = (
    Setting("FTH_WATCHDOG_INTERVAL_SEC", "interval", "seconds", 0.1 * _S, "watchdog poll period", 0.01, 10),
    Setting("FTH_HANG_TIMEOUT_SEC", "hang_timeout", "hang", None, "opt-in hang detection (where `hang_timeout` is "
            "`None`); `auto`: the learned deadline", 1, 7 * 86400, shown="off"),
    # a start takes minutes (a compile); ten minutes still names a rank stuck at start before a
    # 30-minute collective timeout would
    Setting("FTH_START_TIMEOUT_SEC", "start_timeout", "seconds", 600 * _S, "a duration `hang_timeout` applies from "
            "the first completed iteration; before it, this deadline (a slow start is not a hang)", 1, 7 * 86400),
    Setting("FTH_AUTO_HANG_MULTIPLE", "auto_hang_multiple", "number", 10.0, "`auto`: a kind of work's deadline is "
            "this many times its longest piece so far", 1, 1000),
    Setting("FTH_AUTO_HANG_FLOOR_SEC", "auto_hang_floor", "number", 60.0, "`auto`: no deadline is shorter than "
            "this", 1, 7 * 86400),
    Setting("FTH_AUTO_HANG_WARMUP", "auto_hang_warmup", "integer", 20, "`auto`: training steps that finish before "
            "anything is judged", 1, 1_000_000),
    Setting("FTH_EXIT_GRACE_SEC", "exit_grace", "seconds", 3 * _S, "a released rank's time to take the failure "
            "before the reported exit", 0.1, 3600),
    Setting("FTH_WRITE_GRACE_SEC", "write_grace", "seconds", 120 * _S, "the reported exit waits this long for a "
            "checkpoint being written", 0, 3600),
    Setting("FTH_HEARTBEAT_TIMEOUT_SEC", "heartbeat_timeout", "seconds", 2 * _S, "a peer whose heartbeat stops (its "
            "host or link is gone, or it is frozen) is lost", 1, 86400),
    # past two retransmissions of a lost segment (about 0.2 s and 0.6 s after it was sent)
    Setting("FTH_UNACKED_SEC", "unacked_after", "seconds", 1 * _S, "a peer on another host whose heartbeat is still "
            "for `SUSPECT_SILENCE` (1.2 s) and whose host's kernel acknowledges nothing sent to it for this long is lost "
            "(its host or link is down), before `FTH_HEARTBEAT_TIMEOUT_SEC`; a host that acknowledges is judged by "
            "that limit alone", 0.5, 86400),
    Setting("FTH_STORE_LOST_SEC", "store_lost_after", "seconds", 4 * _S, "a store that does not answer for this "
            "long, its port refused or unreachable all along, is lost (a slow store never is)", 1, 86400),
    Setting("FTH_SYNC_TIMEOUT_SEC", "sync_timeout", "seconds", None, "the side group's timeout", 1, 30 * 86400,
            shown="the group's"),
    Setting("FTH_RELEASE", "release", "choice", "auto", "how blocked collectives are released (`exit`: no socket "
            "is cut; a blocked rank ends with the reported exit)", choices=("auto", "exit")),
    Setting("FTH_INJECT", "inject", "inject", "", "rehearse a failure", shown="none"),
    Setting("FTH_CKPT_AGREE_TIMEOUT_SEC", "ckpt_agree_timeout", "seconds", 300 * _S, "`latest_checkpoint`: rank 0 "
            "waits this long for every rank's question (then a `TimeoutError` naming the ranks that did not "
            "call), the others twice as long for its answer", 1, 86400),
    Setting("FTH_ATTEMPT_STORE", "attempt_store", "choice", True, "one store namespace per torchrun attempt "
            "([recovering](recovering.md))", choices=("0", "1")),
    Setting("FTH_SNAPSHOT", "snapshot", "choice", True, "recovering in place: keep the newest checkpoint in memory "
            "as well", choices=("0", "1")),
    Setting("FTH_LIVE_STATE", "live_state", "choice", True, "recovering in place: carry on from the ranks' live "
            "state at the last completed step (`0`: from the newest checkpoint) "
            "([recovering](recovering.md#live-state-no-step-computed-twice))", choices=("0", "1"),
            expected="0 (resume from the newest checkpoint) or 1 (from the ranks' live state, the default)"),
    Setting("FTH_SHARD_REPLICAS", "shard_replicas", "integer", 0, "recovering in place with a sharded model "
            "(Ignite + FSDP2, Lightning `ModelParallelStrategy`): copy each rank's shard into a partner's CPU memory every this many steps (`0`: off), "
            "so that a rank whose process is lost gets its shard back from the copy ([sharded](sharded.md))",
            0, 1_000_000),
    Setting("FTH_SHARD_PARTNERS", "shard_partners", "integer", 1, "with `FTH_SHARD_REPLICAS`: how many partners "
            "hold a copy of each rank's shard, each on another host where there is one (each copy costs its holder "
            "one shard's CPU memory; up to the world size - 1)", 1, 1024),
    Setting("FTH_SHARD_REPLICA_WAIT_SEC", "shard_replica_wait", "seconds", 5 * _S, "with `FTH_SHARD_REPLICAS`: "
            "a step waits this long at most for the partners' acknowledgement of the copy of the step before "
            "(`0`: never waits; a failure may then resume a step earlier)", 0, 600),
    Setting("FTH_RECOVER_JOIN_SEC", "recover_join_timeout", "seconds", 60 * _S, "recovering in place: every rank "
            "must reach the recovery this soon after rank 0 (`join_timeout` where given)", 1, 86400),
    Setting("FTH_SPARE_WAIT_SEC", "spare_wait", "seconds", 60 * _S, "`recover_in_place(spares=k)`: a spare waits "
            "for its order in blocking store waits of this long (an order is seen at once whatever it is; it "
            "bounds how often c10d logs the wait's timeout) ([recovering](recovering.md#spares))", 1, 3600),
    # below the peers' FTH_RECOVER_JOIN_SEC, so that a section that hangs still lets the rank recover
    Setting("FTH_INTERRUPT_DEFER_SEC", "interrupt_defer", "seconds", 30 * _S, "recovering in place: a deferred "
            "section (a checkpoint write, a store call, `deferred_interrupt`) holds a hung rank's interrupt back "
            "this long at most, from its first arrival; then it is interrupted inside", 0.1, 3600),
    # a forked child reaches its first Python line in milliseconds, a spawned one after its imports (seconds
    # of CPU); on a saturated host either may wait seconds to run, but it is then runnable, not asleep.
    # Only a child asleep with no CPU time used over the whole deadline is declared: 10 s is far past any
    # healthy start, and short beside what a stuck start costs (the job stalls until a collective timeout)
    Setting("FTH_WORKER_START_SEC", "worker_start_timeout", "seconds", 10 * _S, "`RestartableDataLoader`: a "
            "worker not yet in Python this long after it was started, asleep and with no CPU time used over that "
            "time, is stuck in its start (CPython 3.11.7 can hang a child inside `fork()`, gh-112275): "
            "killed and restarted ([dataloader](dataloader.md)); a slow start uses CPU or is runnable, and is "
            "never declared", 1, 3600),
)
_BY_FIELD = {s.field: s for s in SETTINGS}
KNOWN_ENV = tuple(s.variable for s in SETTINGS)
(INTERVAL_ENV, HANG_TIMEOUT_ENV, START_TIMEOUT_ENV, AUTO_HANG_MULTIPLE_ENV, AUTO_HANG_FLOOR_ENV, AUTO_HANG_WARMUP_ENV,
 EXIT_GRACE_ENV, WRITE_GRACE_ENV, HEARTBEAT_TIMEOUT_ENV, UNACKED_ENV, STORE_LOST_ENV, SYNC_TIMEOUT_ENV, RELEASE_ENV, INJECT_ENV,
 CKPT_AGREE_TIMEOUT_ENV, ATTEMPT_STORE_ENV, SNAPSHOT_ENV, LIVE_STATE_ENV, SHARD_REPLICAS_ENV, SHARD_PARTNERS_ENV,
 SHARD_REPLICA_WAIT_ENV, RECOVER_JOIN_ENV, SPARE_WAIT_ENV,
 INTERRUPT_DEFER_ENV, WORKER_START_ENV) = KNOWN_ENV


#: The checked settings of one process (environment overrides applied): one field per row of :data:`SETTINGS`.
Config = make_dataclass("Config", [(s.field, object) for s in SETTINGS], frozen=True, namespace={"__module__": __name__})
_read: tuple[tuple[tuple[str, str], ...], Config] | None = None  #: (the FTH_* environment, its Config)


def _environment() -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("FTH_")))


def load() -> Config:
    """Read and check every ``FTH_*`` variable. Raises ``ValueError`` naming the first bad one."""
    global _read
    environment = _environment()
    unknown = sorted(k for k, _ in environment if k not in KNOWN_ENV and k != attempts.RUNNING_ENV
                     and not k.startswith("FTH_TEST"))
    if unknown:
        warn_once("ignoring unknown environment variable(s) %s; known: %s" % (", ".join(unknown), ", ".join(KNOWN_ENV)))
    cfg = Config(*(s.read(os.environ.get(s.variable, "")) for s in SETTINGS))
    for problem in check_timings(cfg):
        warn_once(problem)
    _read = (environment, cfg)
    return cfg


def settings() -> Config:
    """The settings, read once (again only when an ``FTH_*`` variable changed since)."""
    return _read[1] if _read is not None and _read[0] == _environment() else load()


#: The forms ``hang_timeout`` accepts, as error messages name them.
HANG_TIMEOUT_FORMS = ("None (off), a datetime.timedelta (e.g. timedelta(minutes=5)), a number of seconds (e.g. 300), "
                      "a 'DD:HH:MM:SS' string (e.g. '00:00:05:00'), a dict of timedelta arguments (e.g. "
                      "{'minutes': 5}) or 'auto' (a deadline learned from the run)")
#: The forms ``recover_in_place(join_timeout=...)`` accepts: those of ``hang_timeout`` but ``'auto'``
#: (no deadline is learned for ranks meeting at a recovery).
JOIN_TIMEOUT_FORMS = ("None (FTH_RECOVER_JOIN_SEC, else 60 s), a datetime.timedelta (e.g. timedelta(minutes=2)), "
                      "a number of seconds (e.g. 120), a 'DD:HH:MM:SS' string (e.g. '00:00:02:00') or a dict of "
                      "timedelta arguments (e.g. {'minutes': 2})")
_DHMS = re.compile(r"\s*(\d+):(\d+):(\d+):(\d+)\s*")


def _as_timedelta(value: object) -> timedelta | None:
    """Seconds, ``"DD:HH:MM:SS"`` or a dict of ``timedelta`` arguments (Lightning ``Timer``'s forms)
    as a ``timedelta``; ``None`` for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value) if math.isfinite(value) and abs(value) < 1e12 else timedelta.max
    if isinstance(value, str):
        match = _DHMS.fullmatch(value)
        if match is None:
            return None
        days, hours, minutes, seconds = (int(part) for part in match.groups())
        try:
            return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        except OverflowError:
            return timedelta.max
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        try:
            return timedelta(**value)
        except (TypeError, ValueError, OverflowError):
            return None
    return None


#: The keys a dict duration may have (``datetime.timedelta``'s keyword arguments).
TIMEDELTA_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def _check_duration(name: str, value: object, what: str, forms: str) -> timedelta | None:
    """``value`` as a ``timedelta`` in setting ``name``'s range (``TypeError`` naming ``forms``, ``ValueError``)."""
    if value is None:
        return None
    bad = [key for key in value if key not in TIMEDELTA_KEYS] if isinstance(value, dict) else []
    if bad:
        raise TypeError(f"{what} must be {forms}; unknown key(s) {', '.join(repr(k) for k in bad)} (the keys are "
                        f"{', '.join(TIMEDELTA_KEYS)}: datetime.timedelta's arguments), got {value!r}")
    duration = value if isinstance(value, timedelta) else _as_timedelta(value)
    if duration is None:
        raise TypeError(f"{what} must be {forms}, got {value!r}")
    row = _BY_FIELD[name]
    if not row.low <= duration.total_seconds() <= row.high:
        raise ValueError(f"{what} must be between {row.low:.15g} and {row.high:.15g} seconds, got {value!r}")
    return duration


def check_hang_timeout(value: object, *, what: str = "hang_timeout") -> timedelta | str | None:
    """``hang_timeout`` as ``None`` (off), ``"auto"`` or a ``timedelta`` of 1 s to 7 days."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    return _check_duration("hang_timeout", value, what, HANG_TIMEOUT_FORMS)


def check_join_timeout(value: object, *, what: str = "join_timeout") -> timedelta | None:
    """``recover_in_place(join_timeout=...)`` as ``None`` or a ``timedelta`` of 1 s to 1 day."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        raise ValueError(f"{what} has no {AUTO!r} (a learned deadline is for hang_timeout only): it must be "
                         f"{JOIN_TIMEOUT_FORMS}, got {value!r}")
    return _check_duration("recover_join_timeout", value, what, JOIN_TIMEOUT_FORMS)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A configuration warning, once per process (every session reads the configuration again)."""
    if message not in _warned:
        _warned.add(message)
        log(logging.WARNING, "%s", message)

# -- Fixed timings of the failure path ---------------------------------------------------------------
# Every timeout and wait no variable sets, defined once; seconds unless a ``timedelta`` (an ``int`` counts
# periods); each ``#:`` comment is its line in docs/reference.md (checked by :func:`check_timings` and
# test_timings.py).

#: Timeout of the main thread's store calls (publishing a record, reading records on a failure).
MAIN_STORE_TIMEOUT = timedelta(seconds=5)
#: Under torchrun, imported after ``init_process_group``: the bound of one try of the ``fth-attempt-keys``
#: thread at deleting the gloo address keys every peer read, and how long it tries.
ATTEMPT_KEYS_WAIT = 3.0
ATTEMPT_KEYS_PATIENCE = 60.0
#: Timeout of the store calls made while explaining a broken collective.
FAILURE_PATH_STORE_TIMEOUT = timedelta(seconds=1)
#: The connect of a loop's connection (the watchdog's, the helper's), made in its own thread: 8 ranks
#: starting on a busy store's host took seconds to be answered (a 1 s connect was made again and again).
BACKGROUND_CONNECT_TIMEOUT = timedelta(seconds=5)
#: How long a broken collective waits for the cause (a killed peer is declared within ~0.1 s).
EXPLAIN_WAIT = 2.0
#: A rank whose heartbeat stands still this long is lost when a second witness says so too (it is at
#: the address a backend error names, or its host acknowledged nothing for FTH_UNACKED_SEC).
SUSPECT_SILENCE = 1.2
#: How long ranks found out of step wait for each other's section names.
MISMATCH_WAIT = 1.0
#: Bound of the store call of a rank whose watchdog stops cleanly (its left mark), also at the
#: interpreter's exit, where the store's host may already be gone.
LEAVE_WAIT = 1.0
#: Bound of the plain connect that tells whether the store is gone while explaining a broken
#: collective (past it: no answer from the store's host, with a connection from it already broken).
EXPLAIN_EVIDENCE_TIMEOUT = 0.5
#: Two reads of a suspect's heartbeat at most this far apart (seconds) observe the time between
#: them; a longer gap (the store answered slowly) does not count as its silence.
SUSPECT_OBSERVED_GAP = 0.5
#: Two answered polls of a heartbeat (the liveness helper's), or two wake-ups of the watchdog thread (the
#: hang probes), at most this many periods apart observe the time between them: a longer gap is no silence.
OBSERVED_GAP = 3

#: How long a failure record may stay unconsumed by a sync point before the watchdog releases (under
#: ``recover_in_place`` only while the main thread is in an agreement: elsewhere it releases at once).
RELEASE_GRACE = timedelta(seconds=0.3)
#: A released rank whose main thread, waiting in a collective, ran no bytecode and used no CPU this long
#: while every connection the release found was closed is blocked where its group's timeout alone ends
#: the call (gloo leaves a send queued on a connection that closed waiting): it ends then, not after
#: FTH_EXIT_GRACE_SEC.
BLOCKED_BEYOND_RELEASE = timedelta(seconds=0.5)
#: Extra time before a neighbour declares a silent rank, on top of ``hang_timeout``.
SILENT_MARGIN = timedelta(seconds=2)
#: Heartbeat period; the ring check runs at the same period.
HEARTBEAT_EVERY = timedelta(seconds=0.5)
#: Timeout of the liveness loop's store calls (only to publish what it declares).
LIVENESS_STORE_TIMEOUT = timedelta(seconds=2)
#: While the store does not answer, its port is tried this often (a plain TCP connect), each try bounded
#: by :data:`STORE_EVIDENCE_TIMEOUT` (past the first SYN retransmission: one lost packet is no evidence).
STORE_CHECK_EVERY = 0.5
STORE_EVIDENCE_TIMEOUT = 1.5
#: A store that is slow but not gone is warned about at most this often (seconds).
STORE_WARN_EVERY = 30.0
#: Timeout of the helper's store calls: a call never blocks it longer than a heartbeat or two.
HELPER_STORE_TIMEOUT = timedelta(seconds=1)
#: How long the helper, woken by its rank's end, waits for the kernel to show the rank's exit
#: status (its files, the pipe, close a moment before it becomes a zombie).
RANK_EXIT_WAIT = 0.05

#: Timeout of the store calls made on a signal (publish the record, look for a peer's).
SIGNAL_STORE_TIMEOUT = timedelta(seconds=1)
#: How long a signalled rank whose signal ends it stays alive after publishing its record: the
#: watchdog's record grace (RELEASE_GRACE) and two polls, so that its peers name the signal.
CAUSE_LINGER = 0.6
#: A peer's record of the same signal within this many seconds of this rank's is the same delivery (both
#: are causes); a launcher's SIGTERM to the survivors comes at least CAUSE_LINGER later (a consequence).
SAME_DELIVERY = 0.3
#: The same behind a framework's handler (Lightning's ``ddp`` rank 0 forwards the signal to the ranks it
#: started, later than a delivery to every process).
SIGNALLED_TOGETHER = 1.0
#: How long a rank ended while it works out a peer's failure waits for that explanation.
REPORT_WAIT = 1.5
#: How long the main thread's handler waits for the reaction under way in the thread (under mp.spawn it
#: may wait for the cause: REPORT_WAIT, SIGTERM_CAUSE_WAIT and a store call).
REACTION_WAIT = 5.0
#: How long the signal thread, its reaction done, waits for the main thread to enter the handler before
#: it takes it for blocked in C (a collective, a store call) and releases it.
MAIN_STUCK_WAIT = 1.0
#: How long it then waits for the released main thread to take the signal before it ends the process
#: itself (the signal's default action only), whatever the main thread is blocked in.
SIGNAL_EXIT_WAIT = 2.0
#: How long a SIGTERM that finds a same-host peer gone, and nothing known yet, waits for the cause
#: (the watchdog's finding or the peer's record); well inside the parent's 30 s before SIGKILL.
SIGTERM_CAUSE_WAIT = 1.0
#: How long a gone rank's liveness helper stays under ``mp.spawn``, keeping the rank a zombie its
#: parent cannot reap yet (so that same-host peers read how it ended).
ZOMBIE_HOLD = 0.5

#: Recovering in place: how often rank 0 counts the ranks that reached the recovery.
RECOVER_POLL = 0.01
#: With spares: how often rank 0, waiting for the ranks to reach the recovery, reads the failed
#: attempt's records for more ranks lost with no keeper (each gets a spare).
LOOK_FOR_LOST = 0.5
#: With spares: how often a launched rank whose training process was lost for good (it stays until
#: the job ends) reads whether the job ended, once its order key holds an older order (a seat it took).
END_POLL = 0.5
#: Recovering in place: destroying a failed attempt's process groups (measured: 20 ms) must end
#: within this many seconds, else the process ends (EXIT_TEARDOWN_STUCK) and its launcher relaunches.
RECOVER_TEARDOWN_SEC = 10.0
#: A rank whose cause is not recovered in place ends at once; its store calls telling its peers why get
#: this many seconds in all (the store may be what is gone: a read would block for minutes).
RECOVER_TELL_SEC = 2.0
#: Recovering in place, a rank hung in Python is interrupted; if its main thread has not left the
#: hang this many seconds later (stuck in C), it ends as without recovery (EXIT_HUNG).
INTERRUPT_WAIT = 2.0
#: While a hung rank's interrupt is not taken by the recovery, the watchdog signals the main thread again
#: this often (one swallowed is raised again); INTERRUPT_WAIT is extended while a deferred section holds it.
INTERRUPT_RESEND = 0.5

#: :class:`~..detect.liveness.HeartbeatProbe`: a silent rank is asked for its left mark at most this often.
LEFT_CHECK_EVERY = 0.5
#: :class:`~..detect.liveness.HeartbeatProbe`: while a watched counter stands still, it is read this often
#: instead of every period (the silence is measured more closely, not shortened).
SILENCE_POLL = 0.1
#: :class:`~..detect.liveness.HeartbeatProbe`: a byte is sent this often on each link to a watched rank's
#: host (:mod:`..detect.witness`): a cut link is witnessed from within this of its moment.
WITNESS_EVERY = timedelta(seconds=0.2)
#: A witness link with no socket (none published yet, refused, broken: the watched rank's helper was
#: replaced) looks up the watched rank's address again at most this often.
WITNESS_RETRY = timedelta(seconds=5)
#: The longest wait between two checks of a store whose port answered the last one: a store that is
#: slow and then dies is declared at most this much later.
MAX_CHECK_HOLD = 2.0
#: After a release, the process groups are torn down at interpreter exit, bounded by this (left to C++
#: static destruction, a joinable gloo thread ends the process with ``std::terminate``).
EXIT_TEARDOWN_SEC = 2.0
#: How often a loader's main thread re-checks worker liveness while it waits for a batch. The pump
#: wakes it at once on a death; this bounds detection if the pump itself is stranded.
WORKER_POLL = 0.05
#: How long a loader's ``abort()`` waits for a SIGKILLed worker to be reaped; and a recovery in place
#: for the failed attempt's DataLoader workers to end before it kills them.
WORKER_REAP = 2.0
#: How long the store host's own client waits to connect to it at start.
STORE_HOST_CONNECT_TIMEOUT = timedelta(seconds=30)


def check_timings(cfg: Config) -> list[str]:
    """What the settings ``cfg`` break of the relations the timings above keep (warned at start: the
    job runs, slower on that part of the failure path); ``tests/unit/core/test_timings.py`` the rest."""
    seconds = lambda t: t.total_seconds() if isinstance(t, timedelta) else float(t)  # noqa: E731
    problems = []
    poll = seconds(cfg.interval)
    if CAUSE_LINGER < seconds(RELEASE_GRACE) + 2 * poll:
        problems.append(f"{INTERVAL_ENV}={poll:g}: a rank ended by its own SIGTERM/SIGINT lingers "
                        f"{CAUSE_LINGER:g} s for its peers to read its record, less than the record grace and "
                        f"two polls ({seconds(RELEASE_GRACE) + 2 * poll:g} s): its peers may name a process "
                        "gone instead of the signal")
    if seconds(cfg.heartbeat_timeout) < 2 * seconds(HEARTBEAT_EVERY):
        problems.append(f"{HEARTBEAT_TIMEOUT_ENV}: below two heartbeats ({2 * seconds(HEARTBEAT_EVERY):g} s)")
    defer, join = seconds(cfg.interrupt_defer), seconds(cfg.recover_join_timeout)
    if defer + INTERRUPT_WAIT >= join:
        problems.append(f"{INTERRUPT_DEFER_ENV}={defer:g}: recovering in place, a hung rank whose deferred section "
                        f"holds its interrupt back that long reaches the recovery after its peers stopped "
                        f"waiting for it ({RECOVER_JOIN_ENV}={join:g} s): the job ends instead of recovering")
    if max(1.0, 5 * poll) > seconds(cfg.store_lost_after):
        problems.append(f"{INTERVAL_ENV}={poll:g}: the watchdog's store calls may take {max(1.0, 5 * poll):g} s, "
                        f"longer than {STORE_LOST_ENV} ({seconds(cfg.store_lost_after):g} s): a lost store is "
                        "declared late")
    return problems
