"""The RNG states live state records and puts back (``core/rng_state.py``): torch's, Python's ``random``
and numpy's global RNG, as tensors; what comes from another rank is range checked, a malformed record
refused (``None``, or ``ManifestError`` from a snapshot), never unpickled."""

from __future__ import annotations

import random
import sys

import numpy
import pytest
import torch

from fault_tolerant_handlers.core import rng_state
from fault_tolerant_handlers.core.sharded import ManifestError, rng_of, take_snapshot


def _draws() -> list:
    return [torch.rand(3).tolist(), random.random(), random.gauss(0, 1), numpy.random.rand(2).tolist(),
            numpy.random.standard_normal()]


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


@pytest.mark.parametrize("via", ["record", "transfer", "snapshot"])
def test_a_record_puts_back_torchs_pythons_and_numpys_generators(via):
    """A Gaussian cached by each (``random.gauss``, numpy's ``standard_normal``) comes back too; the record
    as a transfer carries it (a list) and through a shard snapshot reads the same."""
    _seed(3)
    random.gauss(0, 1)  # Python caches the second of its pair
    numpy.random.standard_normal()  # so does numpy's legacy generator
    states = random.getstate(), numpy.random.get_state()
    rng = rng_state.of(rng_state.read())
    assert [t.dtype for t in rng[2:]] == [torch.int64, torch.int64] and rng[2][-2] == 1 and rng[3][-2] == 1
    if via == "transfer":
        rng = rng_state.checked(list(rng))
    elif via == "snapshot":
        rng = rng_of(take_snapshot({"w": torch.ones(2)}, 7, 0, rng=rng))
    assert rng_state.same(rng, rng_state.of(rng_state.read()))
    expected = _draws()
    _seed(4)
    assert not rng_state.same(rng, rng_state.of(rng_state.read()))
    rng_state.restore(rng)
    assert random.getstate() == states[0]
    assert all(numpy.array_equal(a, b) for a, b in zip(numpy.random.get_state(), states[1]))
    assert _draws() == expected


def test_numpy_is_never_imported_for_it_and_the_earlier_torch_only_record_still_reads(monkeypatch):
    monkeypatch.delitem(sys.modules, "numpy.random")
    rng = rng_state.of(rng_state.read())
    assert rng[3] is None and "numpy.random" not in sys.modules
    monkeypatch.undo()
    old = rng_state.checked((torch.get_rng_state(), None))  # (cpu, cuda): torch's only
    assert old is not None and old[1:] == (None, None, None)
    random.seed(1)
    before = random.getstate()
    rng_state.restore(old)  # torch's put back, Python's left alone
    assert random.getstate() == before
    assert [[t is old[0] for t in g] for g in rng_state.groups(old)] == [[True], [], []]
    assert not rng_state.same(old, rng)


def test_a_receiver_takes_the_parts_agreed_from_the_source_and_its_own_for_the_others():
    """A transfer sends the parts every rank at the step recorded alike (here torch's and numpy's: the
    ranks' ``random`` differs); the receiver fills the others from its own of that step, if it has one."""
    _seed(1)
    source = rng_state.of(rng_state.read())
    _seed(2)
    own = rng_state.of(rng_state.read())
    sent = rng_state.checked(rng_state.only(source, (0, 2)))
    assert sent[2] is None and rng_state.groups(sent)[1] == []
    got = rng_state.merged(sent, own)
    assert torch.equal(got[0], source[0]) and torch.equal(got[2], own[2]) and torch.equal(got[3], source[3])
    assert rng_state.merged(sent, None) is sent and rng_state.merged(None, own) is own
    python_only = rng_state.checked(rng_state.only(source, (1,)))  # no torch part: torch's left as it is
    torch.manual_seed(9)
    before = torch.get_rng_state()
    rng_state.restore(python_only)
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(rng_state.of(rng_state.read())[2], source[2])


def _with(part: int, value):
    rng = list(rng_state.of(rng_state.read()))
    rng[part] = value
    return rng


def _mt(index: int, value: int) -> torch.Tensor:
    t = rng_state.of(rng_state.read())[2].clone()
    t[index] = value
    return t


MALFORMED = {
    "not a list": lambda: "rng",
    "three parts": lambda: rng_state.of(rng_state.read())[:3],
    "cpu not uint8": lambda: _with(0, torch.get_rng_state().to(torch.int64)),
    "cpu of another size": lambda: _with(0, torch.get_rng_state()[:-1]),
    "cuda not a list": lambda: _with(1, torch.get_rng_state()),
    "cuda without cpu": lambda: [None, [torch.zeros(4, dtype=torch.uint8)], None, None],
    "cuda not uint8": lambda: _with(1, [torch.zeros(4)]),
    "python not a tensor": lambda: _with(2, random.getstate()),
    "python float64": lambda: _with(2, rng_state.of(rng_state.read())[2].double()),
    "python too short": lambda: _with(2, rng_state.of(rng_state.read())[2][:-1]),
    "python word >= 2**32": lambda: _with(2, _mt(5, 2**32)),
    "python word < 0": lambda: _with(2, _mt(0, -1)),
    "python position > 624": lambda: _with(2, _mt(624, 625)),
    "python cached flag 2": lambda: _with(2, _mt(625, 2)),
    "numpy an array": lambda: _with(3, numpy.random.get_state()[1]),
    "numpy position < 0": lambda: _with(3, _mt(624, -1)),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_record_is_refused(name):
    bad = MALFORMED[name]()
    assert rng_state.checked(bad) is None
    if isinstance(bad, (list, tuple)):  # the same refused from a partner's shard snapshot
        with pytest.raises(ManifestError, match="the snapshot's RNG states are malformed"):
            rng_of(take_snapshot({}, 7, 0, rng=tuple(bad)))
