"""Process start-up: torch imported without the garbage collector.

Importing torch (with torch.distributed.checkpoint, the trainer's) creates about half a million objects, which
live as long as the process. With the collector on, it walks them again and again while they are being
created, for nothing: a good part of the import's CPU time. Every process that imports torch on its way to work
(a rank, torchrun's process, the loader workers' fork server) does so inside `frozen_imports()`: no collection
while it runs, then what it imported is frozen (gc.freeze: never walked again, as the trainer freezes what it
built) and collection is turned back on. The few objects that the imports leave unreachable are frozen with the
rest: a little memory, once per process.

A standby (train/launch/standby.py) is a worker that does those imports before torchrun restarts the group, at the
lowest priority, then waits for its round: stand_by() here, and note_imports(), the list of what a worker imported
that its standby imports too.

Standard library only: it runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def frozen_imports() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


STANDBY_VAR = "TRAIN_STANDBY"  # set by torchrun's process to the pipe a standby reads its round from
# The file where a worker lists the modules it imported, for the standby of its local rank to import them too
IMPORTS_VAR = "TRAIN_STANDBY_IMPORTS"


def note_imports() -> None:
    """A worker beside a standby lists the modules it has imported (called after its first step: by then the task's
    model, the optimizer's and W&B's imports are done too, which the trainer's module does not import), in the
    order they came; its standby imports them before its round. Best effort."""
    if not (path := os.environ.get(IMPORTS_VAR)):
        return
    names = [name for name in list(sys.modules) if not name.startswith("__")]
    part = f"{path}.{os.getpid()}"
    try:
        with open(part, "w") as f:
            f.write("\n".join(names))
        os.replace(part, path)
    except OSError:
        pass


def _import_listed(path: str, assigned: threading.Event) -> None:
    """The modules a worker of the last round listed (note_imports), once the list is there, until the round comes:
    then the worker imports what is left as it needs it."""
    while not os.path.exists(path):
        if assigned.wait(0.2):
            return
    try:
        with open(path) as f:
            names = f.read().split()
    except OSError:
        return
    for name in names:
        if assigned.is_set():
            return
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001  a module loaded from a path, an alias: the worker loads it its way
                pass


def _name(name: str) -> None:
    """This process's name as `ps` and top show it (its main thread's, 15 bytes at most); best effort."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def raise_to_this_thread(thread: threading.Thread) -> bool:
    """The thread's priority raised back to the calling thread's; False where that is not allowed (a process without
    CAP_SYS_NICE may lower a priority, never raise it: most users of a cluster) or the thread has ended."""
    try:
        os.setpriority(os.PRIO_PROCESS, thread.native_id, os.getpriority(os.PRIO_PROCESS, 0))
    except OSError:
        return False
    return True


def stand_by(preload: Callable[[], None]) -> None:
    """A standby (train/launch/standby.py): run `preload` (the imports) on a thread of the lowest priority, wait for
    the round's environment on the pipe, take it, and return once the imports are done, to start as a worker
    would. Exits at once, quietly, where the pipe ends with no round (torchrun ended, or it started a worker
    afresh).

    Imports still under way when the round comes go on at this thread's priority: at the lowest, on cores the other
    ranks keep busy, they could take minutes. Where the priority cannot be raised, the process starts afresh as the
    round's worker instead (exec: the same process, the one torchrun watches)."""
    fd = int(os.environ.pop(STANDBY_VAR))
    listed = os.environ.get(IMPORTS_VAR)
    assigned = threading.Event()
    priority = threading.Lock()  # held to lower the preload's priority, and to take the round: one after the other
    _name("train-standby")

    def low_priority_preload() -> None:
        with priority:
            if not assigned.is_set():
                try:
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread alone (Linux)
                except OSError:
                    pass
        with frozen_imports():
            try:
                preload()
            except BaseException:  # noqa: BLE001  the worker meets the same error again, and says it
                return
            if listed:
                _import_listed(listed, assigned)

    thread = threading.Thread(target=low_priority_preload, name="standby-preload", daemon=True)
    thread.start()
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    if not chunks:
        os._exit(0)
    env = json.loads(b"".join(chunks))
    with priority:
        assigned.set()
        if thread.is_alive() and not raise_to_this_thread(thread) and thread.is_alive():
            os.execve(sys.executable, sys.orig_argv, env)
    thread.join()  # the trainer's imports done; no import under way while the environment changes
    os.environ.clear()
    os.environ.update(env)
    _name(f"rank {env.get('RANK', '?')}")
