"""Branch tests of the core's small units: socket selection, store schema, settings, records,
classification of errors, compat checks, argument checks. No process group, no thread."""

from __future__ import annotations

import json
import logging
import pickle
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fault_tolerant_handlers import fail_together, one_rank_first
from fault_tolerant_handlers.core import compat_torch as _compat_torch
from fault_tolerant_handlers.core import config
from fault_tolerant_handlers.core.compat_torch import is_backend_error
from fault_tolerant_handlers.core.failure import Ended, FailureKind, FailureRecord, PeerFailedError, sanitize
from fault_tolerant_handlers.core.procfs import parse_tcp_table, select_sockets
from fault_tolerant_handlers.core.schema import MAX_OWN_RECORDS, Connection, Schema


def schema_over(store, world_size=4):
    return Schema(Connection(lambda: dist.PrefixStore("fth/t", store), timedelta(seconds=1), "t"), world_size)


# -- release: which sockets are cut ----------------------------------------------------------------
TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 0100007F:A000 01 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100007F:B000 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 222 1
   2: 0100007F:C000 0100007F:D000 01 00000000:00000000 00:00000000 00000000     0        0 333 1
   3: 0100007F:E000 0100007F:F000 0A 00000000:00000000 00:00000000 00000000     0        0 444 1
"""


def test_release_cuts_established_non_store_sockets_of_this_process_only():
    table = parse_tcp_table(TCP)
    assert table == {111: (0x1F90, 0xA000, "01"), 222: (0xB000, 0x1F90, "01"), 333: (0xC000, 0xD000, "01"),
                     444: (0xE000, 0xF000, "0A")}  # 444 is LISTEN: never cut
    fds = {111: 5, 222: 6, 333: 7, 444: 8, 555: 9}  # 555: a socket of this process not in the table (UDP)
    assert select_sockets(fds, table, keep_ports={0x1F90}) == [7]  # both store ends kept
    assert select_sockets(fds, table, keep_ports=set()) == [5, 6, 7]
    assert select_sockets({}, table, keep_ports=set()) == []


# -- schema --------------------------------------------------------------------------------------
def _record(rank=1, **over):
    try:
        raise ValueError("bad sample 17")
    except ValueError as exc:
        rec = FailureRecord.from_exception(exc, rank=rank, section="train", step=3, epoch=1)
    return FailureRecord(**{**rec.__dict__, **over})


def test_a_rank_keeps_a_bounded_number_of_its_records_in_the_store():
    store = dist.HashStore()
    schema = schema_over(store)
    indices = [schema.publish(_record()) for _ in range(3 * MAX_OWN_RECORDS)]
    kept = [i for i in indices if store.check([f"fth/t/r/{i}"])]
    assert kept == indices[-MAX_OWN_RECORDS:]
    assert schema.read(indices[-1]).exc_message == "bad sample 17"
    assert schema.read(indices[0]) is None


def test_a_garbage_heartbeat_is_repaired_naming_the_key(caplog):
    store = dist.HashStore()
    schema = schema_over(store)
    assert schema.beat(1) == 1 and schema.heartbeat_of(1) == 1
    store.set("fth/t/hb/1", "abc")
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert schema.heartbeat_of(1) == 1
    assert "store key hb/1 held a non-integer value" in caplog.text


def test_counter_moves_are_range_checked_and_wrap_aware(caplog):
    schema = schema_over(dist.HashStore())
    assert schema.new_indices(3, 5) == [4, 5]
    assert schema.new_indices(2**63 - 1, -(2**63)) == [-(2**63)]  # the store's counter wrapped
    assert len(schema.new_indices(0, 10_000)) == 256  # newest kept
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert schema.new_indices(5, 2) == []
        assert schema.new_indices(0, 2**40) == []
    assert caplog.text.count("store key n moved") == 2


# -- records ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, problem", [
    ("rank", 10**30, "outside [0, 3]"),
    ("rank", -1, "outside [0, 3]"),
    ("time_ms", -(10**40), "field 'time_ms' = -1000"),
    ("time_ms", 0, "time_ms 0 is more than a year from now"),
    ("seq", 2**60, "outside [0,"),
    ("step", -3, "outside [0,"),
    ("by", 7, "outside [0, 3]"),
    ("origin", "watchdog", "origin 'watchdog' is not one of"),
    ("pid", 2**40, "field 'pid'"),
])
def test_out_of_range_record_fields_are_rejected_naming_the_key(field, value, problem, caplog):
    payload = {**json.loads(_record().to_json()), field: value}
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert FailureRecord.from_json(json.dumps(payload), world_size=4, key="r/9") is None
    assert "store key r/9" in caplog.text and problem in caplog.text


def test_text_from_the_store_is_sanitised_before_it_is_printed():
    raw = "bad\x1b[31m red\x1b[0m \u202eevil \ud800 ok\n\ttab é"
    assert sanitize(raw) == "bad\ufffd[31m red\ufffd[0m \ufffdevil \ufffd ok\n\ttab é"
    payload = {**json.loads(_record().to_json()), "exc_message": raw}
    data = json.dumps(payload).encode()  # json escapes the lone surrogate as \\ud800
    record = FailureRecord.from_json(data, world_size=4)
    assert "\x1b" not in record.exc_message and "\ud800" not in record.exc_message
    str(PeerFailedError.from_records([record])).encode("utf-8")  # printable without errors


# -- kinds ---------------------------------------------------------------------------------------
def test_a_kind_keeps_its_text_and_an_ended_process_says_how():
    assert FailureKind.PEER_LOST == "PeerLost" and f"{FailureKind.RANK_HUNG}: x" == "RankHung: x"
    assert json.dumps({"k": FailureKind.PEER_SILENT}) == '{"k": "PeerSilent"}'
    assert FailureKind.of("PeerLost", "declared") is FailureKind.PEER_LOST
    assert FailureKind.of("PeerLost", "failure") is FailureKind.RAISED  # an exception a rank raised
    assert FailureKind.of("KeyError", "declared") is FailureKind.RAISED
    killed = Ended.from_status(9)
    assert killed == Ended(signal=9) and killed.killed and killed.describe() == "killed by SIGKILL"
    assert Ended.from_status(3 << 8) == Ended(exit_code=3) and Ended(exit_code=3).describe() == "exited with code 3"
    assert Ended(signal=63).signal_name == "signal 63" and not Ended(exit_code=0).killed
    assert Ended().describe() == "process is gone (exit status not visible from this process)"
    with pytest.raises(AttributeError):
        killed.signal = 15  # frozen


def test_a_record_carries_its_kind_and_how_the_process_ended_through_the_store():
    lost = FailureRecord.lost(rank=1, pid=42, host="node-b", why=Ended(signal=9), by=0)
    assert lost.exc_message == "rank 1 (pid 42 on node-b) lost: killed by SIGKILL"
    read = FailureRecord.from_json(lost.to_json(), world_size=4)
    assert read == lost and read.kind is FailureKind.PEER_LOST and read.ended == Ended(signal=9)
    err = PeerFailedError.from_records([read])
    assert (err.kind, err.ended, err.exc_type) == (FailureKind.PEER_LOST, Ended(signal=9), "PeerLost")
    assert str(err) == "PeerLost: rank 1 (pid 42 on node-b) lost: killed by SIGKILL"  # the message as before
    again = pickle.loads(pickle.dumps(err))
    assert (again.kind, again.ended, str(again)) == (err.kind, err.ended, str(err))
    host = FailureRecord.lost(rank=1, pid=42, host="node-b", why="its host no longer accepts connections", by=0)
    assert host.ended is None and FailureRecord.from_json(host.to_json(), world_size=4).ended is None
    own = PeerFailedError.from_records([_record()])
    assert own.kind is FailureKind.RAISED and own.ended is None
    assert PeerFailedError.from_records([]).kind is FailureKind.UNKNOWN


def test_a_record_of_text_outside_ascii_at_its_longest_is_read_back_whole():
    # 2,000 CJK characters in the message and 8,000 in the traceback: escaped as \\uXXXX (6 bytes a
    # character) that was 60 KB, over the reader's 16 KB limit, and every peer read "unknown"
    from fault_tolerant_handlers.core.failure import MAX_MESSAGE_CHARS, MAX_RECORD_BYTES

    text = "\u68c0\u67e5\u70b9" * 700  # 3 bytes each in UTF-8
    record = _record(exc_message=text[:MAX_MESSAGE_CHARS], traceback=text[:2_000] + "\n  lost_sample()\n")
    raw = record.to_json()
    assert len(raw) <= MAX_RECORD_BYTES
    assert FailureRecord.from_json(raw, world_size=4) == record  # nothing had to be cut


def test_a_record_too_large_in_utf8_gives_up_its_oldest_traceback():
    from fault_tolerant_handlers.core.failure import MAX_MESSAGE_CHARS, MAX_RECORD_BYTES, MAX_TRACEBACK_CHARS

    four = "\U0001f525" * MAX_TRACEBACK_CHARS  # 4 bytes each: 32 KB of traceback alone
    record = _record(exc_message="\U0001f525" * MAX_MESSAGE_CHARS, traceback=four[:-20] + "  raise ValueError(x)\n")
    raw = record.to_json()
    assert len(raw) <= MAX_RECORD_BYTES
    read = FailureRecord.from_json(raw, world_size=4)
    assert read is not None and read.exc_type == "ValueError" and read.rank == 1
    assert read.traceback.endswith("  raise ValueError(x)\n")  # the newest frames are kept
    assert read.traceback.startswith("...[truncated]...")
    assert read.exc_message == record.exc_message  # the traceback gave enough
    both = _record(exc_message="\U0001f525" * MAX_MESSAGE_CHARS, traceback=four, host="\U0001f525" * 200,
                   section="\U0001f525" * 200, exc_type="E" + "\U0001f525" * 199)
    read = FailureRecord.from_json(both.to_json(), world_size=4)  # every field at its longest
    assert read is not None and len(both.to_json()) <= MAX_RECORD_BYTES
    assert read.exc_message == both.exc_message and read.traceback.endswith("\U0001f525" * 100)
    lone = _record(exc_message="a \ud800 b")  # a lone surrogate: UTF-8 cannot hold it
    assert FailureRecord.from_json(lone.to_json(), world_size=4).exc_message == "a ? b"


@pytest.mark.parametrize("ended", [
    "missing", None, "killed by SIGKILL", [9], {"signal": 0}, {"signal": 65}, {"signal": True}, {"signal": 9.0},
    {"exit_code": 256}, {"exit_code": -1}, {"exit_code": "1"}, {"exit_code": 1, "signal": 9}, {"signal": 2**70},
])
def test_a_record_with_a_bad_or_missing_ending_is_read_without_it(ended):
    """An old record (no ``ended``) or a malformed one is still read: how the process ended is not known."""
    payload = json.loads(FailureRecord.lost(rank=1, pid=42, host="h", why=Ended(signal=9), by=0).to_json())
    if ended == "missing":
        del payload["ended"]
    else:
        payload["ended"] = ended
    record = FailureRecord.from_json(json.dumps(payload), world_size=4)
    assert record is not None and record.ended is None and record.kind is FailureKind.PEER_LOST
    assert record.exc_message == "rank 1 (pid 42 on h) lost: killed by SIGKILL"


@pytest.mark.parametrize("kind", ["PeerEnded", "", 7, None, "raised"])
def test_a_declared_record_of_an_unknown_kind_is_rejected_naming_the_key(kind, caplog):
    payload = {**json.loads(FailureRecord.lost(rank=1, pid=42, host="h", why="gone", by=0).to_json()), "exc_type": kind}
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert FailureRecord.from_json(json.dumps(payload), world_size=4, key="r/5") is None
    assert "store key r/5" in caplog.text
    with pytest.raises(ValueError):
        FailureRecord.declared(rank=1, kind="PeerEnded", message="x", by=0)


@pytest.mark.parametrize("kind", ["PeerEnded", "", 7, None, "RAISED", "raised", [], {"x": 1}])
def test_a_declared_kind_is_read_back_as_its_kind_and_anything_else_rejects_the_record(kind, caplog):
    """A declared record's kind is its ``exc_type``: one of the declared kinds, else the whole record is
    ignored, naming the key (the store is unauthenticated)."""
    record = FailureRecord.declared(rank=1, kind=FailureKind.PEER_LOST, message="rank 1 lost", by=0)
    read = FailureRecord.from_json(record.to_json(), 2)
    assert read == record and read.kind is FailureKind.PEER_LOST
    payload = {**json.loads(record.to_json()), "exc_type": kind}
    with caplog.at_level(logging.WARNING, logger="fault_tolerant_handlers"):
        assert FailureRecord.from_json(json.dumps(payload), 2, key="c/0") is None
    assert "store key c/0" in caplog.text


# -- classification ------------------------------------------------------------------------------
@pytest.mark.parametrize("exc", [
    socket.timeout("timed out"), TimeoutError("download timed out"), ConnectionResetError("Connection reset by peer"),
    OSError("Socket closed"), RuntimeError("gloo says hello"), RuntimeError("Timed out waiting for the NCCL kernel"),
])
def test_errors_of_user_code_are_the_ranks_own(exc):
    assert not is_backend_error(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242"),
    RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms"),
    dist.DistNetworkError("recvValue failed"), dist.DistBackendError("NCCL communicator was aborted"),
    dist.DistStoreError("store timeout"),
])
def test_backend_errors_are_recognised(exc):
    assert is_backend_error(exc)


# -- settings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variable, value", [
    ("FTH_WATCHDOG_INTERVAL_SEC", "1e10"), ("FTH_WATCHDOG_INTERVAL_SEC", "0"), ("FTH_EXIT_GRACE_SEC", "1e10"),
    ("FTH_EXIT_GRACE_SEC", "inf"), ("FTH_HANG_TIMEOUT_SEC", "nan"), ("FTH_SYNC_TIMEOUT_SEC", "1e10"),
    ("FTH_HEARTBEAT_TIMEOUT_SEC", "-1"), ("FTH_STORE_LOST_SEC", "abc"), ("FTH_WRITE_GRACE_SEC", "1e9"),
])
def test_every_timeout_variable_is_range_checked_naming_it(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}='{value}': expected a number of seconds from"):
        config.load()


def test_release_and_inject_variables_are_checked_when_the_job_starts(monkeypatch):
    monkeypatch.setenv("FTH_RELEASE", "abc")
    with pytest.raises(ValueError, match="FTH_RELEASE='abc': expected one of auto, exit"):
        config.load()
    monkeypatch.delenv("FTH_RELEASE")
    monkeypatch.setenv("FTH_INJECT", "explode@rank=1,iteration=5")
    with pytest.raises(ValueError, match="FTH_INJECT: unknown kind 'explode'"):
        config.load()


def test_constructing_an_adapter_checks_the_environment(monkeypatch):
    from fault_tolerant_handlers.ignite import FaultTolerance

    monkeypatch.setenv("FTH_RELEASE", "abc")
    with pytest.raises(ValueError, match="FTH_RELEASE"):
        FaultTolerance()


@pytest.mark.parametrize("value", [timedelta.max, timedelta(0)])
def test_timeout_arguments_have_bounds(value):
    with pytest.raises(ValueError, match="between 1 and 604800 seconds"):
        config.check_hang_timeout(value)


# -- names and positions are checked when constructed ---------------------------------------------
def test_names_and_positions_are_checked_when_constructed():
    from fault_tolerant_handlers.ignite import FaultTolerance

    with pytest.raises(TypeError, match=r"FaultTolerance\(name=\.\.\.\) must be a non-empty str"):
        FaultTolerance(name=123)
    with pytest.raises(TypeError, match=r"one_rank_first\(name=\.\.\.\) must be a non-empty str"):
        one_rank_first(name=123)
    with pytest.raises(TypeError, match=r"fail_together\(step=\.\.\.\) must be a non-negative int or None"):
        fail_together("x", step="3")
    with pytest.raises(TypeError, match=r"fail_together\(epoch=\.\.\.\)"):
        fail_together("x", epoch=-1)
    with pytest.raises(TypeError, match=r"fail_together\(group=\.\.\.\) must be a torch.distributed.ProcessGroup"):
        fail_together("x", group="world")


# -- compat -------------------------------------------------------------------------------------
def test_a_torch_without_a_private_api_fails_at_start_naming_it(monkeypatch):
    from torch.distributed import distributed_c10d

    monkeypatch.setattr(_compat_torch, "_checked", False)
    monkeypatch.delattr(distributed_c10d, "_abort_process_group")
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed\.distributed_c10d\._abort_process_group"):
        _compat_torch.check()


def test_an_ignite_without_event_handlers_fails_at_attach_naming_it():
    from ignite.engine import Engine

    from fault_tolerant_handlers.ignite import FaultTolerance

    engine = Engine(lambda e, b: None)
    del engine._event_handlers
    with pytest.raises(RuntimeError, match=r"Engine\._event_handlers"):
        FaultTolerance().attach(engine)


def test_lightning_compat_check_names_what_is_missing():
    from fault_tolerant_handlers.adapters import compat_lightning as _compat_lightning

    class Bare:
        pass

    with pytest.raises(RuntimeError, match=r"Trainer\._run_stage, lightning\.pytorch\.Trainer\._teardown"):
        _compat_lightning.check(Bare())
