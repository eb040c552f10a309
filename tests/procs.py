"""Processes of a launch, as an operator sees them in /proc: start the launcher, find its torchrun and
workers, wait for a step, end it and whatever it left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import PY, ROOT, TINY, clean_env, metrics, pacing
from train.launch.command import parse_args, resolve, torchrun_command
from train.startup import STANDBY_VAR


def launch(run_dir: Path, *overrides: str, launcher=("--nproc-per-node=2",), env: dict | None = None,
           prefix: tuple[str, ...] = (), paced: bool = True) -> subprocess.Popen:
    """`python -m train.launch` on TINY plus overrides, in a session of its own (a terminal's job: its
    process group is the launcher's, torchrun's and nothing else's: torchrun starts each worker in a
    session of its own). `prefix` goes before the command (e.g. nohup). `paced`: each step lasts at least
    PACED's sleep, so that a test acting on the run mid-way (a signal after step N) acts before its end (TINY's
    task only: an override of task.name brings a task of its own, paced by its own size)."""
    cmd = [*prefix, PY, "-m", "train.launch", *launcher, "--", "--config", "configs/default.yaml", *TINY,
           *(pacing(overrides) if paced else ()), f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def launcher_command(argv: list[str], env: dict) -> list[str]:
    """The torchrun command `python -m train.launch ARGV` composes from its arguments and `env` (what its --dry-run
    prints), composed in this process as the launcher does (train/launch/command.py): no torch imported."""
    opts, train_args = parse_args(argv)
    return torchrun_command(resolve(opts, env), train_args)


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


def rank_of(pid: int) -> int | None:
    """The rank of a training process: its RANK, or the rank in the name of a standby that took its round
    (train/launch/standby.py: its environment in /proc is the one it started with, without the round's variables);
    None for another process, a standby still waiting among them."""
    env = environ(pid)
    if STANDBY_VAR in env:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None
        return int(name[5:]) if name.startswith("rank ") and name[5:].isdigit() else None
    return int(env["RANK"]) if env.get("RANK", "").isdigit() else None


def is_standby(pid: int) -> bool:
    return STANDBY_VAR in environ(pid)


def standbys(agent: int) -> list[int]:
    """torchrun's standbys still waiting for a round (train/launch/standby.py): one a local rank."""
    return [p for p in children(agent) if is_standby(p) and rank_of(p) is None]


def torchrun(launcher_pid: int) -> int:
    """The torchrun agent under a launcher (not another, short-lived child of it)."""
    def find():
        for pid in children(launcher_pid):
            try:
                if b"train.launch.torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes():
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
            if (rank := rank_of(pid)) is not None:
                found[rank] = pid
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


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    """predicate()'s first true value, asked every `every` s (longer for one that runs a command: `docker
    inspect` in a loop keeps a core a quarter busy)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
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


def rank_processes(pid: int) -> dict[int, int]:
    """{rank: pid} of the training processes under `pid` at any depth (torchrun's workers, or the launcher's
    torchrun's), not the loader workers and fork servers they start (which inherit RANK). {} for a single
    `python -m train`, which is its own rank 0."""
    found, todo = {}, [pid]
    while todo:
        for child in children(todo.pop()):
            if (rank := rank_of(child)) is not None:
                found[rank] = child
            elif not is_standby(child):
                todo.append(child)
    return found


def status(pid: int) -> dict[str, str]:
    """/proc/PID/status as a mapping ({} once the process is gone)."""
    try:
        return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if ":\t" in line)
    except OSError:
        return {}


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP takes effect a moment after it is sent)."""
    return status(pid).get("State", "").startswith("T")


def _pending(pid: int) -> int:
    """The signals pending for a process (its own and its threads'), as a mask: bit n-1 for signal n."""
    st = status(pid)
    return int(st.get("SigPnd", "0"), 16) | int(st.get("ShdPnd", "0"), 16)


def signal_at_step(proc: subprocess.Popen, run_dir: Path, step: int, sig: int = signal.SIGTERM,
                   ranks: int | None = None, timeout: float = 180) -> int:
    """Send `sig` to a launch (`proc`: the launcher, torchrun, or the single training process) once its metrics
    log `step`, such that its ranks take it within the step they are in: they are paused (SIGSTOP) from before
    the signal is sent until each holds it pending (through the launcher and torchrun the signal may take its
    time: no step passes meanwhile), then go on (SIGCONT). A run with steps left after the one logged at the
    pause can thus never finish first, however loaded the machine: the race is counted in steps, not seconds.
    `ranks`: how many training processes run under `proc`; None where `proc` is the one training process.
    Returns the last step logged at the pause; a stop then lands at that step or the next, in runs that log every
    step (each agrees on a stop at once; a step that logs nothing reads the previous step's agreement)."""
    wait_for(lambda: proc.poll() is not None or any(st >= step for st in logged_steps(run_dir)), timeout,
             f"step {step}")
    assert proc.poll() is None, f"the launch ended (exit {proc.returncode}) before step {step} was logged"
    # looked up once training runs (a launcher's doctor runs workers of its own before)
    pids = [proc.pid] if ranks is None else list(
        wait_for(lambda: r if len(r := rank_processes(proc.pid)) == ranks else None, 10, f"{ranks} ranks").values())
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        # Only a process already stopped keeps a signal pending: one on its way to stopping may still take it
        # (the kernel hands out the lower-numbered signal first) and run its handler before it stops.
        wait_for(lambda: all(is_stopped(pid) for pid in pids), 60, "the ranks to stop")
        paused_at = max(logged_steps(run_dir))
        proc.send_signal(sig)
        bit = 1 << (int(sig) - 1)
        wait_for(lambda: all(_pending(pid) & bit for pid in pids), 60, f"{signal.Signals(sig).name} at every rank")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    return paused_at
