"""Standby workers: torchrun's restart starts from processes that have already imported torch and the trainer.

A fresh worker spends seconds importing torch, the task's module and the trainer before it can load a checkpoint. With
restarts allowed (--max-restarts above 0), each worker torchrun starts in this process has a standby beside it: the
same command and environment, less the round's variables (RANK, WORLD_SIZE, MASTER_PORT, ...), started at once, which
does those imports on a thread of the lowest priority and then waits (train/startup.py: stand_by; `ps` shows it as
train-standby). Imports not done when its round comes go on at the worker's priority, or, where the process may not
raise a priority, the standby starts afresh, as any worker. When torchrun restarts the workers (a crash, a node that
joins), each local rank's new worker is its standby, given the round's environment through a pipe: the process
torchrun watches, signals and reaps is an ordinary child of it, as any worker. A standby is used only where the
command and every variable but the round's are the same (and the worker's output is not redirected to a file); else it
is ended and a worker started as usual. The last restart torchrun allows gets none; when torchrun ends, so do they (a
standby whose pipe closes, torchrun's process gone, exits).

Set LAUNCH_STANDBY=0 to start every worker afresh (each standby holds the imports' memory, a few hundred MB).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

from train.startup import IMPORTS_VAR, STANDBY_VAR

SWITCH_VAR = "LAUNCH_STANDBY"

# What torchrun sets anew for each round of workers: a standby started in one round serves the next.
ROUND_VARS = {"RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT"}


def lasting(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment less what changes from one round to the next (torchrun's TORCHELASTIC_* included:
    the restart count, the error file's path)."""
    return {k: v for k, v in env.items() if k not in ROUND_VARS and not k.startswith("TORCHELASTIC_")}


def runs_train(args: tuple) -> bool:
    """The worker runs `python ... -m train ...`, whose entry point (train/__main__.py) knows how to stand by."""
    return any(args[i:i + 2] == ("-m", "train") for i in range(len(args) - 1))


def restarts_left(env: dict[str, str]) -> bool:
    try:
        return int(env["TORCHELASTIC_RESTART_COUNT"]) < int(env["TORCHELASTIC_MAX_RESTARTS"])
    except (KeyError, ValueError):
        return False


class Standby:
    """One waiting process, and the pipe that gives it its round."""

    def __init__(self, args: tuple, env: dict[str, str]):
        self.args, self.env = tuple(args), lasting(env)
        read, self._write = os.pipe()
        try:
            self.proc = subprocess.Popen(args, env=self.env | {STANDBY_VAR: str(read)}, pass_fds=(read,),
                                         start_new_session=True)
        except OSError:
            os.close(self._write)
            raise
        finally:
            os.close(read)

    def take(self, args: tuple, env: dict[str, str]) -> subprocess.Popen | None:
        """This standby as the round's worker, or None where it cannot be (then end() it)."""
        if tuple(args) != self.args or lasting(env) != self.env or self.proc.poll() is not None:
            return None
        data = json.dumps(env).encode()
        try:
            while data:
                data = data[os.write(self._write, data):]
        except OSError:  # it died meanwhile
            return None
        os.close(self._write)
        self._write = None
        return self.proc

    def end(self) -> None:
        if self._write is not None:
            os.close(self._write)  # it reads an end of file and exits
            self._write = None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_standbys: dict[str, Standby] = {}  # by local rank
_folders: list[str] = []


def install() -> bool:
    """Have this process's torchrun start workers from standbys; whether it will (not where LAUNCH_STANDBY=0, nor
    on a torch whose SubprocessHandler has no _popen to wrap)."""
    if os.environ.get(SWITCH_VAR, "1") == "0":
        return False
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    except ImportError:
        return False
    handler_class = subprocess_handler.SubprocessHandler
    popen = getattr(handler_class, "_popen", None)
    if popen is None:
        return False

    def popen_from_standby(handler, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        to_files = getattr(handler, "_stdout", None) is not None or getattr(handler, "_stderr", None) is not None
        rank = env.get("LOCAL_RANK", "")
        env = env | {IMPORTS_VAR: os.path.join(folder, f"imports-{rank}")}  # the worker's list, for its standby
        standby = _standbys.pop(rank, None)
        proc = standby.take(args, env) if standby is not None and not to_files else None
        if proc is None:
            if standby is not None:
                standby.end()
            proc = popen(handler, args, env)
        if restarts_left(env) and not to_files and runs_train(tuple(args)):
            try:
                _standbys[rank] = Standby(args, env)
            except OSError:
                pass  # the next round starts its workers afresh
        return proc

    try:
        folder = tempfile.mkdtemp(prefix="train-standby-")  # 0700: the workers' lists of imports
    except OSError:  # no writable temporary folder (a read-only container without one): workers start afresh
        return False
    _folders.append(folder)
    handler_class._popen = popen_from_standby
    return True


def end_all() -> None:
    """The standbys left when torchrun ends, and their folder."""
    while _standbys:
        _standbys.popitem()[1].end()
    while _folders:
        shutil.rmtree(_folders.pop(), ignore_errors=True)
