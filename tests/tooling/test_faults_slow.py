"""Faults a long run meets, survived by examples/train.py under torchrun on CPU/gloo (README,
"Multi-node and faults"): workers SIGKILLed mid-run and mid-checkpoint under
``--max-restarts``, and a launch on two (simulated) nodes resumed on one.

Every run is the tiny HSDP model of train_launch.py (``--replicate 2``: two replicas of one
shard each, so on two nodes the replicas sit on different nodes), with fp32 Newton–Schulz
and communication. The same ranks replay the same arithmetic, so each faulted
run must end bit for bit where the uninterrupted two-node run ends. The kills come from the
test, watching the run's metrics and checkpoint folders, never from a flag of the script.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

import pytest
import torch
from repo_paths import ROOT
from torch.distributed import TCPStore
from train_launch import LAUNCH_TIMEOUT_S, SCRIPT, TINY, launch, launch_env, losses

HSDP = [*TINY, "--replicate", "2"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RESUMED = re.compile(r"\[muon\] resumed \S*(step_\d+) ")


def _finish(job: subprocess.Popen[bytes], log: Path) -> str:
    """Wait for ``job``; its output, after checking it exited 0."""
    try:
        job.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert job.returncode == 0, f"{job.args!r} exited {job.returncode}:\n{text[-8000:]}"
    return text


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run on two torchrun agents (``--nnodes 2``, one rank each, c10d
    rendezvous on localhost), checkpointed at step 6."""
    tmp = tmp_path_factory.mktemp("faults")
    # The rendezvous store lives here, on a port the kernel picks and the store holds, and
    # both agents are its clients (is_host=false): a port found free and closed again could
    # be taken by another test's connections before an agent listened on it (EADDRINUSE).
    store = TCPStore("localhost", 0, 2, True, wait_for_workers=False)
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{store.port}"]
    rendezvous += ["--rdzv-conf", "is_host=false", "--rdzv-id", "two"]
    cmd = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", *rendezvous]
    cmd += [str(SCRIPT), *HSDP, "--out", str(tmp / "two_nodes"), "--ckpt-dir", str(tmp / "ckpt")]
    cmd += ["--ckpt-every", "6", "--save-final", str(tmp / "two_nodes.pt")]
    logs = [tmp / f"node{n}.log" for n in range(2)]
    jobs = []
    for log in logs:
        with log.open("wb") as out:
            jobs.append(subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=out, stderr=out))
    output = "".join(_finish(job, log) for job, log in zip(jobs, logs, strict=True))
    del store  # both agents have exited
    assert "world 2 on cpu (gloo), mesh {'replicate': 2, 'shard': 1}" in output
    return tmp


def test_two_nodes_train_checkpoint_and_resume_on_one_node(two_nodes: Path) -> None:
    """The two-node run's step-6 checkpoint, resumed by one agent with 2 ranks, ends bit
    for bit as the two-node run did."""
    ckpt = ["--ckpt-dir", str(two_nodes / "ckpt"), "--resume"]
    final = ["--save-final", str(two_nodes / "one_node.pt")]
    out = launch(2, [*HSDP, "--out", str(two_nodes / "one_node"), *ckpt, *final])
    assert RESUMED.findall(out) == ["step_000006"]
    full = losses(two_nodes / "two_nodes")
    assert sorted(full) == list(range(1, 11))
    assert losses(two_nodes / "one_node") == {s: v for s, v in full.items() if s > 6}
    ref, got = _weights(two_nodes / "two_nodes.pt"), _weights(two_nodes / "one_node.pt")
    assert ref.keys() == got.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def _workers(
    agent: int, job: subprocess.Popen[bytes], excluding: Collection[int] = ()
) -> dict[int, int]:
    """The agent's two train.py workers, by local rank (once both are up), leaving out the
    processes ``excluding`` names (an earlier attempt's, still being torn down)."""
    workers: dict[int, int] = {}

    def found() -> bool:
        listed = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True)
        workers.clear()
        for pid in map(int, listed.stdout.split()):
            if pid in excluding:
                continue
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # a worker of the last attempt, gone meanwhile
                continue
            if SCRIPT.name.encode() not in command:
                continue
            for entry in environ:
                if entry.startswith(b"LOCAL_RANK="):
                    workers[int(entry.split(b"=")[1])] = pid
        return len(workers) == 2

    _wait_for(found, job, "two workers")
    return workers


def _wait_for(done: Callable[[], bool], job: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not done():
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def killed_twice(two_nodes: Path) -> tuple[Path, str]:
    """A one-node run under ``torchrun --max-restarts 2 ... --ckpt-every 4 --resume``: a
    worker SIGKILLed once step 5 is logged, and, in the next attempt, the rank that
    completes checkpoints (rank 0) SIGKILLed while step 8's checkpoint is being written."""
    tmp = two_nodes / "killed"
    ckpt = tmp / "ckpt"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    cmd += [str(SCRIPT), *HSDP, "--out", str(tmp), "--ckpt-dir", str(ckpt), "--ckpt-every", "4"]
    cmd += ["--resume", "--save-final", str(tmp / "final.pt")]
    tmp.mkdir()
    log = tmp / "torchrun.log"
    with log.open("wb") as out:
        job = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=out, stderr=out)
    try:
        metrics = tmp / "metrics.jsonl"
        _wait_for(lambda: metrics.is_file() and '"step": 5,' in metrics.read_text(), job, "step 5")
        first = _workers(job.pid, job)
        os.kill(first[1], signal.SIGKILL)
        # The restarted attempt's workers, found before its step-8 save begins: once the
        # save is seen they are stopped at once (a lookup then could let it complete).
        workers = _workers(job.pid, job, excluding=set(first.values()))
        partial = ckpt / "step_000008.partial"
        _wait_for(partial.exists, job, "step 8's checkpoint to start")
        for pid in workers.values():
            os.kill(pid, signal.SIGSTOP)
        assert not (ckpt / "step_000008").exists(), "the save completed before the kill"
        os.kill(workers[0], signal.SIGKILL)
        os.kill(workers[1], signal.SIGCONT)
    except BaseException:
        job.kill()
        raise
    return tmp, _finish(job, log)


def test_a_killed_worker_restarts_and_ends_as_the_uninterrupted_run(
    two_nodes: Path, killed_twice: tuple[Path, str]
) -> None:
    run, _ = killed_twice
    assert losses(run) == losses(two_nodes / "two_nodes")
    ref, got = _weights(two_nodes / "two_nodes.pt"), _weights(run / "final.pt")
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_checkpoint_cut_off_mid_save_is_never_loaded(killed_twice: tuple[Path, str]) -> None:
    """Both restarts resume from step 4: the first because step 8 was not reached, the
    second because step 8's save was cut off; the rerun then saves step 8 whole."""
    run, output = killed_twice
    assert RESUMED.findall(output) == ["step_000004", "step_000004"]
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step_000004", "step_000008"]
