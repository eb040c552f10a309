"""Nodes on separate hosts (network namespaces, tests/hosts.py) that start in any order.

Real launchers, torchrun agents and gloo workers; each host has its own address, hostname and /etc/hosts."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path

from tests.conftest import PACED, PY, ROOT, TINY, clean_env, summary, train_losses
from tests.procs import wait_for


def node(run_dir: Path, *launcher_args: str, overrides=TINY) -> list[str]:
    return [PY, "-m", "train.launch", *launcher_args, "--", "--config", "configs/default.yaml", *overrides,
            f"run.dir={run_dir}"]


def wait(proc: subprocess.Popen, log: Path, timeout: float = 240) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass  # make_hosts kills it; the assertion shows the log
    return proc.returncode, log.read_text(errors="replace")


def test_a_node_started_before_the_rendezvous_host_waits_for_its_name_and_port_then_trains(make_hosts, tmp_path):
    """Node b starts first, when the rendezvous host's name (node-a, not a's hostname) does not resolve
    on b; once b has said it waits for that, the name appears in b's /etc/hosts, while nothing listens
    yet; once b has said it waits for that too, node a starts. Hostnames do not resolve across hosts at
    all: the nodes meet by the endpoint's name only."""
    a, b = make_hosts("alpha", "beta", introduce=False)
    a.knows("node-a", a.addr)
    args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=node-a:29400", "--rdzv-id=order"]
    run, log = tmp_path / "run", tmp_path / "b.log"
    pb = b.popen(node(run, *args), clean_env(), log)

    def says(text: str) -> str:
        """b's output once it holds `text` (or once b has ended: the assertion after shows it)."""
        def seen():
            out = log.read_text(errors="replace")
            return (out or "(no output)") if text in out or pb.poll() is not None else None

        return wait_for(seen, 120, f"node b to say {text!r}")

    out = says("node-a does not resolve yet")
    assert pb.poll() is None, out  # still waiting, not failed
    b.knows("node-a", a.addr)
    out = says("node-a:29400 is not reachable yet")
    assert pb.poll() is None, out  # still waiting, not failed
    a_started = time.time()
    pa = a.popen(node(run, *args), clean_env(), tmp_path / "a.log")
    rc_a, log_a = wait(pa, tmp_path / "a.log")
    rc_b, log_b = wait(pb, tmp_path / "b.log")
    assert rc_a == 0 and rc_b == 0, f"a: {rc_a}\n{log_a[-3000:]}\nb: {rc_b}\n{log_b[-3000:]}"
    assert "waiting up to 600 s for the rendezvous host: node-a does not resolve yet" in log_b
    assert "waiting up to 600 s for the rendezvous host: node-a:29400 is not reachable yet (Connection refused)" \
        in log_b
    assert "launch: node-a:29400 is reachable" in log_b
    s = summary(run)
    assert s["steps"] == 6 and s["world_size"] == 2 and sorted(train_losses(run)) == list(range(1, 7))
    # Node b, started first, started no worker of its own: both ranks began (their logs' first lines, the
    # STARTED marker) only after node a was started, in the one world they formed.
    for rank in (0, 1):
        first = (run / "logs" / f"rank{rank}.log").read_text().split(" [rank", 1)[0]
        began = datetime.strptime(first, "%Y-%m-%d %H:%M:%S.%f").timestamp()
        assert began >= a_started - 0.01, (rank, first, a_started)  # the logs' times are to the millisecond
    assert json.loads((run / "STARTED").read_text())["time"] >= a_started


def test_a_rendezvous_host_that_never_comes_ends_at_the_join_timeout_in_one_line(make_hosts, tmp_path):
    """Nothing was trained: the requeue code (a PyTorchJob recreates the pod rather than fail the job), and
    MAX_FAILED_LAUNCHES such launches in a row are a usage error (2)."""
    (lonely,) = make_hosts("lonely")
    env = clean_env(REQUEUE_EXIT_CODE="143", MAX_FAILED_LAUNCHES="2")
    for expected in (143, 2):
        proc = lonely.popen(node(tmp_path, "--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=nowhere:29400",
                                 "--rdzv-conf=join_timeout=1"), env, tmp_path / "log")
        rc, log = wait(proc, tmp_path / "log", 60)
        assert rc == expected, log
    lines = log.strip().splitlines()
    assert re.fullmatch(  # the resolver's words depend on the host's DNS set-up
        r"launch: the rendezvous host is not up after 1 s: nowhere does not resolve yet \([^)]+\); nothing was "
        r"trained, so a retry loses nothing \(exit 75\); if it stays down, start the first node, check that its "
        r"name resolves here and the port is open between nodes, or raise --rdzv-conf join_timeout=SECONDS",
        lines[-2]), log
    assert lines[-1].startswith("error: 2 launches in a row failed without advancing the checkpoint past step 0 "
                                "(the last: the rendezvous host is not up after 1 s: "), log
    assert "Traceback" not in log


def test_a_bracketed_ipv6_endpoint_is_accepted(tmp_path):
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(node(tmp_path, "--nnodes=1", "--nproc-per-node=1", f"--rdzv-endpoint=[::1]:{port}"),
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"--rdzv-endpoint=[::1]:{port}" in proc.stderr and summary(tmp_path)["steps"] == 6


def test_every_rank_resumes_from_the_same_checkpoint_when_one_node_cannot_read_the_newest(make_hosts, tmp_path):
    """Two nodes share the run folder; on node b the newest checkpoint reads back damaged (a truncated copy
    mounted over it in b's own mount namespace: a stale or corrupt view on one node only). Both ranks
    must resume from the previous checkpoint, and their replicas stay identical."""
    a, b = make_hosts("node-a", "node-b")
    run = tmp_path / "run"
    args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=node-a:29400"]
    first = [*TINY, "train.steps=4", "checkpoint.every=2"]
    pa = a.popen(node(run, *args, "--rdzv-id=first", overrides=first), clean_env(), tmp_path / "a1.log")
    pb = b.popen(node(run, *args, "--rdzv-id=first", overrides=first), clean_env(), tmp_path / "b1.log")
    assert wait(pa, tmp_path / "a1.log")[0] == 0 and wait(pb, tmp_path / "b1.log")[0] == 0
    newest = run / "checkpoints" / "step_00000004" / "__0_0.distcp"  # rank 0's share of the tensors
    damaged = tmp_path / "damaged.distcp"
    damaged.write_bytes(newest.read_bytes()[:1000])
    second = [*TINY, "train.steps=6", "checkpoint.every=2"]
    pa = a.popen(node(run, *args, "--rdzv-id=second", overrides=second), clean_env(), tmp_path / "a2.log")
    on_b = ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(damaged), str(newest),
            *node(run, *args, "--rdzv-id=second", overrides=second)]
    pb = b.popen(on_b, clean_env(), tmp_path / "b2.log")
    rc_a, log_a = wait(pa, tmp_path / "a2.log")
    rc_b, log_b = wait(pb, tmp_path / "b2.log")
    assert rc_a == 0 and rc_b == 0, f"{log_a[-3000:]}\n{log_b[-3000:]}"
    assert newest.stat().st_size > 1000  # the damage was only ever seen from node b
    for rank in (0, 1):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert "step_00000004" in log and "all ranks trying the previous one" in log, log
        assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in log, log
    s = summary(run)
    assert s["steps"] == 6 and s["ranks_in_sync"], s


def test_losing_the_rendezvous_host_ends_the_others_in_one_line_and_a_restart_resumes(make_hosts, tmp_path):
    """Host a serves the rendezvous (its agent holds the c10d store) and is lost at once (every process on
    it SIGKILLed). Node b cannot continue without the store: it ends within seconds, in one line, exit 1.
    The scheduler's restart (both nodes again, the same rendezvous id) resumes from the latest checkpoint."""
    a, b = make_hosts("node-a", "node-b")
    run = tmp_path / "run"
    args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=node-a:29400", "--rdzv-id=lost",
            "--max-restarts=2"]
    long = [*TINY, *PACED, "train.steps=15", "checkpoint.every=5", "dist.timeout_s=20"]  # paced: lost mid-run
    pa = a.popen(node(run, *args, overrides=long), clean_env(), tmp_path / "a1.log")
    pb = b.popen(node(run, *args, overrides=long), clean_env(), tmp_path / "b1.log")
    deadline = time.monotonic() + 180
    # Once step 5's checkpoint is complete (`latest` names it), 10 steps before the run could end.
    while not (run / "checkpoints" / "latest").exists():
        assert time.monotonic() < deadline and pb.poll() is None, (tmp_path / "b1.log").read_text()[-3000:]
        time.sleep(0.2)
    lost_at = time.monotonic()
    a.crash()
    rc_b, log_b = wait(pb, tmp_path / "b1.log", 180)
    took = time.monotonic() - lost_at
    print(f"node b ended {took:.1f} s after node a was lost; its output:\n{log_b[-5000:]}")
    assert rc_b == 1, log_b[-3000:]
    assert log_b.strip().splitlines()[-1].startswith("error: the rendezvous host node-a:29400 was lost"), log_b[-3000:]
    # "Within seconds" (docs/fault-tolerance.md): 3-7 s on a loaded 2-core machine; well before dist.timeout_s
    # (20 s), after which a collective left hanging on the lost host would have ended node b anyway.
    assert "Traceback" not in log_b and took < 20, took
    pa = a.popen(node(run, *args, overrides=long), clean_env(), tmp_path / "a2.log")
    pb = b.popen(node(run, *args, overrides=long), clean_env(), tmp_path / "b2.log")
    rc_a, log_a = wait(pa, tmp_path / "a2.log")
    rc_b, log_b = wait(pb, tmp_path / "b2.log")
    assert rc_a == 0 and rc_b == 0, f"{log_a[-3000:]}\n{log_b[-3000:]}"
    assert "resumed from" in log_a + log_b and summary(run)["steps"] == 15
