"""Sending live state (recover/transfer.py), branch by branch: the checksum (deterministic, sensitive to structure and bytes, refusing
what JSON cannot carry, by path), the rebuild of the structure on a receiver (in place where it can),
and the arguments (the rule, :func:`plan_live`, in ``test_inplace_units.py``). Transfers between real ranks are in
``tests/distributed/test_state_transfer.py``."""

from __future__ import annotations

import collections
import functools
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fault_tolerant_handlers.core.errors import StateTransferError
from fault_tolerant_handlers.recover import transfer as protocol
from fault_tolerant_handlers.recover.transfer import checksum, transfer

ROOT = Path(__file__).resolve().parents[3]

_MAKE = """
import random, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.randn(4, 8)).sum().backward()
opt.step()
random.seed(3)
state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "python": random.getstate(),
         "engine": {"iteration": 7, "epoch": 1, "loss": float("nan"), "tag": b"\\x00\\xff", "best": None}}
"""


def _state() -> dict:
    scope: dict = {}
    exec(_MAKE, scope)
    return scope["state"]


def test_checksum_is_the_same_for_the_same_state_in_another_process():
    here = checksum(_state())
    assert checksum(_state()) == here and len(here) == 32
    code = _MAKE + "from fault_tolerant_handlers.recover.transfer import checksum\nprint(checksum(state))"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == here


def _variants():
    t = torch.arange(4, dtype=torch.float32)
    flipped = t.clone()
    flipped.view(torch.int32)[2] ^= 1  # one bit
    od = collections.OrderedDict(a=1)
    od_meta = collections.OrderedDict(a=1)
    od_meta._metadata = {"": {"version": 2}}
    return [
        ("list vs tuple", [1, 2], (1, 2)),
        ("dict vs OrderedDict", {"a": 1}, od),
        ("_metadata", od, od_meta),
        ("int key vs str key", {0: 1}, {"0": 1}),
        ("key order", {"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ("int vs float vs bool", 1, 1.0),
        ("int vs bool", 1, True),
        ("bytes vs str", b"ab", "ab"),
        ("None vs missing", {"a": None}, {}),
        ("dtype, same bytes", t, t.view(torch.int32)),
        ("shape, same bytes", t, t.view(2, 2)),
        ("one bit", t, flipped),
        ("signed zero", torch.tensor([0.0]), torch.tensor([-0.0])),
        ("tensor vs list", torch.tensor([1]), [1]),
        ("which leaf holds the bytes", {"a": t[:2].clone(), "b": t[2:].clone()},
         {"a": t[:3].clone(), "b": t[3:].clone()}),
    ]


@pytest.mark.parametrize("name, a, b", _variants(), ids=[v[0] for v in _variants()])
def test_checksum_tells_apart_structure_types_and_bytes(name, a, b):
    assert checksum(a) != checksum(b)


def test_checksum_reads_the_values_not_the_layout_device_or_grad():
    t = torch.randn(3, 5)
    assert checksum(t.t()) == checksum(t.t().contiguous())  # a strided view: its values in row-major order
    z = torch.randn(4, dtype=torch.complex64)
    assert checksum(z.conj()) == checksum(z.conj().resolve_conj())
    assert checksum(torch.nn.Parameter(t.clone())) == checksum(t)
    assert checksum(torch.empty(0, 3)) != checksum(torch.empty(3, 0))


def test_numpy_arrays_are_carried_like_tensors():
    numpy = pytest.importorskip("numpy")
    rng = numpy.random.RandomState(1).get_state()
    assert checksum(rng) == checksum(numpy.random.RandomState(1).get_state())
    assert checksum(rng) != checksum(numpy.random.RandomState(2).get_state())
    with pytest.raises(TypeError, match=r"state\[0\] is a numpy.ndarray"):
        checksum([numpy.array([object()])])


@pytest.mark.parametrize("bad, path", [
    ({"a": [1, {"b": object()}]}, r"state\['a'\]\[1\]\['b'\] is a builtins.object"),
    ({"p": collections.namedtuple("P", "x")(1)}, r"state\['p'\] is a .*P,"),
    ({"s": {1, 2}}, r"state\['s'\] is a builtins.set"),
    ({"d": collections.defaultdict(int)}, r"state\['d'\] is a collections.defaultdict"),
    ({"f": torch.float32}, r"state\['f'\] is a torch.dtype"),
    ({"x": {torch.tensor(1): 2}}, r"state\['x'\] has a key tensor\(1\)"),
    ({"sp": torch.eye(2).to_sparse()}, r"state\['sp'\] is a tensor live state cannot carry"),
])
def test_what_json_cannot_carry_is_refused_by_its_path(bad, path):
    with pytest.raises(TypeError, match=path):
        checksum(bad)


def _roundtrip(state, local):
    """What a receiver rebuilds from ``state``'s structure and bytes, given its own ``local`` state."""
    structure, leaves = protocol._structure(state)
    out, dests = protocol._rebuild(structure, local, sum(t.numel() * t.element_size() for t in leaves))
    assert len(dests) == len(leaves)
    with torch.no_grad():
        for dest, leaf in zip(dests, leaves):
            if dest.numel():
                dest.reshape(-1).view(torch.uint8).copy_(protocol._flat_bytes(leaf))
    return out


@pytest.mark.parametrize("forged, why", [
    (b"\x80", "not JSON"),
    (b"[" * 5000 + b"]" * 5000, "not JSON"),
    (b'{"l": [1], "t": [2]}', "state is a malformed node"),
    (b'{"q": 1}', "state is a malformed leaf"),
    (b'{"l": {"a": 1}}', "state is a malformed node"),
    (b'{"d": [[[1], 2]]}', "state has a malformed key"),
    (b'{"d": [["a"]]}', "state is a malformed node"),
    (b'{"b": "not base64!"}', "state is not base64"),
    (b'{"l": [{"x": ["object", [1]]}]}', r"state\[0\] is a malformed leaf"),
    (b'{"x": ["float32", [-1]]}', "state is a malformed leaf"),
    (b'{"x": ["float32", [1.5]]}', "state is a malformed leaf"),
    (b'{"x": ["float32", [1000000, 1000000]]}', "more than the header's 16 bytes"),
    (b'{"l": ' * 70 + b"1" + b"}" * 70, "malformed node"),
], ids=["binary", "deep-json", "two-tags", "unknown-tag", "list-not-list", "key", "pair", "base64", "dtype",
        "negative", "float-shape", "over-header", "deep"])
def test_a_structure_from_the_source_is_checked_before_anything_is_made(forged, why):
    with pytest.raises(ValueError, match=why):
        protocol._rebuild(forged, None, total=16)


def test_a_structure_over_the_bound_is_refused_on_both_sides():
    with pytest.raises(ValueError, match="more than"):
        protocol._rebuild(b" " * (16 * 2**20 + 1), None, total=0)
    with pytest.raises(TypeError, match=r"nested deeper than 64"):
        checksum(functools.reduce(lambda inner, _: [inner], range(70), 1))


def test_a_receiver_writes_into_its_own_tensors_where_dtype_and_shape_match():
    source = _state()
    mine = _state()
    with torch.no_grad():
        for t in mine["model"].values():
            t.zero_()
    mine["model"]["0.weight"] = torch.zeros(3)  # another shape: a new tensor
    mine["model"]["extra"] = torch.zeros(2)  # not in the source: dropped
    pointers = {k: v.data_ptr() for k, v in mine["model"].items()}
    momentum = mine["optimizer"]["state"][0]["momentum_buffer"]
    out = _roundtrip(source, mine)
    assert checksum(out) == checksum(source)
    assert type(out["model"]) is collections.OrderedDict and out["model"]._metadata == source["model"]._metadata
    assert out["model"]["0.bias"].data_ptr() == pointers["0.bias"]  # in place
    assert out["model"]["0.weight"].data_ptr() != pointers["0.weight"] and out["model"]["0.weight"].shape == (16, 8)
    assert "extra" not in out["model"]
    assert out["optimizer"]["state"][0]["momentum_buffer"] is momentum  # in place, int keys kept
    assert out["python"] == source["python"] and type(out["python"]) is tuple
    assert out["engine"]["tag"] == b"\x00\xff"


def test_a_receiver_without_state_gets_new_tensors_that_load():
    source = _state()
    out = _roundtrip(source, None)
    assert checksum(out) == checksum(source)
    scope: dict = {}
    exec(_MAKE, scope)
    scope["model"].load_state_dict(out["model"])
    scope["opt"].load_state_dict(out["optimizer"])


def test_transfer_arguments():
    state = {"a": 1}
    assert transfer(state, 0, []) is state  # nobody receives: no collective at all
    with pytest.raises(ValueError, match="the source must be a rank that does not receive"):
        transfer(state, 1, [1])
    with pytest.raises(ValueError, match="the source must be a rank"):
        transfer(state, None, [1])
    with pytest.raises(ValueError, match="chunk_bytes"):
        transfer(state, 0, [1], chunk_bytes=10)


def test_the_transfer_error_pickles_with_its_fields():
    err = StateTransferError("x", 0, {1: ("CHUNK", 2)})
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.source, back.failures) == ("x", 0, {1: ("CHUNK", 2)})


def test_the_segments_leaves_travel_in():
    plan = protocol._plan([10, 3000, 0, 20, 9000, 5], chunk_bytes=4096, direct_bytes=1024)
    # small leaves packed, large ones alone in slices of at most a chunk, every byte once, in order
    assert plan == [[(0, 0, 10)], [(1, 0, 3000)], [(2, 0, 0), (3, 0, 20)], [(4, 0, 4096)], [(4, 4096, 4096)],
                    [(4, 8192, 808)], [(5, 0, 5)]]
    # a packed segment is one message (its bytes and the CRC), a direct one two
    assert protocol._messages(plan, [10, 3000, 0, 20, 9000, 5], 1024) == [
        14, 3000, 4, 24, 4096, 4, 4096, 4, 808, 4, 9]
    assert protocol._plan([], 4096, 1024) == [[]]  # no bytes: one segment carries the digest
    assert protocol._plan([600, 600, 600], 1024, 1024) == [[(0, 0, 600)], [(1, 0, 600)], [(2, 0, 600)]]


# -- a receiver's header from an unauthenticated source: checked before anything is made from it --------

class _Done:
    def wait(self) -> None:
        pass


def _messages_sent(monkeypatch, state, chunk: int) -> list[torch.Tensor]:
    """Every message the source sends for ``state``, in order (the source's part, without a group)."""
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(protocol, "_send", lambda buffer, receivers, group: sent.append(buffer.clone()) or [])
    assert protocol._send_state(state, [1], None, chunk)[1] is None
    return sent


def _receive(monkeypatch, messages: list[torch.Tensor], chunk: int):
    """The receiver's part fed ``messages``: ``(its result, the size of every receive it asked for)``."""
    asked: list[int] = []

    def recv(buffer, source, group):
        asked.append(buffer.numel())
        assert len(asked) <= len(messages), f"receive {len(asked)} of {buffer.numel()}: the source sent no more"
        message = messages[len(asked) - 1]
        assert message.numel() == buffer.numel(), (len(asked), message.numel(), buffer.numel())
        buffer.copy_(message)
        return _Done()

    monkeypatch.setattr(protocol, "_recv", recv)
    return protocol._receive_state(None, 0, None, None, chunk), asked


@pytest.mark.parametrize("field, value", [
    (0, 2**40), (0, 16 * 2**20 + 1),  # structure bytes: over the bound a structure may have
    (2, 2**40), (2, 0), (2, -1),  # messages: more than the structure and bytes can make, none, negative
    (1, -5),  # bytes
    (3, 2**40), (3, 1024),  # chunk: not the one every rank passed
    (4, 7),  # direct: not the one the chunk gives
], ids=["length-huge", "length-over", "count-huge", "count-zero", "count-negative", "total-negative", "chunk-huge",
        "chunk-other", "direct"])
def test_a_forged_header_is_refused_before_anything_is_allocated_from_it(monkeypatch, field, value):
    """The store and the source are not authenticated: a header whose sizes are out of bounds is refused
    (HEADER) after the header alone, before a buffer of its ``length`` or ``count`` is made. Before,
    the receiver allocated ``count`` int64 and ``length`` bytes first (1 TiB here)."""
    chunk = 4096
    genuine = _messages_sent(monkeypatch, _state(), chunk)
    (state, total, failure), asked = _receive(monkeypatch, genuine, chunk)  # the genuine header passes
    assert failure is None and checksum(state) == checksum(_state()) and len(asked) == len(genuine)
    forged = genuine[0].clone()
    forged[field] = value
    (state, total, failure), asked = _receive(monkeypatch, [forged, *genuine[1:]], chunk)
    assert failure == (protocol.TransferFailure.HEADER, -1) and state is None and asked == [5]


def test_forged_message_lengths_are_refused_before_a_buffer_is_made_from_them(monkeypatch):
    chunk = 4096
    genuine = _messages_sent(monkeypatch, _state(), chunk)
    lengths = genuine[1].clone()
    lengths[0] = 2**40  # would be the scratch buffer's size when the structure does not match
    (state, _, failure), asked = _receive(monkeypatch, [genuine[0], lengths, *genuine[2:]], chunk)
    assert failure == (protocol.TransferFailure.HEADER, -1) and asked == [5, lengths.numel()]


def test_the_header_bound_holds_for_a_state_of_many_empty_leaves(monkeypatch):
    """The bound on the messages (3 per byte of structure, 2 per chunk) is never under a genuine state's."""
    state = {"e": [torch.zeros(0) for _ in range(300)], "big": torch.arange(20000.0), "x": [torch.ones(1)] * 50}
    chunk = 1024
    genuine = _messages_sent(monkeypatch, state, chunk)
    (back, _, failure), asked = _receive(monkeypatch, genuine, chunk)
    assert failure is None and checksum(back) == checksum(state) and len(asked) == len(genuine)
