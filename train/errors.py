"""The bottom of the package: the error types, exit codes and names that every layer shares.

It imports nothing of train and nothing outside the standard library (tests/quick/test_imports.py checks), so any
module may import it, the launcher before torch, without closing a circle. The imports point one way:
entry points (python -m train, train.launch, .prepare, .export, .report, .doctor, .submit) -> the trainer ->
its components (data, checkpoints, distributed setup, logs) -> config -> this module.
"""

import os
import sys


class ConfigError(ValueError):
    """A usage error in the configuration: reported in one line, exit code 2."""

    def line(self) -> str:
        """What to print. One raised in a DataLoader worker (by a task's collate or data set) reaches the training
        process as torch re-raises it there: a ConfigError whose message is "Caught ConfigError in DataLoader worker
        process N.", the worker's traceback, and last "train.errors.ConfigError: <the message>": the message alone."""
        text, kind = str(self), type(self)
        if not text.startswith(f"Caught {kind.__name__} in DataLoader worker"):
            return text
        _, found, message = text.rpartition(f"\n{kind.__module__}.{kind.__qualname__}: ")  # the traceback's last line
        return message.strip() if found else text.splitlines()[0]


def missing_path(key: str, path: "os.PathLike | str", expected: str) -> ConfigError:
    """The error for a path a setting names that does not exist (a typo, a folder not copied to this machine):
    `key: PATH does not exist: check the path (expected)`, saying where a relative path starts."""
    where = "" if os.path.isabs(path) else f" (relative paths start at {os.getcwd()})"
    return ConfigError(f"{key}: {path} does not exist{where}: check the path ({expected})")


class UsageError(Exception):
    """A usage error of a command-line tool (python -m train.prepare, .export, .checkpoint): one line, exit 2."""


EXIT_USAGE = 2  # a usage error (bad config, bad arguments): one line; launchers do not retry it
EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped on a signal after saving; launchers requeue/restart on it
LAUNCH_ID_VAR = "TRAIN_LAUNCH_ID"  # the id train/launch/launcher.py gives each launch: its workers' markers carry it


def say(line: str) -> None:
    """One line to stderr in one write: the ranks of a node share their stderr (torchrun's), and print()'s
    separate writes of the text and its newline let two ranks' lines run into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
