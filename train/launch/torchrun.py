"""python -m train.launch.torchrun TORCHRUN_ARGS -m MODULE TRAINING_ARGS: torchrun, in a process that checks
the training arguments in full first.

The launcher starts this in place of `python -m torch.distributed.run`, with the same arguments (command.py).
It checks the task's keys here rather than in its own process: a task's module (a user's file) imports torch,
which torchrun imports next anyway, so a launch imports torch once on its way to the workers, not twice
(about 1.5 s of CPU). A bad key is still one line and exit 2 before torchrun starts a worker. (A launcher that
waits for the rendezvous host imports torch to probe it, and checks every key itself before it waits.)
"""

from __future__ import annotations

import gc
import sys

from train.config import make_run_dir
from train.errors import EXIT_USAGE, ConfigError, say
from train.launch.command import check_training_args, check_world
from train.startup import frozen_imports


def main(argv: list[str]) -> int | None:
    with frozen_imports():  # the task's module and torchrun import torch
        try:
            if "-m" in argv:  # torchrun's own options are all --name=value (command.py); without one: --help, say
                cfg = check_training_args(argv[argv.index("-m") + 2:])
                check_world(cfg, argv)
                # Here, before any worker: one could not even leave its usage-error marker in an unwritable
                # folder, and torchrun would restart it as a crash.
                make_run_dir(cfg.run_dir)
        except ConfigError as e:
            say(f"error: {e}")
            return EXIT_USAGE
        from torch.distributed.run import main as torchrun

    return torchrun(argv)


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    finally:
        # torch's millions of objects are left to the OS, not walked by the interpreter's last garbage
        # collections (about 0.6 s of CPU after the workers have ended), as train/launch/__main__.py does
        gc.freeze()
    sys.exit(code)
