"""Live state over real ranks (gloo, 2 and 4 processes, ``programs/live_state_main.py``): the ranks
agree on the source and the receivers, the state of a model and its optimizer (SGD with momentum,
Adam) reaches a rank that is behind, untrusted, zeroed, replaced or diverged bit for bit, and the
next step is the same on every rank; a chunk corrupted in flight and a leaf that cannot be carried
make every rank raise together. Each world is one job running its cases in turn (one start)."""

from __future__ import annotations

import pytest
import torch

from launch import HERE, run_ranks

PROGRAM = HERE / "programs" / "live_state_main.py"
CASES_2 = ["equal", "behind", "untrusted", "zeroed", "replaced", "diverged", "corrupt", "refused", "changed"]
CASES_4 = ["mixed", "majority", "corrupt4"]

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]


def _job(world, cases, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"live{world}")
    results = run_ranks(world, "", tmp, script=PROGRAM, env={"CASES": ",".join(cases)}, deadline=120)
    for r in results:
        assert r.returncode == 0 and r.has("done"), r.stderr[-3000:]
        # destroyed, the group is freed at once, not at the interpreter's exit (see the program's main)
        assert r.event("done")["group_freed"], r.rank
    return results, tmp / f"live_state_main-{world}"


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _job(2, CASES_2, tmp_path_factory)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _job(4, CASES_4, tmp_path_factory)


def _events(results, case, name):
    out = []
    for r in results:
        found = [e for e in r.events if e["event"] == name and e.get("case") == case]
        assert len(found) == 1, (r.rank, case, name, r.events)
        out.append(found[0])
    return out


def _agreed(results, case):
    """The agreement, checked to be the same on every rank."""
    agreed = _events(results, case, "agreed")
    fields = ("step", "source", "checksum", "receivers", "whom", "fallback")
    assert len({tuple(str(a[f]) for f in fields) for a in agreed}) == 1, agreed
    return agreed[0], agreed


#: Why a rank receives, as the plan tells it (``LivePlan.whom``).
WHY = {"BEHIND": "a step behind", "DIVERGED": "its state's checksum differs (diverged)", "NO_STATE": "its process was replaced",
       "UNTRUSTED": "it failed inside an optimizer step"}


def _assert_carried_on(results, outdir, case, source, receiving):
    first, agreed = _agreed(results, case)
    assert first["source"] == (source if receiving else -1)  # nobody receives: each rank its own
    assert first["receivers"] == [rank for rank, _ in receiving]
    assert all(f"rank {rank}: {WHY[why]}" in first["whom"] for rank, why in receiving), first["whom"]
    assert first["checksum"] == (agreed[source]["before"] if receiving else "")  # the source's own checksum
    done = _events(results, case, "transferred")
    for r, d in enumerate(done):
        assert d["raised"] is None, d
        assert d["after"] == agreed[source]["before"], (r, d)  # every rank ends with the source's state
        assert d["loaded"] == d["after"]  # and the model and optimizer loaded hold exactly it
        assert d["type_model"] == "OrderedDict" and d["metadata"]
    assert len({d["next_step"] for d in done}) == 1  # the next step is the same everywhere
    reference = torch.load(outdir / f"{case}-rank{source}.pt", weights_only=False)  # the ranks wrote it
    for rank, why in receiving:
        got = torch.load(outdir / f"{case}-rank{rank}.pt", weights_only=False)  # the ranks wrote it
        _assert_identical(reference, got, "state")
        if why != "NO_STATE":
            assert done[rank]["in_place"] is True  # written into the model's own tensors
    return done


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_identical(a, b, path):
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_bytes(a), _bytes(b)), path
    elif type(a).__name__ == "ndarray":
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_identical(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_all_equal_nobody_receives(two):
    results, outdir = two
    _assert_carried_on(results, outdir, "equal", 0, [])


@pytest.mark.parametrize("case, why", [("behind", "BEHIND"), ("untrusted", "UNTRUSTED"), ("zeroed", "UNTRUSTED"),
                                       ("replaced", "NO_STATE"), ("diverged", "DIVERGED")])
def test_the_rank_that_needs_it_receives_the_state_bit_for_bit(two, case, why):
    results, outdir = two
    agreed = _events(results, case, "agreed")
    assert agreed[0]["step"] == 3  # a rank one step behind is brought to the step it missed
    _assert_carried_on(results, outdir, case, 0, [(1, why)])


def test_a_corrupted_chunk_is_detected_and_every_rank_raises(two):
    results, _ = two
    for d in _events(results, "corrupt", "transferred"):
        assert d["raised"] == "StateTransferError" and d["failures"] == {"1": ["CHUNK", 1]}, d
        assert "rank 1: a chunk arrived with another CRC than the source's (chunk 1)" in d["message"]


def test_a_leaf_json_cannot_carry_is_named_on_the_source_and_the_others_raise(two):
    results, _ = two
    source, receiver = _events(results, "refused", "transferred")
    assert source["raised"] == "TypeError" and "state['engine']['handler'] is a builtins.object" in source["message"]
    assert receiver["raised"] == "StateTransferError" and receiver["failures"] == {"0": ["SOURCE", -1]}


def test_a_source_whose_state_moved_after_the_agreement_fails_every_rank(two):
    results, _ = two
    for d in _events(results, "changed", "transferred"):
        assert d["raised"] == "StateTransferError" and d["failures"] == {"1": ["AGREED", -1]}, d
        assert "rank 1: the state received does not have the agreed checksum" in d["message"]


def test_four_ranks_behind_untrusted_and_replaced_receive_from_rank_0(four):
    results, outdir = four
    _assert_carried_on(results, outdir, "mixed", 0, [(1, "BEHIND"), (2, "UNTRUSTED"), (3, "NO_STATE")])


def test_four_ranks_a_diverged_rank_0_is_outvoted(four):
    results, outdir = four
    _assert_carried_on(results, outdir, "majority", 1, [(0, "DIVERGED")])


def test_four_ranks_a_corrupted_chunk_fails_every_rank_together(four):
    results, _ = four
    for d in _events(results, "corrupt4", "transferred"):
        assert d["raised"] == "StateTransferError", d
        # both receivers got the corrupted first chunk (the source sends the same buffer to each)
        assert d["failures"] == {"2": ["CHUNK", 0], "3": ["CHUNK", 0]}, d
