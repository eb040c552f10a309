"""SLURM: slurm/train.sbatch and python -m train.submit (submitit) against real SLURM daemons.

A session fixture brings up a 2-node cluster on this machine with slurm/local-cluster.sh (munge,
slurmctld, `slurmd -N n1`, `slurmd -N n2`, all on 127.0.0.1) unless one already answers, and stops what
it started at the end. Without the SLURM packages the cluster tests skip, except under CI (CI=true),
where they fail: .ci/run installs the packages."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, ROOT, TINY, clean_env, latest_state, metrics, run_train, summary

SBATCH = ROOT / "slurm" / "train.sbatch"
CLUSTER = ROOT / "slurm" / "local-cluster.sh"
NEEDED = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd", "munged")
INSTALL = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# 16 steps (one epoch): a few seconds per run; the same for every run compared.
OVR = [*TINY, "train.steps=16", "dist.timeout_s=60"]


def _nodes_idle() -> int:
    try:
        out = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.split()[-1:] in (["idle"], ["mix"], ["alloc"]))


@pytest.fixture(scope="session")
def slurm_cluster():
    """A SLURM cluster with at least two nodes: one that answers, or one started here (and stopped)."""
    in_ci = os.environ.get("CI", "").lower() == "true"
    missing = [b for b in NEEDED if shutil.which(b) is None]
    if missing:
        reason = f"SLURM is not installed ({', '.join(missing)} missing): {INSTALL}"
        if in_ci:
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    if _nodes_idle() >= 2:
        yield
        return
    if os.geteuid() != 0:
        reason = "no SLURM cluster answers, and starting one on this machine needs root (make slurm-local-up)"
        if in_ci:
            pytest.fail(reason)
        pytest.skip(reason)
    t0 = time.time()
    up = subprocess.run(["bash", str(CLUSTER), "up"], capture_output=True, text=True, timeout=180,
                        env=clean_env(NODES="2"))
    assert up.returncode == 0, f"slurm/local-cluster.sh up failed:\n{up.stdout}\n{up.stderr}"
    print(f"\nlocal SLURM cluster up in {time.time() - t0:.1f} s", file=sys.stderr)
    try:
        yield
    finally:
        subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- helpers

def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_job(job_id: str, timeout: float = 300) -> dict[str, str]:
    """Poll until the job ends. A requeued job starts again after the cluster's cred_expire (10 s with
    slurm/local-cluster.sh); `scontrol update StartTime=now` before that gets it killed ("Job
    credential revoked"), so the tests wait."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job_info(job_id)
        if info.get("JobState", "") in TERMINAL:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], capture_output=True)
    raise AssertionError(f"job {job_id} did not end in {timeout} s: {job_info(job_id)}")


def wait_steps(run_dir: Path, n: int, job_id: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if sum("loss" in m for m in metrics(run_dir)) >= n:
                return
        except (OSError, ValueError):
            pass
        if job_info(job_id).get("JobState") in TERMINAL:
            raise AssertionError(f"job {job_id} ended before step {n}: {job_info(job_id)}")
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach step {n} in {timeout} s")


def job_env(**extra: str) -> dict[str, str]:
    """What the tests submit with (sbatch passes it to the job): this checkout's interpreter, one CPU
    process per node."""
    return clean_env(PYTHON=PY, NPROC_PER_NODE="1", **extra)


def sbatch(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[str, Path]:
    out = tmp_path / "slurm-%j.out"
    proc = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={out}",
                           str(SBATCH), *args], cwd=ROOT, env=env or job_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    return job_id, tmp_path / f"slurm-{job_id}.out"


def same_weights(a: Path, b: Path) -> None:
    wa, wb = latest_state(a)["model"], latest_state(b)["model"]
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} tensors differ, first {different[0]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same run with local torchrun: 2 processes on this machine, uninterrupted."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run_train(run_dir, *OVR, nproc=2)
    return run_dir


@pytest.fixture
def cleanup_jobs():
    jobs: list[str] = []
    yield jobs
    for j in jobs:
        subprocess.run(["scancel", j], capture_output=True)


# ---------------------------------------------------------------- no cluster needed

def test_sbatch_outside_an_allocation_is_a_clear_error():
    proc = subprocess.run(["bash", str(SBATCH)], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not inside a SLURM allocation" in lines[0] and "sbatch" in lines[0], proc.stderr


def test_submit_requires_nodes_and_a_config():
    proc = subprocess.run([PY, "-m", "train.submit", "--", "--config", "configs/default.yaml"], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("the following arguments are required: --nodes")
    proc = subprocess.run([PY, "-m", "train.submit", "--nodes", "2", "--", "--config", "configs/missing.yaml"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config file not found: configs/missing.yaml", proc.stderr


def test_submit_rendezvous_from_the_allocation(monkeypatch):
    pytest.importorskip("submitit")
    from train.submit import TrainJob, parse_time

    job = TrainJob(["--config", "configs/default.yaml"], "1", str(ROOT), PY)
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
           "SLURM_RESTART_COUNT": "2"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = job.launch_env(env)
    assert out["RDZV_ENDPOINT"] == "gpu07:32342" and out["RDZV_ID"] == "1234" and out["NNODES"] == "2"
    assert out["RDZV_CONF"] == "is_host=0" and out["NPROC_PER_NODE"] == "1"
    assert [parse_time(t) for t in ("90", "01:30:00", "1-00:00:00", "30:30")] == [90, 90, 1440, 31]
    clone = TrainJob.__new__(TrainJob)
    clone.__setstate__(job.__getstate__())
    assert clone.train_args == job.train_args and clone._proc is None


# ---------------------------------------------------------------- against the cluster

def test_sbatch_container_wiring(slurm_cluster, tmp_path):
    """pyxis and Apptainer command lines (no container runtime here: DRY_RUN prints the srun command).
    pyxis checks every --container-mounts source on every node before the task starts (NVIDIA/pyxis,
    validate_mount_sources): each must be on the shared file system, none in the batch host's TMPDIR.
    Apptainer binds the node's /tmp: the caches the image keeps there get a folder per job."""
    own_tmp = tmp_path / "batch-host-tmp"  # TMPDIR of the batch host: nothing of the job's may go there
    own_tmp.mkdir()
    runs = tmp_path / "shared-runs"
    base = clean_env(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_NUM_NODES="2", DRY_RUN="1",
                     SLURM_SUBMIT_DIR=str(ROOT), CONTAINER_IMAGE="registry/ddp-template:0.1.0",
                     CONTAINER_RUNS=str(runs), TMPDIR=str(own_tmp))
    pyxis = subprocess.run(["bash", str(SBATCH), "train.steps=5"], env=base | {"CONTAINER_RUNTIME": "pyxis"},
                           capture_output=True, text=True, timeout=60)
    assert pyxis.returncode == 0, pyxis.stderr
    assert "--container-image=registry/ddp-template:0.1.0" in pyxis.stdout
    assert "--container-workdir=/app" in pyxis.stdout
    assert "python -m train.launch -- --config configs/default.yaml train.steps=5" in pyxis.stdout
    argv = shlex.split(pyxis.stdout)  # the srun command, as printf %q quoted it
    mounts = next(a for a in argv if a.startswith("--container-mounts="))[len("--container-mounts="):].split(",")
    assert f"{runs}:/runs" in mounts
    for source in (m.split(":")[0] for m in mounts):
        assert Path(source).is_dir() and Path(source).is_relative_to(runs), f"{source}: not on the shared runs folder"
    assert not any(own_tmp.iterdir()), "the batch host's TMPDIR holds a folder the other nodes lack"
    # The state folder (node 0's exit code) is mounted at the same path, where the task writes it.
    assert any(m.split(":")[0] == m.split(":")[1] and "77.0" in m for m in mounts), mounts

    def apptainer(job_id: str) -> str:
        proc = subprocess.run(["bash", str(SBATCH), "train.steps=5"],
                              env=base | {"CONTAINER_RUNTIME": "apptainer", "SLURM_JOB_ID": job_id},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "--kill-on-bad-exit=1" in proc.stdout and f"id {job_id}," in proc.stderr
        assert f"--bind {runs}:/runs --pwd /app" in proc.stdout
        assert "registry/ddp-template:0.1.0 --config configs/default.yaml train.steps=5" in proc.stdout
        return proc.stdout

    caches = {}
    for job_id in ("77", "78"):
        out = apptainer(job_id)
        argv = shlex.split(out)
        env = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--env")
        assert {"XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} <= env.keys(), out
        folders = {str(Path(v).parent) for v in env.values()}
        assert len(folders) == 1 and f".{job_id}." in folders.copy().pop(), env  # one folder per job
        caches[job_id] = folders.pop()
        assert not any(v.startswith(("/tmp/.cache", "/tmp/triton", "/tmp/torchinductor")) for v in env.values())
    assert caches["77"] != caches["78"]
    assert not any(own_tmp.iterdir())


def test_sbatch_two_nodes_match_local_torchrun(slurm_cluster, reference, tmp_path, cleanup_jobs):
    run_dir = tmp_path / "run"
    job_id, out = sbatch(tmp_path, *OVR, f"run.dir={run_dir}")
    cleanup_jobs.append(job_id)
    info = wait_job(job_id)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-5000:]
    assert info["Restarts"] == "0" and "train.sbatch: done" in log
    assert "--rdzv-endpoint=n1:" in log and f"--rdzv-id={job_id}" in log
    assert summary(run_dir)["world_size"] == 2 and summary(run_dir)["steps"] == 16
    same_weights(run_dir, reference)


def test_sbatch_warning_signal_checkpoints_requeues_and_resumes(slurm_cluster, reference, tmp_path, cleanup_jobs):
    run_dir = tmp_path / "run"
    job_id, out = sbatch(tmp_path, *OVR, f"run.dir={run_dir}")
    cleanup_jobs.append(job_id)
    wait_steps(run_dir, 3, job_id)
    # What --signal=B:USR1@SECONDS does before the time limit: USR1 to the batch shell only.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    info = wait_job(job_id)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-5000:]
    assert info["Restarts"] == "1", info
    assert "SLURM_RESTART_COUNT=0" in log and "SLURM_RESTART_COUNT=1" in log
    assert "got SIGUSR1" in log and f"requeueing job {job_id}" in log
    stopped = re.search(r"stopped on SIGTERM at step (\d+), checkpoint saved", log)
    assert stopped, log[-5000:]
    step = int(stopped.group(1))
    assert 3 <= step < 16
    assert re.search(rf"resumed from \S+step_{step:08d}\.pt at step {step}\b", log), log[-5000:]
    assert summary(run_dir)["steps"] == 16
    same_weights(run_dir, reference)


def test_sbatch_bad_config_is_one_line_and_not_requeued(slurm_cluster, tmp_path, cleanup_jobs):
    job_id, out = sbatch(tmp_path, env=job_env(CONFIG="configs/missing.yaml"))
    cleanup_jobs.append(job_id)
    info = wait_job(job_id, timeout=120)
    log = out.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0" and info["Restarts"] == "0", log
    assert "error: config file not found: configs/missing.yaml" in log
    assert "not requeueing" in log and "srun" not in log


def test_submitit_submits_completes_and_requeues(slurm_cluster, reference, tmp_path, cleanup_jobs):
    pytest.importorskip("submitit")
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "train.submit", "--nodes", "2", "--nproc-per-node", "1", "--time", "10", "--wait", "--",
           *OVR, f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        first = proc.stdout.readline()
        m = re.match(r"submitted job (\d+): 2 node\(s\)", first)
        assert m, first + proc.stderr.read()
        job_id = m.group(1)
        cleanup_jobs.append(job_id)
        logs = proc.stdout.readline()
        assert logs.startswith(f"logs: {run_dir / 'submitit' / job_id}_0_log.out"), logs
        submission = (run_dir / "submitit" / f"{job_id}_submission.sh").read_text()
        assert "#SBATCH --signal=TERM@" in submission and "#SBATCH --nodes=2" in submission
        wait_steps(run_dir, 3, job_id)
        # What SLURM does on submitit's timeout signal (and submitit's own Job._interrupt()): SIGTERM to
        # every process of the job step.
        subprocess.run(["scancel", "--signal=TERM", job_id], check=True, timeout=30)
        info = wait_job(job_id)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    # submitit's logs: <job>_<task>_log.out/.err, one pair per node (training's rank 0 may be on either).
    task0 = "".join((run_dir / "submitit" / f"{job_id}_0_log.{k}").read_text() for k in ("out", "err"))
    every = "".join(p.read_text() for p in sorted((run_dir / "submitit").glob(f"{job_id}_*_log.*")))
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, task0[-5000:])
    assert proc.returncode == 0 and "summary.json written" in rest, (rest, err)
    assert "Calling checkpoint method" in task0 and f"Requeued job {job_id}" in task0, task0[-5000:]
    assert "SLURM_RESTART_COUNT=1" in task0
    stopped = re.search(r"stopped on SIGTERM at step (\d+), checkpoint saved", every)
    assert stopped, every[-5000:]
    assert f"resumed from {run_dir}/checkpoints/step_{int(stopped.group(1)):08d}.pt" in every
    assert summary(run_dir)["steps"] == 16 and summary(run_dir)["world_size"] == 2
    same_weights(run_dir, reference)
