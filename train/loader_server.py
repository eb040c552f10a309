"""Preloaded by the fork server of the DataLoader workers (train/data.py, worker_context), before train.data.

In the fork server it first ignores every stop signal, so that neither the server (a signal to the whole
process group reaches it too, and without it no new worker could start) nor any worker it forks (they
inherit the dispositions from their first instruction) is ended by one: the training process takes the
signal, checkpoints, and ends them. The server then preloads train.data, torch with it, so that a worker, a
fork of the server, starts without importing them. Imported by any other process (train.data imports it for
ignore_stop_signals; the training process must keep its own handlers), it changes no signal. It imports
nothing of train: it runs before torch is imported.
"""

import signal
import sys

# Every stop signal a launcher, torchrun, SLURM or a terminal may send to a whole process group.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def ignore_stop_signals(blocked: bool = False) -> None:
    """Ignore them; blocked too in the fork server, so that the workers it forks inherit them blocked:
    torch's worker loop installs a SIGTERM handler of its own before the worker's init function
    (data._worker_init) ignores it again, and one arriving in between stays pending, then is discarded
    (ignoring a pending signal discards it) before the init function unblocks them."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK, STOP_SIGNALS)


def in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server (`python -c 'from multiprocessing.forkserver
    import main; main(...)'`)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return len(argv) >= 2 and argv[-2] == "-c" and argv[-1].startswith("from multiprocessing.forkserver import")


if in_fork_server():
    ignore_stop_signals(blocked=True)
