"""A job whose script seeds every random generator the same way in every torchrun attempt relaunches
three times in a row and ends exact (issue 46); the Ignite job at 4 ranks too (``long``).

``tests/seeded_relaunch_main.py`` under ``torchrun --standalone --nproc-per-node 2 --max-restarts 3``:
a rank raises at iteration 7 of attempt 0 (rank 1), 13 of attempt 1 (rank 0) and 19 of attempt 2
(rank 1); each attempt resumes from the checkpoint of the epoch before (iterations 5, 10, 15) and
attempt 3 trains to the end. The final weights of both ranks must equal those of an uninterrupted
run (:func:`uninterrupted`: the same DDP step computed in this process, gradients averaged as DDP
does, which a healthy torchrun run reproduces bit for bit).

Before the fix the run id came from the global ``random``, which the script had seeded: every attempt
had the same run id, and the relaunch read the failure records of the attempt before as new failures
(the plain loop: attempt 1 raised attempt 0's ``ValueError`` as a ``PeerFailedError``, and no
attempt ever finished).

The same Ignite script at 4 ranks with no restart: the library's line naming rank 1 and its cause is
the first error line on every rank (before, Ignite's "Current run is terminating due to exception:
... Connection closed by peer" came first on the survivors, and its own line on rank 1).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from launch import ROOT, kill_workers, run_ranks

SCRIPT = ROOT / "tests" / "seeded_relaunch_main.py"
FAULTS = "0:1:7,1:0:13,2:1:19"
#: The seed the weights are initialized with (rank 0's: DDP gives every rank rank 0's weights).
INIT_SEED = {"ignite": 543, "plain": 1, "lightning": 1, "fabric": 1}
#: The ``DistributedSampler``'s seed (Lightning's and Fabric's: the one ``seed_everything`` was given).
SAMPLER_SEED = {"ignite": 0, "plain": 0, "lightning": 1, "fabric": 1}


def uninterrupted(init_seed: int, sampler_seed: int = 0, epochs: int = 5, lr: float = 0.05) -> dict[str, torch.Tensor]:
    """The weights of an uninterrupted 2-rank run of ``seeded_relaunch_main.py``, computed here (at 4 ranks
    gloo's sum of the gradients rounds in an order of its own: the test runs the job uninterrupted)."""
    from torch.utils.data import DistributedSampler

    sys.path.insert(0, str(SCRIPT.parent))
    from seeded_relaunch_main import BATCH, EPOCH_LENGTH, Samples

    torch.manual_seed(init_seed)
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=lr)
    data = Samples(2)
    samplers = [DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=sampler_seed) for r in range(2)]
    for epoch in range(epochs):
        orders = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for i in range(EPOCH_LENGTH):
            grads = []
            for order in orders:
                ids = order[i * BATCH:(i + 1) * BATCH]
                x, y = torch.stack([data[j][0] for j in ids]), torch.stack([data[j][1] for j in ids])
                layer.zero_grad()
                torch.nn.functional.mse_loss(layer(x), y).backward()
                grads.append([p.grad.clone() for p in layer.parameters()])
            for p, mine, theirs in zip(layer.parameters(), *grads):
                p.grad = mine / 2 + theirs / 2  # DDP: each rank's gradient divided by the world size, summed
            optimizer.step()
    return layer.state_dict()


@pytest.mark.timeout(480)
@pytest.mark.parametrize("framework, world", [("plain", 2), ("ignite", 2),
                                              pytest.param("ignite", 4, marks=pytest.mark.long),
                                              pytest.param("lightning", 2, marks=pytest.mark.long),
                                              pytest.param("fabric", 2, marks=pytest.mark.long)])
def test_a_seeded_job_relaunches_three_times_in_a_row_and_ends_exact(framework, world, tmp_path):
    out = tmp_path / f"{framework}-1"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "--max-restarts", "3"]
    try:
        results = run_ranks(1, framework, tmp_path, script=SCRIPT, launcher=launcher, deadline=420,
                            env={"FAULTS": FAULTS})
    finally:
        kill_workers(out, program=SCRIPT.name)
    output = results[0].stderr
    notes = {p.stem: json.loads(p.read_text()) for p in out.glob("attempt*_rank*.json")}
    assert results[0].returncode == 0, (sorted(notes.items()), output[-6000:])
    for attempt in range(4):
        for rank in range(world):
            note = notes[f"attempt{attempt}_rank{rank}"]
            assert ("finished" in note) == (attempt == 3), (attempt, rank, note, output[-4000:])
            assert note["resumed_at"] in ((None, 0) if attempt == 0 else (5 * attempt,)), (attempt, rank, note)
    assert "attempt 0)" not in output.split("bad batch at iteration 13 (attempt 1)")[-1], output[-6000:]
    if world == 2:
        expected = uninterrupted(INIT_SEED[framework], SAMPLER_SEED[framework])
    else:
        launcher[-1] = "0"
        try:
            ran = run_ranks(1, framework, tmp_path / "uninterrupted", script=SCRIPT, launcher=launcher, deadline=200)
        finally:
            kill_workers(tmp_path / "uninterrupted" / f"{framework}-1", program=SCRIPT.name)
        assert ran[0].returncode == 0, ran[0].stderr[-4000:]
        expected = torch.load(tmp_path / "uninterrupted" / f"{framework}-1" / "final_rank0.pt")
    for rank in range(world):
        got = torch.load(out / f"final_rank{rank}.pt")
        assert all(torch.equal(got[k], expected[k]) for k in expected), (rank, got, expected)


@pytest.mark.timeout(300)
def test_a_lightning_rank_that_raised_is_named_by_torchruns_root_cause_with_its_own_exit_code(tmp_path):
    """Issue 46: with Lightning and no recovery, rank 1 raises at iteration 7 and then spends 6 s in an
    exit hook (a logger's flush); rank 0 ends first (PeerFailedError) and torchrun SIGTERMs rank 1.
    Rank 1 must exit with its own code (1, as stock Lightning's), so that torchrun's Root Cause
    names its exception, not ``exitcode: -15 (SIGTERM)``."""
    from launch import torchrun_root_cause

    out = tmp_path / "lightning-1"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0"]
    try:
        results = run_ranks(1, "lightning", tmp_path, script=SCRIPT, launcher=launcher, deadline=200,
                            env={"FAULTS": "0:1:7", "EXIT_LINGER": "6"})
    finally:
        kill_workers(out, program=SCRIPT.name)
    output = results[0].stderr
    assert results[0].returncode == 1, output[-5000:]
    rank, block = torchrun_root_cause(output)
    assert rank == 1, block or output[-5000:]
    assert "exitcode  : 1 " in block and "SIGTERM" not in block, block
    assert "ValueError: bad batch at iteration 7 (attempt 0)" in block, block


@pytest.mark.timeout(240)
def test_the_librarys_cause_is_the_first_error_line_on_every_ignite_rank(tmp_path):
    world = 4
    out = tmp_path / "ignite-1"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "--max-restarts", "0",
                "--tee", "2"]  # each rank's stderr line prefixed with [default<rank>]:
    try:
        results = run_ranks(1, "ignite", tmp_path, script=SCRIPT, launcher=launcher, deadline=200,
                            env={"FAULTS": "0:1:7"})
    finally:
        kill_workers(out, program=SCRIPT.name)
    output = results[0].stderr
    assert results[0].returncode == 1, output[-5000:]
    cause = "ValueError: bad batch at iteration 7 (attempt 0)"
    for rank in range(world):
        lines = [line.split(":", 1)[1] for line in output.splitlines() if line.startswith(f"[default{rank}]:")]
        errors = [line for line in lines if re.search(r"(?i)exception|error|fail|traceback", line)]
        # rank 1's own line; a survivor's, from its watchdog or its main thread ("stopping: ...")
        expected = f"failed: {cause}" if rank == 1 else f"rank 1 failed in 'train' (epoch 2, iteration 7): {cause}"
        assert errors and errors[0].startswith(f"[rank {rank} step ") and errors[0].endswith(expected), \
            (rank, errors[:3], output[-5000:])
        ignite_line = [i for i, line in enumerate(errors) if "Current run is terminating due to exception" in line]
        assert ignite_line and ignite_line[0] > 0, (rank, errors[:3])  # Ignite's line is still there, after
