"""The launcher's one signal handler, installed first thing: a stop signal is passed to torchrun once, as
SIGTERM, and remembered for the verdict.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from train.stops.signals import all_stop_signals


class Stopped(Exception):
    pass


class Signals:
    """The launcher's one handler for stop signals, from the first line of main() to its exit. It records
    each signal; the first one is passed on to the running torchrun (the doctor's or the training's) as
    SIGTERM, once; one that comes while no torchrun runs is seen by main() before it starts the next."""

    def __init__(self) -> None:
        self.received: list[tuple[int, float]] = []  # (signal, time)
        self.child: subprocess.Popen | None = None
        self.forwarded = False
        self.workers: set[int] = set()  # the training processes, known when the stop came
        self.round: int | None = None  # torchrun's round of those workers (None: none ran when the stop came)
        self.last_round = 0  # the highest round of workers seen so far (see() and the stop)

    def install(self) -> None:
        # Every signal a terminal, a scheduler or torchrun may send as a stop. torchrun passes TERM, INT, HUP and
        # QUIT on to the workers unchanged (TORCHELASTIC_SIGNALS_TO_HANDLE), so the workers treat each as a stop too.
        for sig in all_stop_signals():
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup: a hang-up is not a stop, here or in torchrun and the workers
            signal.signal(sig, self._handle)

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0][0]).name if self.received else "a stop signal"

    def _handle(self, signum, frame) -> None:
        self.received.append((signum, time.time()))
        self._forward()

    def _forward(self) -> None:
        if self.received and not self.forwarded and self.child is not None and self.child.poll() is None:
            self.forwarded = True
            self.workers.update(children(self.child.pid))  # known now, in case torchrun ends before they do
            self.round = round_of(self.workers)
            self.child.send_signal(signal.SIGTERM)

    def run(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start torchrun; a stop that came before it started reaches it at once."""
        self.child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1, env=env)
        self._forward()
        return self.child

    def see(self) -> None:
        """Note the round of torchrun's workers running now (polled while torchrun runs)."""
        if self.child is not None and (r := round_of(children(self.child.pid))) is not None:
            self.last_round = max(self.last_round, r)

    def check(self) -> None:
        """Raise Stopped if a stop came (between the steps of the launcher's own work)."""
        if self.received:
            raise Stopped(self.name)


def children(pid: int) -> set[int]:
    """The child processes of pid (torchrun's workers), from /proc; empty where it cannot be read."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except (OSError, ValueError):
            pass
    return found


def round_of(pids: set[int]) -> int | None:
    """torchrun's round of these workers (their TORCHELASTIC_RESTART_COUNT, from /proc), None if none is read.
    torch 2.14's agent counts its restarts after a failure there; the workers' markers carry it."""
    rounds = set()
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rounds |= {int(v[27:]) for v in env if v.startswith(b"TORCHELASTIC_RESTART_COUNT=") and v[27:].isdigit()}
    return max(rounds) if rounds else None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in "ZX"
    except (OSError, IndexError):
        return False
