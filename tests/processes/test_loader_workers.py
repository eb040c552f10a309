"""DataLoader workers under torchrun: hundreds of starts without a hang, stop signals ignored by the workers
and their fork server, and nothing left running after a rank is killed.

A worker forked from a rank that runs threads could hang in os.fork() before its first instruction
(CPython gh-112275, issue 24): train/parallel/data.py starts them from a fork server instead."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from tests.conftest import PY, ROOT, after_import, clean_env, metrics, run_train, summary
from tests.procs import children, descendants, status, wait_for
from train import config
from train.parallel.data import loaders
from train.stops.markers import process_start

# Steps cost almost nothing (8 px, 2 samples per rank), so that the loader starts dominate: every step
# evaluates (a new 1-worker loader per rank, over one batch), and with data.persistent_workers=false every
# second step starts a new epoch's training loader too (2 steps per epoch).
FAST = ["task.image_size=8", "task.train_samples=8", "task.eval_samples=4", "data.num_workers=1",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.log_every=1000", "train.eval_every=1",
        "optim.warmup_steps=2", "log.wandb.mode=disabled", "log.report=false"]
STOP_SIGNALS = {int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                                 signal.SIGUSR2)}  # ints: a Signals member hashes by its name


def torchrun(run_dir: Path, *overrides: str, max_restarts: int = 0) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", f"--max-restarts={max_restarts}",
            "-m", "train", "--config", "configs/default.yaml", *FAST, f"run.dir={run_dir}", *overrides]


def run_or_say_hang(cmd: list[str], what: str, timeout: float) -> None:
    """Run to the end; a hang (a rank waiting forever for its batch) fails the other rank's next collective
    within dist.timeout_s, and the subprocess timeout catches anything else."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        raise AssertionError(f"{what}: HANG, still running after {timeout:.0f} s\n{tail!r}") from None
    hung = "collective timed out" in proc.stderr
    assert proc.returncode == 0, (f"{what}: {'HANG (a rank stopped answering)' if hung else 'failed'}, exit "
                                  f"{proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def test_hundreds_of_loader_worker_starts_never_hang(tmp_path):
    """~140 new loader workers per rank: evaluations while the persistent training loader runs, then
    evaluations and new training loaders every epoch (persistent_workers=false, resumed from the first part).
    With workers forked from the rank, runs like this hung after 80 to 250 of them (not every run: a hang
    needs a fork at the moment another thread holds the lock)."""
    run_dir = tmp_path / "run"
    run_or_say_hang(torchrun(run_dir, "train.steps=60", "dist.timeout_s=60"),
                    "60 evaluations, persistent training loader", timeout=150)
    run_or_say_hang(torchrun(run_dir, "train.steps=110", "data.persistent_workers=false", "dist.timeout_s=60"),
                    "50 more evaluations and 25 new training loaders", timeout=150)
    assert summary(run_dir)["steps"] == 110
    assert sum("eval_loss" in m for m in metrics(run_dir)) >= 110


# ---------------------------------------------------------------- processes, as an operator sees them

def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ignored(pid: int) -> set[int]:
    """The signals a process ignores or blocks (a worker starting: torch's SIGTERM handler is installed
    before the worker's init function ignores it again; the fork server blocks them for that moment)."""
    st = status(pid)
    mask = int(st["SigIgn"], 16) | int(st["SigBlk"], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def _start_time(pid: int) -> int:
    started = process_start(pid)
    return 1 << 62 if started is None else started


def _running(pid: int) -> bool:
    return not status(pid).get("State", "X").startswith(("Z", "X"))


def _is_loader_worker(pid: int) -> bool:
    """torch names a loader worker's thread pt_data_worker. Not every child of the fork server is one:
    importing torch in its preload runs `/sbin/ldconfig -p` (ctypes), a child that ends at once."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "pt_data_worker"
    except OSError:
        return False


def _loader_processes(rank: int) -> tuple[int, list[int]] | None:
    """(the fork server, its loader workers) of a rank, once both exist."""
    servers = [p for p in children(rank) if "multiprocessing.forkserver" in _cmdline(p)]
    if len(servers) == 1 and (workers := [w for w in children(servers[0]) if _is_loader_worker(w)]):
        return servers[0], workers
    return None


def _ranks(launcher: int) -> list[int] | None:
    """The launcher's two ranks, once both run `-m train`: a child between fork and exec (torchrun's
    subprocess.Popen) still blocks every signal, and is not a rank yet."""
    ranks = [p for p in children(launcher) if " -m train " in _cmdline(p)]
    return ranks if len(ranks) == 2 else None


def _step(run_dir: Path) -> int:
    try:
        return max((m["step"] for m in metrics(run_dir)), default=0)
    except OSError:
        return 0


def test_loader_workers_and_their_server_ignore_stop_signals_and_end_with_their_rank(tmp_path):
    """Every stop signal that reaches a whole process group (a terminal's SIGHUP or SIGQUIT too) leaves the
    loader workers and their fork server running: the rank takes it. A SIGKILL of a rank leaves nothing
    of its loaders behind."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(torchrun(run_dir, "train.steps=100000", "dist.timeout_s=30"), cwd=ROOT,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen: set[int] = set()  # the ranks and everything they started
    try:
        ranks = wait_for(lambda: _ranks(proc.pid), 60, "the two ranks")
        server, workers = wait_for(lambda: _loader_processes(ranks[1]), 60, "rank 1's loader workers")
        of_rank = [{c for p in children(rank) for c in [p, *children(p)]} for rank in ranks]
        seen.update(ranks, *of_rank)
        assert int(signal.SIGTERM) not in _ignored(ranks[1]), "the rank itself must take the stop signals"
        # The persistent training loader's worker: the server's oldest child (an evaluation's come and go).
        trainer = min(workers, key=_start_time)
        for pid in (server, trainer):
            assert _ignored(pid) >= STOP_SIGNALS, (pid, _cmdline(pid)[:60], sorted(STOP_SIGNALS - _ignored(pid)))
        for sig in STOP_SIGNALS:
            for pid in (server, *workers):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass  # an evaluation's worker that has just ended
        step = _step(run_dir)
        wait_for(lambda: _step(run_dir) >= step + 3, 60, "three more steps")
        assert proc.poll() is None and _running(server) and _running(trainer), \
            f"a stop signal ended a loader process: {proc.poll()=}, {_running(server)=}, {trainer=} {workers=} " \
            f"{[(w, _start_time(w)) for w in children(server)]}"
        # A SIGKILL of a rank: its fork server ends (its pipe closes), the workers within seconds of it
        # (they watch their parent), and multiprocessing's resource tracker with the last of them.
        os.kill(ranks[1], signal.SIGKILL)
        _all_end(of_rank[1], "rank 1 was killed")
        _kill(proc.pid, ranks[0])  # everything else too (torchrun may have stopped rank 0 already)
        _all_end(of_rank[0], "rank 0 and torchrun were killed")
    finally:
        _kill(proc.pid, *descendants(proc.pid), *seen)
        proc.communicate(timeout=60)


def _kill(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _all_end(pids: set[int], after: str) -> None:
    deadline = time.time() + 30
    while (left := [(p, _cmdline(p)[:90]) for p in pids if _running(p)]) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"still running 30 s after {after}: {left}"


class CollectorState(Dataset):
    """Each item: whether the process that reads it collects its garbage, and whether it froze what it started with."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([gc.isenabled(), gc.get_freeze_count() > 0])


def test_a_loader_worker_collects_its_garbage_though_its_fork_server_does_not():
    """The fork server imports torch with its collector off, for good (train/startup.py); a worker forked from it
    turns its own back on (a user's data set that makes reference cycles would otherwise grow without bound),
    torch's objects frozen (never walked)."""
    cfg = config.load("configs/default.yaml", [*FAST, "train.micro_batch_size=1"])
    _, evaluation = loaders(cfg, CollectorState(), CollectorState(), rank=0, world_size=1, cuda=False)
    assert [batch.tolist() for batch in evaluation] == [[[True, True]]] * 4


def test_a_bug_in_the_training_step_ends_the_run_with_its_traceback_not_a_hang(tmp_path):
    """An exception nobody explains (a user's model raising at step 2) with loader workers alive: the
    traceback and exit 1, at once. Through the interpreter's exit, multiprocessing would join the workers,
    which ignore its SIGTERM, for ever."""
    env = after_import(tmp_path, "train.trainer", """
real = module.train_step
def train_step(training, *args, **kwargs):
    if training.state.step == 2:
        raise RuntimeError("boom: a bug in the user's model")
    return real(training, *args, **kwargs)
module.train_step = train_step
""")
    proc = run_train(tmp_path / "run", "data.num_workers=1", "data.persistent_workers=true", expect=None, env=env,
                     timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: boom: a bug in the user's model" in proc.stderr
