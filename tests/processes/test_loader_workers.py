"""DataLoader workers: their starts never hang, stop signals are ignored by the workers and their fork server
under torchrun, and nothing is left running after a rank is killed.

A worker forked from a rank that runs threads could hang in os.fork() before its first instruction
(CPython gh-112275, issue 24): train/parallel/data.py starts them from a fork server instead."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from tests.conftest import PY, ROOT, after_import, clean_env, metrics, run_train, summary
from tests.procs import children, descendants, finish, status, wait_for
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


# The lock of the interpreter's list of threads (runtime.interpreters.mutex, HEAD_LOCK in CPython's source), held
# around every os.fork() of a process, as a thread of the rank holds it for a moment when it starts or ends (gloo's,
# the loader's, an asynchronous save's). A child forked then waits for it forever before its first instruction in
# CPython 3.11 before 3.11.10 (gh-112275, which re-creates the lock only after taking it): the race that hung a
# worker forked from the rank, lost at every fork. The fork server is exempt: it runs no other thread, so nothing
# holds its lock when it forks a worker.
HOLD_THREAD_LIST_AT_FORK = """
import ctypes, os, sys
if "multiprocessing.forkserver" not in " ".join(sys.orig_argv):
    api = ctypes.pythonapi
    api.PyInterpreterState_Head.restype = ctypes.c_void_p
    api.PyThread_acquire_lock.argtypes = [ctypes.c_void_p, ctypes.c_int]
    api.PyThread_release_lock.argtypes = [ctypes.c_void_p]
    runtime = (ctypes.c_void_p * 64).from_address(ctypes.addressof(ctypes.c_char.in_dll(api, "_PyRuntime")))
    head = list(runtime).index(api.PyInterpreterState_Head())  # runtime.interpreters is {mutex, head, main, ...}
    lock = runtime[head - 1]
    os.register_at_fork(before=lambda: api.PyThread_acquire_lock(lock, 1),
                        after_in_parent=lambda: api.PyThread_release_lock(lock))
"""


def holding_thread_list_at_fork(tmp_path: Path) -> dict:
    """An environment whose every Python process but a fork server holds the interpreter's thread-list lock
    across its forks (HOLD_THREAD_LIST_AT_FORK, as a sitecustomize.py)."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(HOLD_THREAD_LIST_AT_FORK)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    return env


def test_a_loader_worker_starts_while_another_thread_of_the_rank_holds_the_thread_list_lock(tmp_path):
    """Every loader worker of a run starts while the training process holds the interpreter's thread-list lock (a
    thread of it starting or ending at that moment): an evaluation's workers every step while the training
    loader's runs, a new training loader every epoch. The run ends. With workers forked from the rank, every such
    fork hangs here; in real runs, where the lock is held for a moment only, runs with 80 to 250 worker starts hung
    (not every run). The interpreter's own fork under the held lock is checked to hang first: where it does not
    (CPython 3.11.10 and later, 3.12), no fork can hang and there is nothing to test."""
    if sys.version_info >= (3, 12):  # the fix, and another layout of the runtime's state (HOLD_THREAD_LIST_AT_FORK)
        pytest.skip("CPython 3.12 and later make the thread-list lock anew in a forked child: no fork hangs on it")
    env = holding_thread_list_at_fork(tmp_path)
    probe = subprocess.Popen([PY, "-c", "import os, time\nif os.fork() == 0:\n    os._exit(0)\ntime.sleep(30)"],
                             cwd=tmp_path, env=env, start_new_session=True)
    try:
        forked = wait_for(lambda: children(probe.pid) or None, 10, "the probe's fork")[0]
        time.sleep(1)
        hangs = _running(forked)
    finally:
        _kill_group(probe.pid)
        probe.wait()
    if not hangs:
        pytest.skip("this Python makes its thread-list lock anew in a forked child before taking it (gh-112275 "
                    "fixed): no fork hangs on it")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([PY, "-m", "train", "--config", "configs/default.yaml", *FAST, f"run.dir={run_dir}",
                             "train.steps=4", "data.persistent_workers=false"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rc, _, err = finish(proc, timeout=90)
    except AssertionError:
        raise AssertionError("HANG: a loader worker waits for the lock, its rank for its batch") from None
    assert rc == 0, err[-4000:]
    assert summary(run_dir)["steps"] == 4
    assert sum("eval_loss" in m for m in metrics(run_dir)) >= 4


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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
