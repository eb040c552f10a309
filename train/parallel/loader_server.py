"""Preloaded by the fork server of the DataLoader workers (train/parallel/data.py, worker_context), before
train.parallel.data.

In the fork server it first ignores every stop signal, so that neither the server (a signal to the whole
process group reaches it too, and without it no new worker could start) nor any worker it forks (they
inherit the dispositions from their first instruction) is ended by one: the training process takes the
signal, checkpoints, and ends them. The server then preloads train.parallel.data, torch with it, so that a
worker, a fork of the server, starts without importing them. Imported by any other process, it changes no
signal (the training process keeps its own handlers). It imports only train/stops/signals.py, which imports
nothing but the standard library: it runs before torch is imported.

It also turns the fork server's garbage collector off, for good: the server imports torch without collections
(train/startup.py says what they cost), then only forks. Each worker freezes what it inherits and turns its own
collector back on as it starts (train/parallel/data.py, _worker_init).
"""

import gc
import sys

from train.stops.signals import ignore_stop_signals


def in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server (`python -c 'from multiprocessing.forkserver
    import main; main(...)'`)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return len(argv) >= 2 and argv[-2] == "-c" and argv[-1].startswith("from multiprocessing.forkserver import")


if in_fork_server():
    ignore_stop_signals(blocked=True)
    gc.disable()
