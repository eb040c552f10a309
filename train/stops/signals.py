"""The signals that stop a run, and the ranks' agreement to stop at the same step.

A stop is asked for by SIGTERM (torchrun, Kubernetes, SLURM), SIGINT (Ctrl-C), SIGHUP (a hang-up) or SIGQUIT,
which torchrun passes on to the workers as they came, plus checkpoint.signal (e.g. SIGUSR1, which SLURM's
--signal sends ahead of the time limit). HUP stays ignored where it was at start (nohup). The launcher and
the loader workers' fork server, which do not know checkpoint.signal, treat USR1 and USR2 as stops too
(ALL_STOP_SIGNALS). Stdlib only at the top (torch is imported by `agreed`, in a worker that has it already).
"""

from __future__ import annotations

import signal

FIXED_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # a stop for every process, whatever the config
# every signal a launcher, torchrun, SLURM or a terminal may send as one: the fixed ones and each checkpoint.signal
ALL_STOP_SIGNALS = (*FIXED_STOP_SIGNALS, "SIGUSR1", "SIGUSR2")


def all_stop_signals() -> tuple[signal.Signals, ...]:
    return tuple(getattr(signal, name) for name in ALL_STOP_SIGNALS)


def ignore_stop_signals(blocked: bool = False) -> None:
    """Ignore every stop signal; blocked too where `blocked` (the loader workers' fork server: the workers it
    forks inherit them blocked, see train/parallel/loader_server.py)."""
    for sig in all_stop_signals():
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK, all_stop_signals())


_received: list[str] = []  # the first stop signal StopRequest's handler took in this process


def received() -> str | None:
    """The first stop signal a StopRequest's handler took in this process, if any."""
    return _received[0] if _received else None


class StopRequest:
    """A worker's stop: the signal handler only sets a flag; the ranks agree at each step or evaluation
    batch (an all-reduce, so nobody waits alone), so a signal that reached one rank (one node's kubelet, one
    srun task) stops them all at the same step. A second signal changes nothing: the save it asked for is
    already coming. At a step that logs, evaluates and saves nothing the agreement costs no wait for the
    device (`agreed(now=False)`): the stop lands a step later. A run of one process reads its own flag: no
    collective, no wait, and its stop lands at the step the signal came in (on a GPU the host is not held one
    step ahead of the device, as a bare loop's is not)."""

    def __init__(self, extra_signal: str):
        self.extra_signal = extra_signal  # checkpoint.signal
        self.signal: str | None = None  # the signal this rank received, if any
        self.stopping = False  # all ranks agreed to stop: the next save is the last
        self._pending = None  # the agreement started and not read yet: (all-reduce, CUDA event or None, flag)
        self._host = self._view = None  # the flag on the host: a CPU tensor (pinned on a GPU), a numpy view of it

    def install(self) -> None:
        def request_stop(signum, frame):
            self.signal = self.signal or signal.Signals(signum).name
            _received[:] = _received or [signal.Signals(signum).name]

        for name in {*FIXED_STOP_SIGNALS, self.extra_signal}:
            sig = getattr(signal, name)
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup
            signal.signal(sig, request_stop)

    def agreed(self, device, now: bool = True) -> bool:
        """Whether the ranks agreed to stop (every rank calls it at the same points with the same `now`).

        now: a fresh all-reduce of every rank's flag, waited for (a log, evaluation or save step, where the
        host waits for the device anyway). Otherwise, no wait for this step's work: the answer is that of the
        all-reduce the previous call started (complete by now, or nearly: it was queued behind the previous
        step), and a new one starts for the next call. Every rank reads the same all-reduce at the same call,
        so all stop at the same step, one step later than a fresh agreement would."""
        if self.stopping:
            return True
        if _alone():  # one process agrees with itself: its own flag, read on the host, at once
            self.stopping = self.signal is not None
            return self.stopping
        stop = self._settle()
        if not stop:
            self._start(device)  # answered now (waited for), or by the next call
            if now:
                stop = self._settle()
        self.stopping = stop
        return stop

    def _start(self, device) -> None:
        import torch
        import torch.distributed as dist

        cuda = device.type == "cuda"
        if self._host is None:
            self._host = torch.zeros(1, dtype=torch.float32, pin_memory=cuda)
            self._view = self._host.numpy()
        value = 1.0 if self.signal else 0.0
        if not cuda:  # gloo reduces host memory: the flag is read where it lands
            self._view[0] = value
            self._pending = (dist.all_reduce(self._host, op=dist.ReduceOp.MAX, async_op=True), None, None)
            return
        flag = torch.full((1,), value, dtype=torch.float32, device=device)  # a fill, not a copy from the host
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        work.wait()  # the current stream waits for the all-reduce; the host does not
        self._host.copy_(flag, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (work, done, flag)

    def _settle(self) -> bool:
        """The answer of the started agreement, if any: waits for it (on a GPU: for the copy of its result
        to the host, queued behind the step it followed), then reads host memory."""
        if self._pending is None:
            return False
        work, done, _flag = self._pending
        self._pending = None
        if done is None:
            work.wait()
        else:
            done.synchronize()
        return bool(self._view[0] > 0)


def _alone() -> bool:
    """Whether this process is the run's only rank (no process group, or a group of one)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_world_size() == 1
