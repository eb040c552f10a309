"""The quick tier starts no process: `make test-quick` runs it in a minute or two. A test here that starts one
(subprocess, a fork, a loader worker, torchrun) fails at that call, naming the tier it belongs to."""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# Every way a test would start a process: subprocess and multiprocessing's spawn and forkserver go through
# _posixsubprocess.fork_exec, a loader worker's fork through os.fork.
STARTS = [(_posixsubprocess, "fork_exec"), (subprocess.Popen, "_execute_child"), (os, "fork"), (os, "forkpty"),
          (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system")]


class ProcessStarted(AssertionError):
    pass


def _refusing(original):
    """`original`, refused in the thread that runs the test. Another thread of the session goes on: the image's
    build (tests/engine.py) runs docker in a thread of its own while the quick tests run."""
    def call(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            raise ProcessStarted("tests/quick starts no process: move this test to tests/processes (training processes "
                                 "on this machine) or tests/systems (SLURM, Docker, real hosts)")
        return original(*args, **kwargs)
    return call


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if HERE not in item.path.parents:  # this hook sees every test of the session
        yield
        return
    saved = [(owner, name, getattr(owner, name)) for owner, name in STARTS if hasattr(owner, name)]
    for owner, name, original in saved:
        setattr(owner, name, _refusing(original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
