"""The markers in which a launch's workers tell its node's launcher how they ended, never by clocks.

<run_dir>/.launch/<launch id>.<name>, JSON, written atomically: STARTED (training begins: a stop from now on
ends with a checkpoint), STOPPED (a stop after a checkpoint), FINISHED (the run is complete), USAGE_ERROR
(train/__main__.py), FAILED.<rank> (train/trainer.py: a rank's own error), HANG (train/parallel/hang.py: its
line, and the processes of the ranks that did not answer). The launch id is TRAIN_LAUNCH_ID, a new one for
each `python -m train.launch` (each node's launcher has its own); `round` is torchrun's round of the writer,
as the launcher judges an ending by the markers of the round that ended (train/launch/verdict.py). Rank 0 also
writes STOPPED into the run directory for the user. Standard library only: the launcher reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from train.errors import LAUNCH_ID_VAR

FOLDER = ".launch"
ROUND_MARKERS = ("STARTED", "STOPPED", "FINISHED")  # the ones a round torchrun restarted starts without


def launch_id() -> str | None:
    """The id train/launch/launcher.py gives each of its launches (None under a bare torchrun, srun or python)."""
    return os.environ.get(LAUNCH_ID_VAR) or None


def launch_round() -> int:
    """torchrun's round of this worker: TORCHELASTIC_RESTART_COUNT, the restarts torchrun made after a failure
    (torch 2.14's agent; a restart for a membership change keeps it); 0 outside torchrun."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return int(value) if value.isdigit() else 0


def process_start(pid: int) -> int | None:
    """When the process pid started, in clock ticks since boot (/proc/PID/stat), None where it is gone: a pid
    and its start time name one process, never a later one that reuses the pid (HANG names processes)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def path(run_dir: Path, launch: str, name: str) -> Path:
    return run_dir / FOLDER / f"{launch}.{name}"


def write_json(target: Path, data: dict) -> None:
    """Atomically (a rename), fsynced: a reader sees the whole marker or none."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(data).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def write(run_dir: Path, name: str, marker: dict) -> None:
    """The marker `name` of the launch marker["launch_id"]."""
    write_json(path(run_dir, marker["launch_id"], name), marker)


def read(run_dir: Path, name: str, launch: str) -> dict | None:
    """A marker of the launch `launch` (None: there is none, or it does not parse)."""
    try:
        marker = json.loads(path(run_dir, launch, name).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else {}


def error_line(e: BaseException) -> str:
    """An exception as the last line of its traceback; one raised in a loader worker, which torch raises again
    in the training process with the worker's traceback in its message, as that traceback's last line."""
    text = str(e).strip()
    if "Original Traceback" in text:
        return text.splitlines()[-1][:300]
    return f"{type(e).__name__}: {text.splitlines()[0]}"[:300] if text else type(e).__name__


def write_failure(run_dir: Path, rank: int, e: BaseException, line: str | None = None,
                  traceback: Path | None = None) -> None:
    """Under the launcher, a worker's own error (an exception nobody explained: a bug in a model or data set), for
    its node's launcher, which names it in its last line rather than what the other ranks then ran into (a peer
    gone, a store that stopped answering): FAILED.<rank>, each rank its own, written before the process group
    is torn down (which is what the others run into). `line`: the error explained (else the exception's last line);
    `traceback`: the file that holds its traceback (else the rank printed it)."""
    if not launch_id():
        return
    with contextlib.suppress(OSError):  # the launcher then explains torchrun's output as before
        write(run_dir, f"FAILED.{rank}", {"rank": rank, "error": line or error_line(e), "time": time.time(),
                                          "launch_id": launch_id(), "round": launch_round(),
                                          **({"traceback": str(traceback)} if traceback else {})})


def failures(run_dir: Path, launch: str) -> list[dict]:
    """The FAILED markers of the launch `launch`, the first written first."""
    found = []
    for p in (run_dir / FOLDER).glob(f"{launch}.FAILED.*"):
        with contextlib.suppress(OSError, ValueError):
            if isinstance(marker := json.loads(p.read_text()), dict):
                found.append(marker)
    return sorted(found, key=lambda m: m.get("time", 0))


def forget(run_dir: Path, launch: str) -> None:
    """Every marker of the launch `launch` (the launcher, at its start and end)."""
    for p in (run_dir / FOLDER).glob(f"{launch}.*"):
        with contextlib.suppress(OSError):
            p.unlink()


def forget_earlier_rounds(run_dir: Path) -> None:
    """Under the launcher, a round torchrun restarted starts without the markers of the rounds before it:
    the launcher judges its end by the round that ended (a STOPPED or STARTED of the round before would
    make a crash a requeue, or a stop during this round's start-up a failure). Each node's first local rank
    clears its launch's, first thing (the markers of that node are its to write)."""
    if not launch_id() or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    for name in ROUND_MARKERS:
        with contextlib.suppress(OSError):  # the launcher also matches each marker's round with the workers it saw
            path(run_dir, launch_id(), name).unlink(missing_ok=True)


class Markers:
    """A worker's markers: every node's first local rank writes its node's under .launch/ (each node's
    launcher reads its own); rank 0 writes STARTED and STOPPED into the run directory for the user too."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir, self.rank = run_dir, rank

    def _mark(self, name: str, step: int, for_user: bool, **fields) -> None:
        marker = {"step": step, "time": time.time(), "launch_id": launch_id(), "round": launch_round()} | fields
        if for_user and self.rank == 0:
            write_json(self.run_dir / name, marker)
        if launch_id() and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            write(self.run_dir, name, marker)

    def started(self, step: int) -> None:
        """Training begins (every rank is resumed and handles stop signals): a stop from now on must end with
        a checkpoint; one that came earlier lost nothing. Every rank calls it."""
        self._mark("STARTED", step, for_user=True)

    def stopped(self, step: int, signal: str | None) -> None:
        """This exit is a stop after the checkpoint of `step`, not a crash (the user's STOPPED is removed on
        resume). Every rank calls it, once that checkpoint is complete on all."""
        self._mark("STOPPED", step, for_user=True, signal=signal)

    def finished(self, step: int) -> None:
        """The run is complete (summary.json written). Every rank calls it."""
        self._mark("FINISHED", step, for_user=False)

    def forget_stopped(self) -> None:
        """The user's STOPPED of a run that resumes (rank 0)."""
        if self.rank == 0:
            (self.run_dir / "STOPPED").unlink(missing_ok=True)
