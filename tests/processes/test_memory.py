"""The memory tier (checkpoint.memory_every): states in host memory that a restart resumes from, with real
processes, real SIGKILLs and real files in /dev/shm (or a folder of the test's: checkpoint.memory_dir)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess

import pytest

from tests.conftest import PY, RNG_DRAWS, ROOT, TINY, assert_same_training, clean_env, metrics, pacing, run_train
from tests.procs import descendants, environ, kill_family, wait_for
from train.checkpoint.storage import memory_folder, memory_records

# 14 steps of 16 over 128 samples (8 a epoch); no disk checkpoint but the last unless a test asks for one
STEPS = ["train.steps=14", "task.train_samples=128"]


def torchrun(run_dir, *overrides, restarts=0):
    """2 ranks under plain torchrun, RNG_DRAWS' model (a resume that loses a rank's generators changes the
    weights), paced: a test acts on it mid-run."""
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", f"--max-restarts={restarts}",
           "--monitor-interval=0.1", *RNG_DRAWS, "--config", "configs/default.yaml", *TINY, *pacing(overrides),
           f"run.dir={run_dir}", *STEPS, *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def logged(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return max((m["step"] for m in metrics(run_dir) if "loss" in m), default=0) if path.exists() else 0


def log_of(run_dir) -> str:
    return (run_dir / "logs" / "rank0.log").read_text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the DDP tests' runs must end as: no copy in host memory, a disk checkpoint every 4 steps (saves
    change nothing trained)."""
    ref = tmp_path_factory.mktemp("memory") / "ref"
    run_train(ref, *STEPS, "checkpoint.every=4", nproc=2, entry=RNG_DRAWS)
    return ref


def test_a_killed_worker_resumes_from_host_memory_bitwise_and_loses_at_most_memory_every_steps(tmp_path, uninterrupted):
    """SIGKILL of rank 1 mid-run, no disk checkpoint yet: torchrun's restart resumes from /dev/shm, at most 2 steps
    back, and the run ends bitwise as an uninterrupted one; its memory files were 0600 and are gone at the end."""
    ref, cut = uninterrupted, tmp_path / "cut"
    proc = torchrun(cut, "checkpoint.memory_every=2", "log.wandb.mode=offline", restarts=1)  # the same W&B run goes on
    folder = memory_folder("/dev/shm", cut)
    try:
        wait_for(lambda: logged(cut) >= 7 or proc.poll() is not None, 180, "step 7")
        files = [p for p in folder.iterdir()]
        victim = next(p for p in descendants(proc.pid) if environ(p).get("RANK") == "1"
                      and environ(p).get("TORCHELASTIC_RESTART_COUNT") == "0")
        at = logged(cut)


        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_family(proc.pid)
    assert proc.returncode == 0, out[-3000:]
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o1777 and files, files  # /dev/shm itself
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files if p.exists()), files
    log = log_of(cut)
    assert "resume=auto: a memory state newer than the disk's" in log, log
    resumed = int(log.split("resumed from host memory step_")[1][:8])
    assert at - 2 <= resumed <= at + 1, (at, resumed)  # a step at most was logged between `at` and the kill
    assert not (cut / "checkpoints" / f"step_{resumed:08d}").exists()
    assert_same_training(ref, cut)  # weights, optimizer state and every logged loss, bit for bit
    assert not folder.exists()  # the run ended: its host memory is let go


def kill_at(run_dir, step: int, *overrides):
    """A run killed whole (every process, SIGKILL) once it logged `step`: what a node's crash leaves."""
    proc = torchrun(run_dir, *overrides)
    try:
        wait_for(lambda: logged(run_dir) >= step or proc.poll() is not None, 180, f"step {step}")
    finally:
        kill_family(proc.pid)
        proc.communicate(timeout=60)


def test_an_incomplete_memory_state_is_passed_over_for_the_disk(tmp_path, uninterrupted):
    """FSDP: each rank writes a share of its own. One share of the newest state gone (a copy cut short): that
    state is removed, and the disk's checkpoint, newer than the older complete state, loads. The run ends bitwise
    as the uninterrupted DDP one (2 ranks, no clipping: FSDP's reduce-scatter adds what DDP's all-reduce does,
    tests/processes/test_fsdp.py)."""
    ref, cut, shm = uninterrupted, tmp_path / "cut", tmp_path / "shm"
    fsdp = ["dist.strategy=fsdp", "checkpoint.every=4", f"checkpoint.memory_dir={shm}"]
    kill_at(cut, 7, *fsdp, "checkpoint.memory_every=2")
    folder = memory_folder(shm, cut)
    held = memory_records(folder)
    newest = held[0][0]
    assert newest >= 6 and {share for step, share, *_ in held if step == newest} == {0, 1}, held
    next(path for step, share, _, path in held if step == newest and share == 1).unlink()
    # a killed run's folder whose run directory is gone, and one of a live run: the start removes the first only
    gone, live = memory_folder(shm, tmp_path / "deleted"), memory_folder(shm, tmp_path / "live")
    for other, run_dir in ((gone, tmp_path / "deleted"), (live, tmp_path / "live")):
        shutil.copytree(folder, other)
        (other / "owner.json").write_text(json.dumps({"run_dir": str(run_dir), "memory_id": "abc"}))
    (tmp_path / "live" / "checkpoints").mkdir(parents=True)
    (tmp_path / "live" / "checkpoints" / "memory_id").write_text("abc\n")
    run_train(cut, *STEPS, *fsdp, nproc=2, entry=RNG_DRAWS)
    assert not gone.exists() and live.exists()
    log = log_of(cut)
    assert "resume=auto: an incomplete memory state" in log, log
    disk = max(int(p.name[5:]) for p in (cut / "checkpoints").glob("step_*") if int(p.name[5:]) < 14)
    assert f"resumed from {cut / 'checkpoints'}" in log, log
    assert_same_training(ref, cut)
    assert not folder.exists() and disk >= 4


def test_a_rollback_ignores_and_removes_newer_states_in_host_memory(tmp_path, uninterrupted):
    """resume=PATH to an older checkpoint of the run: newer states in host memory are neither loaded nor kept
    (a later crash must not bring back the abandoned steps)."""
    ref, cut, shm = uninterrupted, tmp_path / "cut", tmp_path / "shm"
    disk = ["checkpoint.every=4", f"checkpoint.memory_dir={shm}"]
    kill_at(cut, 11, *disk, "checkpoint.memory_every=2")
    folder = memory_folder(shm, cut)
    assert memory_records(folder)[0][0] >= 10
    back = cut / "checkpoints" / "step_00000004"
    proc = torchrun(cut, *disk, "checkpoint.memory_every=2", f"resume={back}",
                    "task.step_gate=" + str(tmp_path / "gate"))
    try:  # held at its first step: what the start left in host memory
        wait_for(lambda: (tmp_path / "gate.0").exists() or proc.poll() is not None, 120, "the first step")
        left = memory_records(folder)
        (tmp_path / "gate").touch()
        out, _ = proc.communicate(timeout=240)
    finally:
        kill_family(proc.pid)
    assert proc.returncode == 0, out[-3000:]
    assert left == [] or all(step <= 4 for step, *_ in left), left
    log = log_of(cut)
    assert "PATH inside the run directory, newer states in host memory" in log, log
    assert f"resumed from {back} at step 4" in log, log
    assert_same_training(ref, cut)
    assert not folder.exists()
