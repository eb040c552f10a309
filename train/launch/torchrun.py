"""python -m train.launch.torchrun TORCHRUN_ARGS -m MODULE TRAINING_ARGS: torchrun, in a process that checks
the training arguments in full first.

The launcher starts this in place of `python -m torch.distributed.run`, with the same arguments (command.py).
It checks the task's keys here rather than in its own process: a task's module (a user's file) imports torch,
which torchrun imports next anyway, so a launch imports torch once on its way to the workers, not twice. A bad
key is still one line and exit 2 before torchrun starts a worker. (A launcher that waits for the rendezvous host
imports torch to probe it, and checks every key itself before it waits.)

The stop budget holds on every supported torch: where this torchrun does not know --shutdown-timeout (torch
2.11's), the option is taken out of its arguments and its agent is given the budget here instead
(apply_stop_budget).
"""

from __future__ import annotations

import gc
import os
import sys

from train.config import make_run_dir
from train.errors import EXIT_USAGE, ConfigError, say
from train.launch.command import check_training_args, check_world, usage_line
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
            say(usage_line(f"error: {e}", os.environ))  # (its launcher exits with USAGE_EXIT_CODE)
            return EXIT_USAGE
        from torch.distributed.run import main as torchrun

        from train.launch import standby

        argv = apply_stop_budget(argv)
        standby.install()
    try:
        return torchrun(argv)
    finally:
        standby.end_all()


def apply_stop_budget(argv: list[str]) -> list[str]:
    """torchrun's arguments, less --shutdown-timeout=N where this torchrun does not accept it; then its agent
    closes the workers within N seconds all the same (torch 2.11's passes no timeout to its PContext.close, whose
    default is a fixed 30 s, where 2.14's passes --shutdown-timeout)."""
    from torch.distributed.run import get_args_parser

    options = get_args_parser()._option_string_actions
    flag, end = "--shutdown-timeout=", argv.index("-m") if "-m" in argv else 0  # torchrun's own options end there
    given = [a for a in argv[:end] if a.startswith(flag)]
    if not given or "--shutdown-timeout" in options:
        return argv
    budget = int(given[-1][len(flag):])
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close

    def close_within_budget(self, death_sig=None, timeout=None):
        return close(self, death_sig, budget)

    api.PContext.close = close_within_budget
    return [a for a in argv[:end] if a not in given] + argv[end:]


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    finally:
        # torch's millions of objects are left to the OS, not walked by the interpreter's last garbage
        # collections after the workers have ended, as train/launch/__main__.py does
        gc.freeze()
    sys.exit(code)
