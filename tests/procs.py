"""Processes of a launch, as an operator sees them in /proc: start the launcher, find its torchrun and
workers, wait for a step, end it and whatever it left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import PACED, PY, ROOT, TINY, clean_env, metrics


def launch(run_dir: Path, *overrides: str, launcher=("--nproc-per-node=2",), env: dict | None = None,
           prefix: tuple[str, ...] = (), paced: bool = True) -> subprocess.Popen:
    """`python -m train.launch` on TINY plus overrides, in a session of its own (a terminal's job: its
    process group is the launcher's, torchrun's and nothing else's: torchrun starts each worker in a
    session of its own). `prefix` goes before the command (e.g. nohup). `paced`: each step lasts at least
    PACED's sleep, so that a test acting on the run mid-way (a signal after step N) acts before its end (TINY's
    task only: an override of task.name brings a task of its own, paced by its own size)."""
    paced = paced and not any(o.startswith("task.name=") for o in overrides)
    cmd = [*prefix, PY, "-m", "train.launch", *launcher, "--", "--config", "configs/default.yaml", *TINY,
           *(PACED if paced else ()), f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def descendants(pid: int) -> list[int]:
    todo, family = children(pid), []
    while todo:
        p = todo.pop()
        family.append(p)
        todo += children(p)
    return family


def environ(pid: int) -> dict[str, str]:
    try:
        return dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                    if "=" in kv)
    except OSError:
        return {}


def torchrun(launcher_pid: int) -> int:
    """The torchrun agent under a launcher (not another, short-lived child of it)."""
    def find():
        for pid in children(launcher_pid):
            try:
                if b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                pass
        return None

    return wait_for(find, 60, "torchrun")


def workers(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the training processes under a launcher (launcher -> torchrun -> workers)."""
    found = {}
    for agent in children(launcher_pid):
        for pid in children(agent):  # a short-lived child of the launcher has no RANK in its environment
            if "RANK" in (env := environ(pid)):
                found[int(env["RANK"])] = pid
    return found


def kill_family(pid: int) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    """Wait for a launch to end; whatever is left of it then is killed, as a scheduler ends a job step."""
    family: set[int] = set()
    deadline = time.time() + timeout
    try:
        while True:
            family |= set(descendants(proc.pid))
            try:
                out, err = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.time() > deadline:
                    raise AssertionError(f"the launch did not end within {timeout} s") from None
    finally:
        if proc.poll() is None:
            family.add(proc.pid)
        for p in family:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    return proc.returncode, out, err


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(run_dir: Path) -> list[int]:
    """The steps of the training-loss lines of metrics.jsonl, in file order, duplicates kept."""
    path = run_dir / "metrics.jsonl"
    return [m["step"] for m in metrics(run_dir) if "loss" in m] if path.exists() else []


def stop_at(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180) -> str:
    """SIGTERM to a launch (the launcher, or torchrun) once its metrics log `step`, then its end, which must be
    a stop after a checkpoint (exit 75); returns its stdout."""
    wait_for(lambda: proc.poll() is not None or any(st >= step for st in logged_steps(run_dir)), timeout,
             f"step {step}")
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    return out
