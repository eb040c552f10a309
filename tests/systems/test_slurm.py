"""SLURM: slurm/train.sbatch and python -m train.submit (submitit) against real SLURM daemons on real hosts.

A session fixture brings up a cluster of three hosts (tests/hosts.py: network namespaces, each with its own
hostname, address and /etc/hosts, the file system shared): `slurm` runs slurmctld and is the login node
the tests submit from, `n1` and `n2` run one slurmd each. Its config, munged and state are its own, so an
installed cluster is neither used nor disturbed; everything is removed at the end. Without the SLURM
packages or root the cluster tests skip saying why, except under CI (CI=true), where they fail: .ci/run
installs the packages and runs as root."""
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

from tests.conftest import PACED, PY, ROOT, TINY, clean_env, latest_state, metrics, summary
from tests.hosts import Hosts
from tests.hosts import _usable as hosts_unusable
from tests.multinode import required
from tests.quick.test_slurm import SBATCH

NEEDED = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd", "munged")


INSTALL = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


# The CPU-node form of slurm/train.sbatch and train.submit (both ask for 8 GPUs by default): this cluster has none.
CPU_NODES = ["--gpus-per-node=0", "--cpus-per-task=1"]


# 16 steps (one epoch): a few seconds per run; the same for every run compared.
OVR = [*TINY, *PACED, "train.steps=16", "dist.timeout_s=60"]  # paced: the tests signal jobs mid-run


# A requeued job waits this long before it may start again (SLURM's cred_expire: 120 s by default; below 5 it
# is refused: ../shared/notes/slurm-on-one-host.md).
CRED_EXPIRE = 5


CONF = """ClusterName=ddphosts
SlurmctldHost={ctl.name}({ctl.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={state}/munge.socket,cred_expire={cred_expire}
StateSaveLocation={state}/ctld
SlurmctldPidFile={state}/slurmctld.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdPidFile={state}/slurmd.%n.pid
SlurmdSpoolDir={state}/spool/%n
SlurmdLogFile={state}/log/slurmd.%n.log
{common}
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmHosts:
    """A SLURM cluster of real hosts (tests/hosts.py): host `slurm` runs slurmctld and is the login node
    the tests submit from; hosts n1 and n2 each run one slurmd under their own hostname and address, so a
    job's nodes are separate hosts (`scontrol show hostnames`, the rendezvous endpoint and MASTER_ADDR
    name another host). The file system is shared as on a cluster. Everything is its own: a munged on
    its own socket and key, a config in `state` (SLURM_CONF), default ports inside the namespaces, so
    nothing on this machine (an /etc/slurm cluster, the system's munged) is touched or in the way."""

    NODES = ("n1", "n2")

    def __init__(self, state: Path):
        self.state = state
        self.conf = state / "slurm.conf"
        self.hosts: Hosts | None = None

    @property
    def ctl(self):
        return self.hosts[0]

    def env(self, env: dict | None = None) -> dict:
        return (env if env is not None else clean_env()) | {"SLURM_CONF": str(self.conf)}

    def argv(self, argv: list[str]) -> list[str]:
        """argv run on the login node."""
        return self.ctl.argv(argv)

    def run(self, argv: list[str], env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.ctl.run(argv, env=self.env(env), timeout=timeout)

    def up(self) -> None:
        try:
            self.hosts = Hosts(("slurm", *self.NODES))
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:  # e.g. root without CAP_NET_ADMIN
            required("SLURM on real hosts (network namespaces)", str(e))
        st = self.state
        for d in ("ctld", "log", *(f"spool/{n}" for n in self.NODES)):
            (st / d).mkdir(parents=True, exist_ok=True)
        # a node feature, as GPU clusters have (a GPU model), for train.submit's --sbatch constraint=...
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs=2 Features=ddp State=UNKNOWN"
                          for h in self.hosts[1:])
        common = "".join(line for line in (ROOT / "slurm" / "cluster.conf").read_text().splitlines(keepends=True)
                         if not line.startswith("#"))
        self.conf.write_text(CONF.format(ctl=self.ctl, state=st, nodes=nodes, common=common.rstrip("\n"),
                                         cred_expire=CRED_EXPIRE))
        # munge: a key of its own (owned by root, who runs everything here), its socket on the shared
        # file system, reached from every host as munge's socket is on a cluster node.
        key = st / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        log = st / "log"
        self._daemon(self.ctl, ["munged", "-F", "--force", f"--socket={st}/munge.socket", f"--key-file={key}",
                                f"--pid-file={st}/munged.pid", f"--seed-file={st}/munged.seed",
                                f"--log-file={log}/munged.log"])
        self._daemon(self.ctl, ["slurmctld", "-D", "-c"])  # -c: fresh state
        for h in self.hosts[1:]:  # slurmd finds its NodeName from its hostname, as on a cluster
            self._daemon(h, ["slurmd", "-D"])
        deadline = time.time() + 120
        while time.time() < deadline:
            out = self.run(["sinfo", "-N", "-h", "-o", "%N %t"], timeout=30).stdout.split()
            if out[1::2] == ["idle"] * len(self.NODES):
                return
            time.sleep(0.5)
        logs = "".join(f"{p.name}: {p.read_text()[-1500:]}" for p in sorted(log.glob("*")))
        raise AssertionError(f"the SLURM nodes did not become idle in 120 s: {out}\n{logs}")

    def _daemon(self, host, argv: list[str]) -> None:
        """A daemon in the foreground on host, seeing this machine's cgroups (slurmd needs them); the host's
        removal kills it."""
        with (self.state / "log" / f"{argv[0]}.{host.name}.out").open("w") as out:
            host.procs.append(subprocess.Popen(host.argv_with_sys(argv), env=self.env(), stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True))

    def down(self) -> None:
        """Every daemon and job process dies with its host (tests/hosts.py removes them)."""
        if self.hosts is not None:
            self.hosts.remove()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The cluster of SlurmHosts, started here and removed at the end, whatever happens."""
    missing = [b for b in NEEDED if shutil.which(b) is None]
    if missing:
        required("SLURM", f"not installed ({', '.join(missing)} missing): {INSTALL}")
    if why := hosts_unusable():
        required("SLURM on real hosts (network namespaces)", why)
    cluster = SlurmHosts(tmp_path_factory.mktemp("slurm"))
    t0 = time.time()
    try:
        cluster.up()
        print(f"\nSLURM cluster on real hosts up in {time.time() - t0:.1f} s", file=sys.stderr)
        yield cluster
    finally:
        cluster.down()


def job_info(cluster: SlurmHosts, job_id: str) -> dict[str, str]:
    out = cluster.run(["scontrol", "show", "job", "-o", job_id], timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_job(cluster: SlurmHosts, job_id: str, timeout: float = 300) -> dict[str, str]:
    """Poll until the job ends. A requeued job starts again after the cluster's CRED_EXPIRE (10 s with
    slurm/local-cluster.sh); `scontrol update StartTime=now` before that gets it killed ("Job
    credential revoked"), so the tests wait."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job_info(cluster, job_id)
        if info.get("JobState", "") in TERMINAL:
            return info
        time.sleep(0.5)
    cluster.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not end in {timeout} s: {job_info(cluster, job_id)}")


def wait_steps(cluster: SlurmHosts, run_dir: Path, n: int, job_id: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if sum("loss" in m for m in metrics(run_dir)) >= n:
                return
        except (OSError, ValueError):
            pass
        if (info := job_info(cluster, job_id)).get("JobState") in TERMINAL:
            raise AssertionError(f"job {job_id} ended before step {n}: {info}")
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not reach step {n} in {timeout} s")


def job_env(**extra: str) -> dict[str, str]:
    """What the tests submit with (sbatch passes it to the job): this checkout's interpreter, one CPU
    process per node."""
    return clean_env(PYTHON=PY, NPROC_PER_NODE="1", **extra)


def sbatch(cluster: SlurmHosts, tmp_path: Path, *args: str, env: dict | None = None) -> tuple[str, Path]:
    """slurm/train.sbatch submitted from the login node, from this checkout, in its CPU-node form."""
    out = tmp_path / "slurm-%j.out"
    proc = cluster.run(["sbatch", "--parsable", "--nodes=2", *CPU_NODES, f"--output={out}",
                        str(SBATCH), *args], env=env or job_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    return job_id, tmp_path / f"slurm-{job_id}.out"


def same_weights(a: Path, b: Path) -> None:
    wa, wb = latest_state(a)["model"], latest_state(b)["model"]
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"{len(different)} tensors differ, first {different[0]}"


@pytest.fixture(scope="module")
def reference(finished_16_steps) -> Path:
    """The same run with local torchrun: 2 processes on this machine, uninterrupted (conftest.py)."""
    return finished_16_steps


@pytest.fixture
def cleanup_jobs(slurm_cluster):
    jobs: list[str] = []
    yield jobs
    for j in jobs:
        slurm_cluster.run(["scancel", j])


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


REFUSAL = "sbatch: error: Batch job submission failed: Invalid partition name specified"


@pytest.mark.parametrize("where", ["a new run dir", "a run dir with files", "--folder with %j"])
def test_a_refused_submission_leaves_none_of_its_files_and_all_that_was_there(tmp_path, where):
    """sbatch's refusal (here a stand-in sbatch that refuses every script, after checking it was written: no SLURM
    needed) is one line, exit 1, and what train.submit wrote for it (submitit's job pickle and sbatch script, the
    folders made for them) is removed; what was there before stays, byte for byte."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\ntest -f "$1" && echo "$1" >> {tmp_path / "scripts"}\necho "{REFUSAL}" >&2\nexit 1\n')
    fake.chmod(0o755)
    srun = fake.parent / "srun"  # submitit looks for it before it submits anything: never run here
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    run_dir, folder = tmp_path / "runs" / "run", []
    if where == "a run dir with files":
        for name, text in [("notes.txt", "mine"), ("submitit/7_submitted.pkl", "an earlier job's"),
                           ("submitit/0123456789abcdef0123456789abcdef.pkl", "another submission's")]:
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / name).write_text(text)
    elif where == "--folder with %j":
        folder = ["--folder", str(tmp_path / "logs" / "%j")]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.parent != fake.parent}
    proc = subprocess.run([PY, "-m", "train.submit", "--nodes", "1", *CPU_NODES, *folder, "--", "--config",
                           "configs/default.yaml", f"run.dir={run_dir}"], cwd=ROOT,
                          env=clean_env(PATH=f"{fake.parent}:{os.environ['PATH']}"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"error: submission failed: {REFUSAL}", proc.stderr
    (script,) = (tmp_path / "scripts").read_text().split()  # sbatch was given the script train.submit wrote
    assert Path(script).parent == (tmp_path / "logs" if folder else run_dir / "submitit")
    (tmp_path / "scripts").unlink()
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.parent != fake.parent}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == (["bin", "runs"] if before else ["bin"])


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
    base = slurm_cluster.env(base)  # scontrol (show hostnames) reads the test cluster's config
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


def queued(cluster: SlurmHosts) -> set[str]:
    """Every job the cluster knows, finished ones included (for MinJobAge)."""
    return set(cluster.run(["squeue", "-h", "-t", "all", "-o", "%i"], timeout=30).stdout.split())


def test_gpus_are_asked_by_default_and_a_cluster_without_gpus_refuses_them(slurm_cluster, tmp_path):
    """Both submit 8 GPUs a node unless told --gpus-per-node=0; sbatch's refusal is what docs/slurm.md quotes,
    and train.submit's line names the CPU-node form."""
    before = queued(slurm_cluster)
    proc = slurm_cluster.run(["sbatch", f"--output={tmp_path}/%j.out", str(SBATCH)], env=job_env())
    assert proc.returncode == 1 and proc.stderr.strip() == "sbatch: error: Invalid generic resource (gres) " \
        "specification", proc.stderr
    # a world of 2 x 8 that the batch arithmetic allows, before and after micro-batches need not divide it
    cmd = [PY, "-m", "train.submit", "--nodes", "2", "--", *TINY, "train.global_batch_size=256",
           f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(slurm_cluster.argv(cmd), cwd=ROOT, env=slurm_cluster.env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("error: submission failed: sbatch: error: Invalid generic resource (gres) "
                                   "specification (a cluster or partition without GPUs: --gpus-per-node 0 "
                                   "--cpus-per-task N for CPU nodes)"), proc.stderr
    assert queued(slurm_cluster) == before


def test_submit_refuses_a_world_the_batch_does_not_fit_before_queueing(slurm_cluster, tmp_path):
    """--nodes 3 x 8 GPUs: 24 ranks, which configs/default.yaml's global batch of 64 does not divide."""
    before = queued(slurm_cluster)
    cmd = [PY, "-m", "train.submit", "--nodes", "3", "--", "--config", "configs/default.yaml",
           f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(slurm_cluster.argv(cmd), cwd=ROOT, env=slurm_cluster.env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: train.global_batch_size=64 does not split evenly over 24 ranks"), lines
    assert "world size is --nodes 3 x 8 processes per node (one per GPU of --gpus-per-node)" in lines[0], lines
    assert queued(slurm_cluster) == before and not (tmp_path / "run").exists()


def test_submit_passes_sbatch_options_and_one_line_of_sbatch_refusal(slurm_cluster, tmp_path, cleanup_jobs):
    """--sbatch KEY=VALUE reaches the job as sbatch's --KEY=VALUE (KEY alone: a flag): what `scontrol show job`
    lists. The job is held until an hour from now (begin=now+1hour): it never runs, and is cancelled. An option
    sbatch does not know is sbatch's refusal in one line, naming it, and nothing is queued."""
    run_dir = tmp_path / "run"
    base = [PY, "-m", "train.submit", "--nodes", "1", *CPU_NODES]
    opts = ["comment=two words", "account=proj", "mem=1M", "constraint=ddp", "exclusive", "mail-type=END",
            "begin=now+1hour"]
    cmd = [*base, *(a for o in opts for a in ("--sbatch", o)), "--", *TINY, f"run.dir={run_dir}"]
    proc = subprocess.run(slurm_cluster.argv(cmd), cwd=ROOT, env=slurm_cluster.env(), capture_output=True,
                          text=True, timeout=120)
    m = re.match(r"submitted job (\d+): 1 node\(s\)", proc.stdout)
    assert proc.returncode == 0 and m, proc.stdout + proc.stderr
    job_id = m.group(1)
    cleanup_jobs.append(job_id)
    show = slurm_cluster.run(["scontrol", "show", "job", job_id], timeout=30).stdout
    info = job_info(slurm_cluster, job_id)
    assert info["JobState"] == "PENDING" and info["Reason"] == "BeginTime", show
    assert "Comment=two words" in show and info["Account"] == "proj" and info["MinMemoryNode"] == "1M", show
    assert info["Features"] == "ddp" and info["OverSubscribe"] == "NO" and info["MailType"] == "END", show
    # and what train.submit sets itself is still there
    assert info["Requeue"] == "1" and info["TimeLimit"] == "04:00:00" and info["NumNodes"].startswith("1"), show
    assert slurm_cluster.run(["scancel", job_id], timeout=30).returncode == 0

    before = queued(slurm_cluster)
    cmd = [*base, "--sbatch", "acount=proj", "--", *TINY, f"run.dir={tmp_path / 'typo'}"]
    proc = subprocess.run(slurm_cluster.argv(cmd), cwd=ROOT, env=slurm_cluster.env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("error: submission failed: sbatch: unrecognized option '--acount=proj' (an "
                                   "--sbatch KEY is sbatch's long option name: see man sbatch)"), proc.stderr
    assert queued(slurm_cluster) == before and not (tmp_path / "typo").exists()


def test_job_nodes_are_separate_hosts(slurm_cluster, tmp_path, cleanup_jobs):
    """What a job's two tasks see: their own hostname and address, and the other node's name resolving to
    the other host's address (no name of the emulation's 127.0.0.1 left)."""
    out = tmp_path / "hosts-%j.out"
    task = ('echo "task $SLURM_NODEID on $(hostname) at $(hostname -I | tr -d " ") '
            'sees $(getent hosts n1 n2 | tr -s " \\n" " ")"')
    proc = slurm_cluster.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={out}",
                              "--wrap", f"echo nodes $(scontrol show hostnames | tr '\\n' ' '); srun sh -c '{task}'"])
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    cleanup_jobs.append(job_id)
    info = wait_job(slurm_cluster, job_id, timeout=120)
    log = (tmp_path / f"hosts-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    n1, n2 = slurm_cluster.hosts[1:]
    both = f"{n1.addr} n1 {n2.addr} n2"
    assert "nodes n1 n2" in log, log
    assert f"task 0 on n1 at {n1.addr} sees {both}" in log and f"task 1 on n2 at {n2.addr} sees {both}" in log, log


def test_sbatch_two_nodes_match_local_torchrun(slurm_cluster, reference, tmp_path, cleanup_jobs):
    run_dir = tmp_path / "run"
    job_id, out = sbatch(slurm_cluster, tmp_path, *OVR, f"run.dir={run_dir}")
    cleanup_jobs.append(job_id)
    info = wait_job(slurm_cluster, job_id)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-5000:]
    assert info["Restarts"] == "0" and "train.sbatch: done" in log
    assert "--rdzv-endpoint=n1:" in log and f"--rdzv-id={job_id}" in log
    # Each node's launcher gives torchrun its own address (what the others reach it at): two hosts.
    n1, n2 = slurm_cluster.hosts[1:]
    assert f"--local-addr={n1.addr} " in log and f"--local-addr={n2.addr} " in log, log[-5000:]
    assert summary(run_dir)["world_size"] == 2 and summary(run_dir)["steps"] == 16
    same_weights(run_dir, reference)


def test_sbatch_warning_signal_checkpoints_requeues_and_resumes(slurm_cluster, reference, tmp_path, cleanup_jobs):
    run_dir = tmp_path / "run"
    job_id, out = sbatch(slurm_cluster, tmp_path, *OVR, f"run.dir={run_dir}")
    cleanup_jobs.append(job_id)
    wait_steps(slurm_cluster, run_dir, 3, job_id)
    # What --signal=B:USR1@SECONDS does before the time limit: USR1 to the batch shell only.
    assert slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id], timeout=30).returncode == 0
    info = wait_job(slurm_cluster, job_id)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-5000:]
    assert info["Restarts"] == "1", info
    assert "SLURM_RESTART_COUNT=0" in log and "SLURM_RESTART_COUNT=1" in log
    assert "got SIGUSR1" in log and f"requeueing job {job_id}" in log
    stopped = re.search(r"stopped on SIGTERM at step (\d+), checkpoint saved", log)
    assert stopped, log[-5000:]
    step = int(stopped.group(1))
    assert 3 <= step < 16
    assert re.search(rf"resumed from \S+step_{step:08d} at step {step}\b", log), log[-5000:]
    assert summary(run_dir)["steps"] == 16
    same_weights(run_dir, reference)


def test_sbatch_bad_config_or_world_size_is_one_line_and_not_requeued(slurm_cluster, tmp_path, cleanup_jobs):
    """A missing config, and a world of 2 nodes x 3 processes that configs/default.yaml's global batch of 64
    does not divide: each refused in one line before the step starts (no srun, no torchrun)."""
    world = tmp_path / "world"
    world.mkdir()
    jobs = [sbatch(slurm_cluster, tmp_path, env=job_env(CONFIG="configs/missing.yaml")),
            sbatch(slurm_cluster, world, env=job_env() | {"NPROC_PER_NODE": "3"})]
    cleanup_jobs.extend(job_id for job_id, _ in jobs)
    refusals = ("error: config file not found: configs/missing.yaml",
                r"error: train\.global_batch_size=64 does not split evenly over 6 ranks")
    for (job_id, out), error in zip(jobs, refusals, strict=True):
        info = wait_job(slurm_cluster, job_id, timeout=120)
        log = out.read_text()
        assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0" and info["Restarts"] == "0", log
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and re.match(error, errors[0]), log
        assert "not requeueing" in log and "srun" not in log, log


def test_submitit_submits_completes_and_requeues(slurm_cluster, reference, tmp_path, cleanup_jobs):
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "train.submit", "--nodes", "2", *CPU_NODES, "--nproc-per-node", "1", "--time", "10", "--wait",
           "--", *OVR, f"run.dir={run_dir}"]
    proc = subprocess.Popen(slurm_cluster.argv(cmd), cwd=ROOT, env=slurm_cluster.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
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
        wait_steps(slurm_cluster, run_dir, 3, job_id)
        # What SLURM does on submitit's timeout signal (and submitit's own Job._interrupt()): SIGTERM to
        # every process of the job step.
        assert slurm_cluster.run(["scancel", "--signal=TERM", job_id], timeout=30).returncode == 0
        info = wait_job(slurm_cluster, job_id)
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
    assert f"resumed from {run_dir}/checkpoints/step_{int(stopped.group(1)):08d} " in every
    assert summary(run_dir)["steps"] == 16 and summary(run_dir)["world_size"] == 2
    same_weights(run_dir, reference)


def crashing_rank(tmp_path: Path) -> dict[str, str]:
    """A job environment whose rank 1 crashes as it starts (exit 1, as a worker killed by a bug would),
    every time: a sitecustomize on PYTHONPATH that only torchrun's workers with RANK=1 act on."""
    fault = tmp_path / "fault"
    fault.mkdir(exist_ok=True)
    (fault / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1' and 'TORCHELASTIC_RUN_ID' in os.environ:\n"
        "    print('rank 1: injected crash', flush=True)\n"
        "    os._exit(1)\n")
    return {"PYTHONPATH": str(fault)}


def test_sbatch_crash_requeued_only_with_requeue_on_failure_and_at_most_max_requeues(slurm_cluster, tmp_path,
                                                                                      cleanup_jobs):
    """REQUEUE_ON_FAILURE=1 MAX_REQUEUES=1: a crashing run is requeued once, the second crash ends the job
    FAILED with the bound named; without REQUEUE_ON_FAILURE the first crash ends it."""
    fault = crashing_rank(tmp_path)
    job_id, out = sbatch(slurm_cluster, tmp_path, *OVR, f"run.dir={tmp_path / 'run'}",
                         env=job_env(REQUEUE_ON_FAILURE="1", MAX_REQUEUES="1", **fault))
    cleanup_jobs.append(job_id)
    info = wait_job(slurm_cluster, job_id)
    log = out.read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", (info, log[-5000:])
    assert log.count("rank 1: injected crash") == 2, log[-5000:]
    assert f"requeueing job {job_id} (requeue 1 of at most 1)" in log, log[-5000:]
    assert "not requeueing: already requeued 1 time(s) (MAX_REQUEUES=1)" in log, log[-5000:]

    plain = tmp_path / "plain"
    plain.mkdir()
    job_id, out = sbatch(slurm_cluster, plain, *OVR, f"run.dir={plain / 'run'}", env=job_env(**fault))
    cleanup_jobs.append(job_id)
    info = wait_job(slurm_cluster, job_id)
    log = out.read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, log[-5000:])
    assert "error: the job step failed" in log and "requeueing" not in log, log[-5000:]


def test_sbatch_plain_scancel_cancels_without_requeue(slurm_cluster, tmp_path, cleanup_jobs):
    run_dir = tmp_path / "run"
    job_id, out = sbatch(slurm_cluster, tmp_path, *OVR, "train.steps=400", f"run.dir={run_dir}")
    cleanup_jobs.append(job_id)
    wait_steps(slurm_cluster, run_dir, 2, job_id)
    assert slurm_cluster.run(["scancel", job_id], timeout=30).returncode == 0
    info = wait_job(slurm_cluster, job_id, timeout=120)
    time.sleep(CRED_EXPIRE + 5)  # a requeued job would be pending or running again by now
    info = job_info(slurm_cluster, job_id)
    log = out.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, log[-5000:])
    assert "got SIGTERM: the job is being cancelled or terminated by SLURM; not requeueing" in log, log[-5000:]
    assert "requeueing job" not in log
    assert not (run_dir / "summary.json").exists()


def test_submitit_does_not_requeue_a_crash(slurm_cluster, tmp_path, cleanup_jobs):
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "train.submit", "--nodes", "2", *CPU_NODES, "--nproc-per-node", "1", "--time", "10", "--wait",
           "--", *OVR, f"run.dir={run_dir}"]
    env = slurm_cluster.env(clean_env(**crashing_rank(tmp_path)))
    proc = subprocess.run(slurm_cluster.argv(cmd), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    m = re.match(r"submitted job (\d+): 2 node\(s\)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    job_id = m.group(1)
    cleanup_jobs.append(job_id)
    info = wait_job(slurm_cluster, job_id, timeout=60)
    every = "".join(p.read_text() for p in sorted((run_dir / "submitit").glob(f"{job_id}_*_log.*")))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", (info, every[-5000:])
    assert "rank 1: injected crash" in every and "Requeued job" not in every, every[-5000:]
    assert "SLURM_RESTART_COUNT=1" not in every
