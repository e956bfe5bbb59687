"""2-rank Ignite and Lightning runs with a DataLoader worker SIGKILLed mid-epoch (``dl_train.py``).

Each run is started twice, with and without the kill; both must complete and end with bit-identical
model weights on every rank. Ranks are separate processes (gloo, 20 s process-group timeout), each
in its own session, killed with that session by pid in a ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from launch import PROGRAMS, free_port

SCRIPT = PROGRAMS / "dl_train.py"
DEADLINE = 90.0


def run_two_ranks(framework: str, kill: bool, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    out = tmp_path / f"{framework}-{int(kill)}"
    out.mkdir()
    port = free_port()
    procs, logs = [], []
    try:
        for rank in (0, 1):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
            log = open(out / f"log{rank}", "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), framework, str(out), str(int(kill))],
                                          env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank's session: the rank and its workers
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(timeout=10)
    tails = []
    for log in logs:
        log.seek(0)
        tails.append(log.read()[-3000:])
        log.close()
    assert not hung, f"ranks {hung} still running after {DEADLINE}s:\n" + "\n".join(tails)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{tails[rank]}"
    infos = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    weights = [torch.load(out / f"weights{r}.pt") for r in (0, 1)]
    return infos, weights


def check(framework: str, tmp_path: Path) -> list[dict]:
    killed, w_killed = run_two_ranks(framework, True, tmp_path)
    clean, w_clean = run_two_ranks(framework, False, tmp_path)
    # the fault fired: rank 1 killed a real worker, and that worker was restarted
    assert killed[1]["kill"] is not None and clean[1]["kill"] is None
    assert killed[0]["restart_count"] == 0 and clean[1]["restart_count"] == 0
    assert killed[1]["restart_count"] == 1, killed[1]
    rec = killed[1]["restarts"][0]
    assert rec["worker_pid"] == killed[1]["kill"]["pid"] and rec["signal"] == "SIGKILL" and rec["epoch"] == 0
    assert killed[1]["loader_class"] == "RestartableDataLoader"
    for rank in (0, 1):
        for name, tensor in w_clean[rank].items():
            assert torch.equal(tensor, w_killed[rank][name]), f"rank {rank}: {name} differs after the kill"
            assert torch.equal(tensor, w_clean[0][name])
    return killed


@pytest.mark.long  # suite time: a worker kill in a real Engine runs in test_inject.py (survived in place) and test_dataloader.py (nothing lost or repeated)
@pytest.mark.timeout(200)
def test_ignite_two_ranks_same_weights_after_worker_kill(tmp_path):
    killed = check("ignite", tmp_path)
    assert killed[1]["engine_state_restarts"] == 1 and killed[0]["engine_state_restarts"] == 0
    # ranks whose default start method is spawn restart their workers with fork
    assert killed[1]["first_start_method"] == "spawn"
    rec = killed[1]["restarts"][0]
    assert rec["start_method"] == "fork" and rec["restart_seconds"] < 1.0, rec


@pytest.mark.long  # a worker kill in a real Trainer also runs in tests/unit/adapters/test_lightning_local.py
@pytest.mark.timeout(200)
def test_lightning_two_ranks_same_weights_after_worker_kill(tmp_path):
    killed = check("lightning", tmp_path)
    assert killed[1]["logged_restarts"] == 1.0 and killed[0]["logged_restarts"] == 0.0
