"""The signals that stop a run, and the ranks' agreement to stop at the same step.

A stop is asked for by SIGTERM (torchrun, Kubernetes, SLURM), SIGINT (Ctrl-C), SIGHUP (a hang-up) or SIGQUIT,
which torchrun passes on to the workers as they came, plus checkpoint.signal (e.g. SIGUSR1, which SLURM's
--signal sends ahead of the time limit). HUP stays ignored where it was at start (nohup). The launcher and
the loader workers' fork server treat USR1 and USR2 as stops too (EVERY). Stdlib only at the top (torch is
imported by `agreed`, in a worker that has it already).
"""

from __future__ import annotations

import signal

ALWAYS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # a stop for every process of a run
EVERY = (*ALWAYS, "SIGUSR1", "SIGUSR2")  # every signal a launcher, torchrun, SLURM or a terminal may send as one


def every_stop_signal() -> tuple[signal.Signals, ...]:
    return tuple(getattr(signal, name) for name in EVERY)


def ignore_stop_signals(blocked: bool = False) -> None:
    """Ignore every stop signal; blocked too where `blocked` (the loader workers' fork server: the workers it
    forks inherit them blocked, see train/parallel/loader_server.py)."""
    for sig in every_stop_signal():
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK, every_stop_signal())


_received: list[str] = []  # the first stop signal StopRequest's handler took in this process


def received() -> str | None:
    """The first stop signal a StopRequest's handler took in this process, if any."""
    return _received[0] if _received else None


class StopRequest:
    """A worker's stop: the signal handler only sets a flag; the ranks agree at the next step or evaluation
    batch (an all-reduce, so nobody waits alone), so a signal that reached one rank (one node's kubelet, one
    srun task) stops them all at the same step. A second signal changes nothing: the save it asked for is
    already coming."""

    def __init__(self, extra_signal: str):
        self.extra_signal = extra_signal  # checkpoint.signal
        self.signal: str | None = None  # the signal this rank received, if any
        self.stopping = False  # all ranks agreed to stop: the next save is the last

    def install(self) -> None:
        def request_stop(signum, frame):
            self.signal = self.signal or signal.Signals(signum).name
            _received[:] = _received or [signal.Signals(signum).name]

        for name in {*ALWAYS, self.extra_signal}:
            sig = getattr(signal, name)
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup
            signal.signal(sig, request_stop)

    def agreed(self, device) -> bool:
        """Whether any rank got a stop signal (every rank calls it at the same points)."""
        if self.stopping:
            return True
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.signal else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopping = bool(flag.item())
        return self.stopping
