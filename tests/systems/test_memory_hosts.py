"""The memory tier across hosts (checkpoint.memory_every): a host lost whole, with its host memory, and replaced.

Real hosts (network namespaces, tests/hosts.py), each with a /dev/shm of its own that dies with it; real launchers,
torchrun agents and gloo workers; a real SIGKILL of every process of the lost host."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import PACED, PY, ROOT, TINY, assert_same_training, clean_env, metrics, train_cmd
from tests.procs import wait_for
from train.checkpoint.storage import memory_folder

# No disk checkpoint but the last (TINY: checkpoint.every=0): a restart has only host memory to resume from
RUN = [*TINY, "train.steps=12", "dist.strategy=fsdp", "dist.timeout_s=20"]
# A lost node leaves the rendezvous once its heartbeats are missed keep_alive_max_attempt times, keep_alive_interval
# s apart (torch's default: 3 x 5 s); node A's new round forms with the replacement only then.
LAUNCHER = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=node-a:29400", "--rdzv-id=hostlost",
            "--rdzv-conf=join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3", "--max-restarts=2"]


def node(run_dir: Path) -> list[str]:
    return [PY, "-m", "train.launch", *LAUNCHER, "--", "--config", "configs/default.yaml", *RUN,
            "checkpoint.memory_every=2", *PACED, f"run.dir={run_dir}"]


def logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((m["step"] for m in metrics(run_dir) if "loss" in m), default=0) if path.exists() else 0


def held(proc: subprocess.Popen, run_dir: Path) -> list[str]:
    """The files of the run's memory folder in a host's /dev/shm, seen through its launcher's mount namespace."""
    folder = Path(f"/proc/{proc.pid}/root") / memory_folder(Path("/dev/shm"), run_dir).relative_to("/")
    try:
        return sorted(p.name for p in folder.iterdir())
    except OSError:
        return []


def complete(names: list[str]) -> list[int]:
    """The steps of which both shares' records are among a memory folder's file names."""
    found: dict[int, set[str]] = {}
    for n in names:
        if n.startswith("share") and n.endswith(".pt"):
            found.setdefault(int(n.split("step_")[1][:8]), set()).add(n.split(".")[0])
    return [step for step, keys in found.items() if keys == {"share0", "share1"}]


def test_a_host_lost_with_its_memory_and_replaced_resumes_from_the_peers_copy_bitwise(make_hosts, tmp_path):
    """FSDP over 2 hosts of 1 rank: each host holds its own share and the peer's copy. Host B is lost whole (every
    process SIGKILLed, its /dev/shm with them) mid-run, before any disk checkpoint; host C, with an empty /dev/shm,
    takes its place at the same world size. Host A's torchrun restarts its worker, the new round resumes from host
    memory (rank 1's share sent from A's copy), at most 2 steps back, and ends bitwise as an uninterrupted run.
    (DDP, where each host holds the one share and the new host is sent A's, passed the same test once, in 76 s:
    the same load path, without the peer copies; not kept, for the suite's time.)"""
    a, b, c = make_hosts("node-a", "node-b", "node-c", own_memory=True)
    ref, run = tmp_path / "ref", tmp_path / "run"
    # The same 2 ranks on one host: the same numbers (gloo's collectives do not depend on where the ranks are).
    # Beside the hosts' run, which mostly waits (paced steps, the rendezvous).
    reference = subprocess.Popen(train_cmd(ref, *RUN, nproc=2), cwd=ROOT,
                                 env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pa = a.popen(node(run), clean_env(), tmp_path / "a.log")
    pb = b.popen(node(run), clean_env(), tmp_path / "b.log")
    pc = None
    try:
        # Step 8 logged: step 6's copies are made (a save waits for the previous one's), step 8's under way
        wait_for(lambda: logged(run) >= 8 or pa.poll() is not None or pb.poll() is not None, 180, "step 8")
        at, on_a = logged(run), held(pa, run)
        b.crash()
        assert at < 12 and pa.poll() is None, (at, (tmp_path / "a.log").read_text()[-3000:])
        pc = c.popen(node(run), clean_env(), tmp_path / "c.log")
        pa.wait(timeout=240)
        pc.wait(timeout=60)
        ref_out = reference.communicate(timeout=120)[0]
    finally:
        for p in (pa, pb, pc, reference):
            if p is not None and p.poll() is None:
                p.kill()
    assert reference.returncode == 0, ref_out[-3000:]
    out_a, out_c = (tmp_path / "a.log").read_text(), (tmp_path / "c.log").read_text()
    assert pa.returncode == 0 and pc.returncode == 0, f"a: {out_a[-3000:]}\nc: {out_c[-3000:]}"
    log = (run / "logs" / "rank0.log").read_text()
    assert "resume=auto: a memory state newer than the disk's" in log, log
    resumed = int(log.split("resumed from host memory step_")[1][:8])
    assert at - 2 <= resumed <= at + 2, (at, resumed)  # the kill came at most a step after `at` was logged
    assert not (run / "checkpoints" / f"step_{resumed:08d}").exists()
    assert max(complete(on_a), default=0) >= at - 2, on_a  # host A held both shares: its own and B's copy
    log1 = (run / "logs" / "rank1.log").read_text()
    assert f"host memory step_{resumed:08d}: this node lacks share 1; a copy came from rank 0's node" in log1, log1
    assert_same_training(ref, run)  # weights, optimizer state and every logged loss, bit for bit
    name = memory_folder(Path("/dev/shm"), run).name
    for out in (out_a, out_c):  # the run ended: each host's memory folder is let go
        end = next(line for line in out.splitlines() if line.startswith("/dev/shm at the end:"))
        assert name not in end, end
