"""Elastic torchrun through the shared launcher: restarts, nodes joining and leaving, hangs, give-ups.

Real torchrun agents and workers on 127.0.0.1, real signals."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import (
    PACED,
    PY,
    ROOT,
    TINY,
    assert_same_state,
    clean_env,
    latest_state,
    metrics,
    summary,
    train_losses,
)
from tests.multinode import free_port
from tests.procs import children, finish, kill_family, launcher_command, rank_of, standbys, torchrun, wait_for

# Enough steps after each point a test acts at (a kill, a stop: step 7 at the latest) that the run cannot end first.
LONG = [*TINY, *PACED, "train.steps=16", "checkpoint.every=5", "dist.timeout_s=20"]  # paced: acted on mid-run


def launch(run_dir: Path, *launcher_args: str, overrides=LONG, extra=(), host=None,
           env: dict | None = None) -> subprocess.Popen:
    """The launcher on this machine, or on a real host (tests/hosts.py)."""
    cmd = [PY, "-m", "train.launch", *launcher_args, "--", "--config", "configs/default.yaml", *overrides,
           f"run.dir={run_dir}", *extra]
    if host is not None:
        cmd = host.argv(cmd)
    return subprocess.Popen(cmd, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def workers(run_dir: Path) -> dict[int, int]:
    """{rank: pid} of the training processes of this run (read from /proc, as an operator would)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train" in cmd and f"run.dir={run_dir}".encode() in cmd and b"-m" in cmd \
                and (rank := rank_of(int(proc.name))) is not None:  # a standby that took a round too
            if cmd[cmd.index(b"-m") + 1] == b"train" and _state(proc) not in "ZX":
                found.setdefault(rank, []).append(int(proc.name))
    # A process forked from a rank has its command line and environment: the rank is the parent. (DataLoader
    # workers are not: they are forks of a fork server, `python -c 'from multiprocessing.forkserver ...'`.)
    return {rank: next(p for p in pids if _ppid(p) not in pids) for rank, pids in found.items()}


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return 0


def _state(proc: Path) -> str:
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]


def latest_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (0: none yet)."""
    try:
        return int("".join(c for c in (run_dir / "checkpoints" / "latest").read_text() if c.isdigit()) or 0)
    except OSError:
        return 0


def reached(run_dir: Path, step: int) -> bool:
    return (run_dir / "metrics.jsonl").exists() and any(m.get("step", 0) >= step for m in metrics(run_dir))


def _gone(pid: int) -> bool:
    try:
        return _state(Path(f"/proc/{pid}")) in "ZX"
    except OSError:
        return True


class _Lines:
    """A pipe read line by line on a thread, each line with the time it arrived."""

    def __init__(self, pipe):
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe):
        for line in pipe:
            self.lines.append((time.time(), line))

    def seen(self, text: str, timeout: float, after: float = 0.0) -> float:
        """When the first line holding `text` that arrived after `after` arrived."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if found := next((t for t, line in list(self.lines) if t >= after and text in line), None):
                return found
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not seen within {timeout} s:\n{''.join(x for _, x in self.lines)[-3000:]}")

    def text(self, after: float = 0.0) -> str:
        self.thread.join(timeout=30)
        return "".join(line for t, line in self.lines if t >= after)


# The hang's collective timeout: rank 0 gives up this long after its collective started.
HANG_TIMEOUT_S = 5


class _Chain:
    """What killed_then_hung saw, for its two tests to check."""


@pytest.fixture(scope="module")
def killed_then_hung(tmp_path_factory) -> _Chain:
    """One launch of 2 ranks (--max-restarts=3) that two failures restart, each caught by its own test:
    rank 1 SIGKILLed after step 6 (the group restarts from step 5's checkpoint: the round-1 standbys are round 2's
    workers), then round 2's rank 1 frozen (SIGSTOP) after step 11, which the hang report names and the launcher
    kills (the group restarts from step 10's). The run goes on to its end: 16 steps, as LONG's. What it saw, in a
    _Chain: test_sigkilled_worker_is_restarted_and_the_run_ends_bitwise_identical and
    test_hung_rank_fails_the_others_within_the_timeout_then_the_group_restarts."""
    chain = _Chain()
    chain.hit = hit = tmp_path_factory.mktemp("killed-then-hung") / "hit"
    proc = launch(hit, "--nproc-per-node=2", "--max-restarts=3",
                  overrides=[*TINY, *PACED, "train.steps=16", "checkpoint.every=5", f"dist.timeout_s={HANG_TIMEOUT_S}"])
    out, err = _Lines(proc.stdout), _Lines(proc.stderr)
    spare = []
    try:
        rank1 = wait_for(lambda: workers(hit).get(1), 120, "rank 1")  # found first: the kill follows the step at once
        agent = torchrun(proc.pid)
        chain.waiting = wait_for(lambda: s if len(s := standbys(agent)) == 2 else None, 60, "two standbys")
        wait_for(lambda: reached(hit, 6), 120, "step 6")  # step 5's save is over; step 10 is 4 paced steps away
        os.kill(rank1, signal.SIGKILL)
        chain.second = wait_for(lambda: w if len(w := workers(hit)) == 2 and rank1 not in w.values() else None, 120,
                                "round 2")
        chain.waiting2 = wait_for(lambda: s if len(s := standbys(agent)) == 2 else None, 60, "round 2's standbys")
        # The hang, in round 2: step 10's save is over; step 15 is 4 paced steps away.
        frozen = chain.second[1]
        wait_for(lambda: reached(hit, 11), 120, "step 11 in round 2")
        os.kill(frozen, signal.SIGSTOP)  # hung: it ignores the SIGTERM too, until SIGKILLed
        chain.stopped_at = stopped_at = time.time()
        timed_out = f"collective timed out after dist.timeout_s={HANG_TIMEOUT_S} s"
        chain.detected = err.seen(timed_out, 120, after=stopped_at) - stopped_at
        chain.killed = err.seen(f"launch: rank 1 (pid {frozen}) did not answer the hang report: killed", 60,
                                after=stopped_at) - stopped_at
        chain.restarted = out.seen("resumed from", 180, after=stopped_at) - stopped_at
        chain.third = wait_for(lambda: w if len(w := workers(hit)) == 2 and not {*w.values()} & {*chain.second.values()}
                               else None, 120, "round 3")
        spare = wait_for(lambda: s if len(s := standbys(agent)) == 2 else None, 60, "round 3's standbys")
        chain.returncode = proc.wait(timeout=240)  # not finish(), which would end what the launch left itself
    finally:
        chain.left = [p for p in spare if not _gone(p)]
        kill_family(proc.pid)
        proc.wait()
        for p in chain.left:
            os.kill(p, signal.SIGKILL)
    chain.out, chain.err = out.text(), err.text()
    chain.timed_out_lines = [ln for ln in err.text(after=stopped_at).splitlines() if timed_out in ln]
    return chain


def test_sigkilled_worker_is_restarted_and_the_run_ends_bitwise_identical(killed_then_hung, finished_16_steps):
    """The restart's workers are the standbys that waited beside round 1 (no import on the way back); the last
    round's own standbys (a restart is left) end with torchrun; the run ends as one never killed, bit for bit
    (killed_then_hung: a hang restarts it once more on the way)."""
    ref, chain = finished_16_steps, killed_then_hung  # LONG's run uninterrupted
    hit, err = chain.hit, chain.err
    assert sorted(chain.second.values()) == sorted(chain.waiting), (chain.second, chain.waiting)
    assert sorted(chain.third.values()) == sorted(chain.waiting2), (chain.third, chain.waiting2)  # (after the hang)
    assert chain.returncode == 0, err[-3000:]
    assert not chain.left, f"the last round's standbys outlived torchrun: {chain.left}"
    assert "resumed from" in chain.out and "at step 5" in chain.out  # the latest checkpoint before the kill
    assert_same_state(latest_state(ref), latest_state(hit))
    assert train_losses(ref) == train_losses(hit)


def test_hung_rank_fails_the_others_within_the_timeout_then_the_group_restarts(killed_then_hung):
    """A rank frozen mid-run (killed_then_hung's round 2): the others give up at dist.timeout_s, the launcher
    kills the frozen one, and the group restarts from the last checkpoint."""
    # torch 2.14's torchrun stops a failed group with a fixed 30 s grace before SIGKILL (its _stop_workers
    # ignores --shutdown-timeout), which a frozen rank would wait out: the launcher kills it once the hang
    # report names it as not answering (train/parallel/hang.py)
    chain, timeout_s, torchrun_grace_s = killed_then_hung, HANG_TIMEOUT_S, 30
    detected, killed, restarted = chain.detected, chain.killed, chain.restarted
    assert chain.returncode == 0, chain.err[-3000:]
    assert chain.timed_out_lines[0].startswith("[rank 0] error:"), chain.timed_out_lines
    # rank 0 gives up dist.timeout_s after its collective started (at most a step after the hang), not after
    # the 10-minute default; the restart follows after torchrun's grace (the hung rank is SIGKILLed) and a
    # start-up
    assert timeout_s - 1 <= detected <= timeout_s + 10, detected
    assert killed < detected + torchrun_grace_s / 2 and restarted <= killed + 60, (detected, killed, restarted)
    print(f"detected {detected:.1f} s after the hang, killed {killed:.1f} s, restarted {restarted:.1f} s after it")
    assert summary(chain.hit)["steps"] == 16 and "at step 10" in chain.out  # the checkpoint before the hang


HELD_TASK = '''
import os
import time

from train.stops.signals import received
from train.tasks.image import ImageClassification


class HeldAlone:
    """The training set: while the file BRAKE exists, a rank of a world of 1 waits in __getitem__ until a stop
    signal reaches it (its agent restarts the group for a node that joined)."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        while os.environ.get("WORLD_SIZE") == "1" and os.path.exists(BRAKE) and received() is None:
            time.sleep(0.01)
        return self.inner[index]


class Held(ImageClassification):
    def datasets(self):
        train, ev = super().datasets()
        return HeldAlone(train), ev
'''


def test_a_second_node_joins_then_leaves(tmp_path, make_hosts):
    """--nnodes=1:2 on two agents on two hosts: world 1, then 2 when the second node joins, then 1 again when
    the second host loses all its processes at once (launcher, agent, workers: SIGKILL). Node A, alone, waits
    in a data read from step 8 on until the restart for node B stops it (a test task: so that it counts steps
    while B starts, not seconds), and no longer once the group of two has formed."""
    host_a, host_b = make_hosts("node-a", "node-b")
    brake = tmp_path / "brake"
    (tmp_path / "held_task.py").write_text(f"BRAKE = {str(brake)!r}\n" + HELD_TASK)
    # A lost node leaves the rendezvous once its heartbeats are missed keep_alive_max_attempt times,
    # keep_alive_interval s apart (torch's default: 3 x 5 s); node A's group re-forms alone only then.
    common = ["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-endpoint=node-a:29400", "--rdzv-id=elastic",
              "--rdzv-conf=last_call_timeout=1,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3",
              "--max-restarts=3"]
    run = tmp_path / "run"
    overrides = [*TINY, "train.steps=30", "checkpoint.every=5", "dist.timeout_s=15",
                 f"task.name={tmp_path / 'held_task.py'}:Held"]
    a = launch(run, *common, overrides=overrides, host=host_a)
    b = None
    try:
        wait_for(lambda: reached(run, 8), 120, "node A alone at step 8")
        brake.touch()
        b = launch(run, *common, overrides=overrides, host=host_b)
        log0 = run / "logs" / "rank0.log"
        wait_for(lambda: "world size 2 (torchrun)" in log0.read_text(), 120, "the group to re-form with 2 nodes")
        brake.unlink()
        grown_at = max(m["step"] for m in metrics(run))
        # Until the 2-node group's checkpoint is complete (`latest` names it): a loss is logged before its
        # step's save ends, and a kill during that save resumes from the 1-node checkpoint (no change seen).
        wait_for(lambda: reached(run, grown_at + 5) and latest_step(run) > grown_at, 120,
                 "a checkpoint of the 2-node group")
        kill_family(b.pid)  # node B is lost: launcher, agent and workers
        rc, out, err = finish(a)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                kill_family(p.pid)
                p.wait()
    assert rc == 0, err[-3000:]
    log = log0.read_text()
    assert "world size changed from 1 to 2" in log and "world size changed from 2 to 1" in log
    s = summary(run)
    assert s["steps"] == 30 and s["world_size"] == 1
    data = latest_state(run)["data"]
    assert data["epoch"] * 256 + data["samples_in_epoch"] == 30 * 16  # every sample counted once
    assert sorted(train_losses(run)) == list(range(1, 31))


def test_launcher_builds_one_command_line_from_arguments_or_environment():
    """`--dry-run` prints the torchrun command the launcher would run; the other cases compose it in this process
    from the arguments and the environment, as the launcher does (train/launch/command.py), which the dry run
    shows to be the command it prints."""
    proc = subprocess.run([PY, "-m", "train.launch", "--dry-run", "--nproc-per-node=2", "--", "train.steps=3"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

    def dry(*args, **env):
        return shlex.join(launcher_command([*args, "--", "train.steps=3"], clean_env(**env)))

    assert proc.stderr.splitlines()[0] == "+ " + dry("--nproc-per-node=2")
    assert "--standalone" in dry("--nproc-per-node=2") and "--nproc-per-node=2" in dry("--nproc-per-node=2")
    kube = dry(PET_NNODES="1:4", PET_NPROC_PER_NODE="2", PET_RDZV_ENDPOINT="job-worker-0:23456", PET_RDZV_ID="job",
               PET_MAX_RESTARTS="3")
    for part in ("--nnodes=1:4", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=job-worker-0:23456",
                 "--rdzv-id=job", "--max-restarts=3", "-m train train.steps=3"):
        assert part in kube, kube
    master = dry(PET_NNODES="2", PET_NPROC_PER_NODE="1", MASTER_ADDR="job-master-0", MASTER_PORT="23456")
    assert "--rdzv-endpoint=job-master-0:23456" in master
    # arguments beat the environment
    assert "--nnodes=2" in dry("--nnodes=2", "--nproc-per-node=1", "--rdzv-endpoint=h:1", NNODES="1")
    assert "--rdzv-endpoint=[fd00::1]:29400" in dry("--nnodes=2", "--nproc-per-node=1",
                                                    "--rdzv-endpoint=[fd00::1]:29400")
    # --rdzv-conf reaches torchrun on one node too: its --standalone rendezvous applies it
    for one in (dry("--nproc-per-node=2", "--rdzv-conf=join_timeout=5"), dry("--nproc-per-node=2",
                                                                              RDZV_CONF="join_timeout=5")):
        assert "--standalone --rdzv-conf=join_timeout=5 -m train" in one, one


def test_launcher_usage_errors_exit_2_before_torchrun():
    for args, msg in [(["--nnodes=2"], "needs --rdzv-endpoint"), (["--nnodes=3:2"], "MIN:MAX"),
                      (["--nproc-per-node=x"], "--nproc-per-node"), (["--", "optim.lrr=1"], "did you mean")]:
        proc = subprocess.run([PY, "-m", "train.launch", *args], cwd=ROOT, env=clean_env(), capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and msg in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, args


@pytest.mark.parametrize("nodes", [[], ["--nnodes=2", "--rdzv-endpoint=127.0.0.1:1"]], ids=["one node", "two"])
@pytest.mark.parametrize("dry", [["--dry-run"], []], ids=["dry run", "run"])
def test_a_malformed_rdzv_conf_is_one_line_on_one_node_as_on_several(tmp_path, nodes, dry):
    """torchrun reads --rdzv-conf under --standalone too (and stops on a malformed one with a traceback): the
    launcher checks it the same way whatever the number of nodes, before anything is written or started."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([PY, "-m", "train.launch", *nodes, *dry, "--rdzv-conf=join_timeout", "--", "--config",
                           "configs/default.yaml", *TINY, f"run.dir={run_dir}"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: --rdzv-conf (RDZV_CONF) must be KEY=VALUE items separated by commas (e.g. "
                                   "join_timeout=600,last_call_timeout=30), got 'join_timeout': 'join_timeout' has "
                                   "no =VALUE"), proc.stderr
    assert not run_dir.exists()


def test_port_in_use_and_rendezvous_timeout_are_explained(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        rc, out, err = finish(launch(tmp_path, "--nproc-per-node=1", f"--rdzv-endpoint=127.0.0.1:{port}"), 60)
    assert rc == 1 and err.strip().splitlines()[-1].startswith(f"error: port {port} on 127.0.0.1 is in use")
    lonely = launch(tmp_path, "--nproc-per-node=1", "--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                    "--rdzv-conf=join_timeout=1")
    rc, out, err = finish(lonely, 120)
    assert rc == 1 and err.strip().splitlines()[-1].startswith("error: rendezvous timed out: not every node joined")


def test_a_batch_that_does_not_divide_the_world_is_one_usage_error_never_retried(tmp_path):
    """A global batch that cannot be split evenly over the ranks (16 samples a step over 3 ranks; 15 over 2). A
    fixed world is checked by the launcher before torchrun starts; an elastic one by the workers, whose usage
    error the launcher does not let torchrun retry."""
    wrong = ("error: train.global_batch_size=16 does not split evenly over 3 ranks (each rank takes an equal share of "
             "every step): run 2 or 4 ranks, or set train.global_batch_size=15 or 18 (a multiple of 3)")
    fixed = subprocess.run([PY, "-m", "train.launch", "--nproc-per-node=3", "--", "--config", "configs/default.yaml",
                            *TINY, f"run.dir={tmp_path / 'fixed'}"], cwd=ROOT, env=clean_env(), capture_output=True,
                           text=True, timeout=60)
    assert fixed.returncode == 2 and fixed.stderr.strip() == wrong, fixed.stderr
    # torchrun's agent says at INFO when it forms a worker group and when it restarts one: the proof that it
    # did not retry (a wall-time bound was one, until a busy machine took 31 s for the one round). Two workers
    # (and their standbys: --max-restarts) are enough for a world the batch does not divide.
    wrong = ("error: train.global_batch_size=15 does not split evenly over 2 ranks (each rank takes an equal share of "
             "every step): run 1 or 3 ranks, or set train.global_batch_size=14 or 16 (a multiple of 2)")
    elastic = launch(tmp_path / "elastic", "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3",
                     f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-conf=last_call_timeout=1",
                     overrides=[*TINY, "train.global_batch_size=15"], env=clean_env(LOGLEVEL="INFO"))
    rc, out, err = finish(elastic, 120)
    assert rc == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == f"{wrong} (found by the workers; not retried)"
    assert err.count(wrong) == 1  # the launcher's line alone (each worker's is in its log file)
    assert "Traceback" not in err and not list((tmp_path / "elastic").glob("checkpoints/*"))
    assert err.count("Rendezvous'ing worker group") == 1 and "will restart worker group" not in err, err[-3000:]


def loader_workers(rank: int) -> list[int]:
    """A rank's DataLoader workers: the children of its fork server (train/parallel/data.py), a child of the rank."""
    servers = [p for p in children(rank) if b"multiprocessing.forkserver" in _cmdline(p)]
    return [w for server in servers for w in children(server)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_plain_torchrun_recovers_after_a_dataloader_worker_is_killed(tmp_path):
    """What the OOM killer often picks: a DataLoader worker. Plain torchrun (a README entry point, what a
    PyTorchJob runs without the launcher) shares its rendezvous store with the workers; the restarted
    group must form anyway, and the rank that lost its loader says so in one line."""
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
           "-m", "train", "--config", "configs/default.yaml", *LONG, "data.num_workers=1", f"run.dir={tmp_path}"]
    env = {k: v for k, v in clean_env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for(lambda: reached(tmp_path, 7), 120, "step 7")
    loader = wait_for(lambda: loader_workers(workers(tmp_path)[1]), 30, "rank 1's DataLoader worker")[0]
    os.kill(loader, signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 0, err[-4000:]
    assert "resumed from" in out and summary(tmp_path)["steps"] == 16
    # Its parent is the fork server, not the rank: torch sees it exit, not which signal ended it.
    assert re.search(r"^\[rank 1\] error: a DataLoader worker died \([^;]*; often the out-of-memory "
                     r"killer\)", err, re.M), err[-4000:]
    assert "Traceback" not in err, err[-4000:]
