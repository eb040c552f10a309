"""The preflight doctor on real processes: a healthy 2-rank world, and failures that name rank and host."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess

from tests.conftest import PY, ROOT, clean_env
from tests.multinode import required
from tests.quick.test_doctor import doctor

HOST = socket.gethostname()


def rows(out: str) -> dict[str, list[str]]:
    table: dict[str, list[str]] = {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1] in ("ok", "FAIL"):
            table.setdefault(parts[0], []).append(line)
    return table


def test_doctor_then_training_through_the_launcher(tmp_path):
    proc = doctor("--config", "configs/default.yaml", f"run.dir={tmp_path}", "task.image_size=16",
                  "task.train_samples=256", "task.eval_samples=64", "data.num_workers=0", "train.steps=2",
                  "train.global_batch_size=16", "train.micro_batch_size=8")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    table = rows(proc.stdout)
    assert "2 rank(s) on 1 node(s), 2 cpu device(s) per node, backend gloo" in table["world"][0]
    assert "correct on 2/2 ranks" in table["all-reduce"][0]
    gbps = float(table["bus-bandwidth"][0].split()[3])
    assert gbps > 0
    assert f"rank 0 on {HOST}" in table["/dev/shm"][0] and "GiB" in table["/dev/shm"][0]
    assert "writable" in table["checkpoint-dir"][0] and "served by a c10d store" in table["rendezvous"][0]
    # the network between nodes, said plainly: on CPU gloo's TCP sockets (the image test checks the verbs)
    assert f"rank 0 on {HOST}" in table["transport"][0] and "gloo: TCP sockets" in table["transport"][0]
    assert "doctor: all checks passed" in proc.stdout
    assert (tmp_path / "summary.json").exists()  # then it trained


def test_failures_name_the_rank_the_host_and_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with socket.socket() as squatter:  # something that is not a rendezvous holds the port
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        proc = doctor(f"run.dir={blocker}/run", launcher=False, extra_env={"RDZV_ENDPOINT": f"127.0.0.1:{port}"})
    assert proc.returncode == 1
    table = rows(proc.stdout)
    ckpt = table["checkpoint-dir"][0]
    assert "FAIL" in ckpt and f"rank 0 on {HOST}" in ckpt and "not writable" in ckpt and "set run.dir" in ckpt
    rdzv = table["rendezvous"][0]
    assert "FAIL" in rdzv and f"port {port} on 127.0.0.1 is in use by another program" in rdzv
    assert "2 check(s) failed" in proc.stderr


def test_an_unwritable_run_directory_stops_the_launch_before_the_doctor(tmp_path):
    """The launcher checks the run directory itself before torchrun starts (one line, exit 2), so the
    doctor never starts on it. A failing doctor stopping the launch: the /dev/shm and all-reduce tests."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = doctor(f"run.dir={blocker}/run", "train.steps=2")
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the run directory {blocker}/run") and "run.dir=" in last, proc.stderr
    assert "Traceback" not in proc.stderr and not rows(proc.stdout)  # no doctor table: it never ran


def test_too_little_shm_and_no_room_for_the_checkpoints_fail_with_the_fix(tmp_path):
    """A 64 MiB /dev/shm (Docker's default) and a run directory on a 16 MiB file system, both real tmpfs
    mounts in a mount namespace of the doctor's own."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        required("root and unshare", "the test mounts small tmpfs file systems in a mount namespace")
    small = tmp_path / "small"
    small.mkdir()
    mounts = f'mount -t tmpfs -o size=64m tmpfs /dev/shm && mount -t tmpfs -o size=16m tmpfs "{small}" && exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mounts, "sh",
           PY, "-m", "train.launch", "--doctor", "--nproc-per-node=2", "--", f"run.dir={small}/run",
           "checkpoint.keep=3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    table = rows(proc.stdout)
    shm = table["/dev/shm"][0]
    assert "FAIL" in shm and "0.1 GiB (< 1 GiB" in shm and "docker --shm-size=8g" in shm, shm
    ckpt = table["checkpoint-dir"][0]
    assert "FAIL" in ckpt and "that checkpoint.keep=3 needs: free space or lower checkpoint.keep" in ckpt, ckpt
    assert "correct on 2/2 ranks" in table["all-reduce"][0]  # the rest of the table is still there
    assert proc.stderr.strip().splitlines()[-1] == "error: the preflight doctor failed: see its FAIL rows above"
    assert not (small / "run" / "metrics.jsonl").exists()  # nothing trained


def test_a_rank_whose_all_reduce_is_wrong_fails_with_its_rank_and_host(tmp_path):
    """A rank whose link or GPU corrupts the sum (here rank 1's all_reduce adds 1 after the real gloo
    reduction of its first all-reduce, the doctor's check, injected by a sitecustomize only in that process):
    a FAIL row naming it, and no training."""
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import torch.distributed as dist\n"
        "    _real = dist.all_reduce\n"
        "    def all_reduce(tensor, *args, **kwargs):\n"
        "        work = _real(tensor, *args, **kwargs)\n"
        "        tensor.add_(1)\n"
        "        dist.all_reduce = _real\n"
        "        return work\n"
        "    dist.all_reduce = all_reduce\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(fault), env.get("PYTHONPATH")) if p)
    tiny = ["task.image_size=16", "task.train_samples=256", "task.eval_samples=64", "data.num_workers=0",
            "train.steps=2", "train.global_batch_size=16", "train.micro_batch_size=8"]
    proc = subprocess.run([PY, "-m", "train.launch", "--doctor", "--nproc-per-node=2", "--max-restarts=2", "--",
                           f"run.dir={tmp_path}/run", *tiny], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("correct on 1/2 ranks") == 1, proc.stdout  # the doctor ran once: never retried
    table = rows(proc.stdout)
    assert "FAIL" in table["all-reduce"][0] and "correct on 1/2 ranks" in table["all-reduce"][0], proc.stdout
    assert any("FAIL" in r and f"rank 1 on {HOST}" in r and "wrong sum" in r for r in table["all-reduce"]), proc.stdout
    assert not any(f"rank 0 on {HOST}" in r for r in table["all-reduce"])  # the healthy rank is not blamed
    assert proc.stderr.strip().splitlines()[-1] == "error: the preflight doctor failed: see its FAIL rows above"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
