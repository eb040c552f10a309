"""python -m train.launch: one node's torchrun, started, supervised and judged (its command line: command.py).

Every launcher (Makefile, sbatch, PyTorchJob, compose, the image's entrypoint) runs
    python -m train.launch [launcher options] [--] [training arguments]
Each launcher option falls back to an environment variable, its own name first and then the `PET_*`
one that torchrun and the Kubeflow operator use (e.g. --nnodes: NNODES, then PET_NNODES). With more
than one node and no rendezvous endpoint, MASTER_ADDR:MASTER_PORT (a PyTorchJob's Master replica)
hosts the c10d rendezvous.

The training arguments are checked before torchrun starts a worker, so a bad config fails once, in one
line: here, and in torchrun's process (torchrun.py), which imports the task's module.
One signal handler, installed first thing in main(), serves the launcher's whole life: stop signals
(TERM, INT, HUP, QUIT, USR1, USR2; HUP not where it was ignored at start, as under nohup) are passed to
torchrun once, as SIGTERM, which it passes on to the workers; they checkpoint and the launcher exits 75
("requeue me") if a checkpoint of this launch was written after the stop, or if the stop came before
training began (nothing was trained since the last checkpoint). The workers tell each node's launcher
how they ended in markers named by its launch's id (TRAIN_LAUNCH_ID; <run_dir>/.launch/), never by clocks,
and judged by torchrun's round that ended (_verdict). A rendezvous host still down at the join timeout is 75
(nothing trained); --max-failed-launches launches in a row that fail at one checkpoint step end in 2 (History).
The stop budget (--stop-timeout, STOP_TIMEOUT) is how long torchrun lets
the workers finish their step and save before it SIGKILLs them; the launcher also waits that long for
them when torchrun itself ends early (a second SIGTERM, as SLURM sends, cuts torchrun's own wait).
When torchrun fails, the launcher ends with one line saying why and what to try. A rank that a hang report
names as not answering (frozen) is killed by its node's launcher at once (_end_unanswered).
REQUEUE_EXIT_CODE replaces the launcher's 75 by another code, for a scheduler that retries only some codes
(a PyTorchJob's restartPolicy: ExitCode restarts 128-255 and fails the job on 1-127: k8s/pytorchjob.yaml).
USAGE_EXIT_CODE replaces its 2 (a usage error), for a restart policy that restarts every other exit than 0
(compose's restart: on-failure: docker-compose.yml sets 0); the error's one line, the last, then says so.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from train import config
from train.checkpoint.storage import memory_folder
from train.errors import EXIT_REQUEUE, EXIT_USAGE, LAUNCH_ID_VAR, ConfigError
from train.launch.command import (
    REQUEUE_CODE_VAR,
    check_training_args,
    check_world,
    parse_args,
    requeue_exit_code,
    resolve,
    torchrun_command,
    usage_exit_code,
    usage_line,
    worker_env,
)
from train.launch.forwarding import Signals, Stopped, alive, children
from train.launch.passthrough import Passthrough
from train.launch.rendezvous import NotUp, wait_for_rendezvous
from train.launch.verdict import History, say_last, verdict
from train.stops import markers
from train.supported import check_torch


def main(argv: list[str] | None = None) -> int:
    rc = _main(argv)
    if rc == EXIT_REQUEUE and (code := requeue_exit_code(os.environ)) != EXIT_REQUEUE:
        print(f"launch: exit {code} in place of {EXIT_REQUEUE} ({REQUEUE_CODE_VAR}={code}): the scheduler retries "
              f"it", file=sys.stderr)
        return code
    if rc == EXIT_USAGE:
        try:
            return usage_exit_code(os.environ)  # (its line, said last, says so: usage_line)
        except ConfigError:  # a bad value: refused with exit 2 first thing in _main
            return rc
    return rc


def _main(argv: list[str] | None) -> int:
    signals = Signals()
    signals.install()  # first: a stop during the launcher's own work is never lost, nor kills it half-way
    args, train_args = parse_args(argv)
    try:
        if warning := check_torch():  # a torch below the supported range is refused (ConfigError), above it told
            print(warning, file=sys.stderr, flush=True)
        requeue_exit_code(os.environ)  # a bad value is a usage error now, not at the end of a run
        usage_exit_code(os.environ)
        opts = resolve(args, os.environ)
        # torchrun's process checks every key before it starts a worker (torchrun.py); here, the trainer's, and
        # the task's too where torch is imported here anyway: a dry run, and before this node waits for the
        # rendezvous host (to probe it), so that a bad config never waits, nor leaves the other nodes waiting.
        waits = bool(opts["rdzv_endpoint"])
        cfg = check_training_args(train_args, task=args.dry_run or waits)
        cmd = torchrun_command(opts, train_args)
        check_world(cfg, cmd)
        before = _entries(cfg.run_dir)  # what a start the workers refuse leaves as it found (_undo_refused_start)
        if waits and not args.dry_run:
            config.make_run_dir(cfg.run_dir)  # as torchrun's process does (torchrun.py), before the wait
    except ConfigError as e:
        print(usage_line(f"error: {e}", os.environ), file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
        return 0
    history = History(cfg.run_dir, opts, memory_folder(Path(cfg.checkpoint.memory_dir), cfg.run_dir))
    try:
        rc = _launch(args, opts, cmd, cfg, train_args, signals, before)
    except NotUp as e:  # nothing was trained: the job should be retried (PyTorchJob: 143, recreated), a few times
        say_last(f"launch: {e}")
        return history.end(EXIT_REQUEUE, failed=True)
    return history.end(rc, failed=rc == 1)


def _launch(args: argparse.Namespace, opts: dict[str, str | None], cmd: list[str], cfg: config.Config,
            train_args: list[str], signals: Signals, before: tuple[set[str], Path | None]) -> int:
    """Wait for the rendezvous host, run the doctor if asked, then the training's torchrun: the exit code."""
    try:
        if opts["rdzv_endpoint"]:
            try:
                opts = wait_for_rendezvous(opts, signals)
            except NotUp:
                raise
            except RuntimeError as e:
                say_last(f"error: {e}")
                return 1
            cmd = torchrun_command(opts, train_args)
        debug = bool(args.debug or os.environ.get("LAUNCH_DEBUG", "0") not in ("", "0"))
        if args.doctor or os.environ.get("LAUNCH_DOCTOR", "0") not in ("", "0"):
            # Once (a failed check is not retried), with its own rendezvous id: a finished rendezvous is
            # closed and could not host the training.
            doctor = torchrun_command(opts | {"rdzv_id": f"{opts['rdzv_id']}-doctor", "max_restarts": "0"},
                                      train_args, "train.doctor")
            print("+ " + shlex.join(doctor), file=sys.stderr, flush=True)
            signals.check()
            failure = "error: the preflight doctor failed: see its FAIL rows above"
            if (rc := _run(doctor, opts, cfg, signals, before, failure, debug)) != 0:
                return rc
        signals.check()
        print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
        return _run(cmd, opts, cfg, signals, before, debug=debug)
    except Stopped as e:
        say_last(f"launch: stopped on {e} before training started; nothing was trained since the last checkpoint: "
                 f"relaunch to continue (exit {EXIT_REQUEUE})")
        return EXIT_REQUEUE


def _wait_for(pids: set[int], deadline: float) -> set[int]:
    """Wait until these processes have ended or the deadline passed; returns those still running."""
    while (left := {p for p in pids if alive(p)}) and time.time() < deadline:
        time.sleep(0.2)
    return left


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _end_unanswered(run_dir: Path, launch_id: str, torchrun: int, killed: set[int]) -> None:
    """A hang report (the HANG marker, train/parallel/hang.py) names the ranks that did not answer it: frozen,
    stopped, or stuck holding the GIL. Their group is over (a collective timed out) and they cannot save;
    torchrun would SIGKILL them only after its fixed 30 s grace, or never where the frozen rank is its node's
    only worker and hosts the store (nothing on that node fails). This node's are killed now, each named once;
    a pid is one of torchrun's workers, and the very process the report named (its start time)."""
    hang = markers.read(run_dir, "HANG", launch_id)
    if not hang:
        return
    workers = children(torchrun)
    for peer in hang.get("unanswered", []):
        pid = peer.get("pid")
        if (pid in workers and pid not in killed and peer.get("host") == socket.gethostname()
                and markers.process_start(pid) == peer.get("started")):
            killed.add(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            print(f"launch: rank {peer.get('rank')} (pid {pid}) did not answer the hang report: killed, so that "
                  f"torchrun ends its group now", file=sys.stderr, flush=True)


def _run(cmd: list[str], opts: dict[str, str | None], cfg: config.Config, signals: Signals,
         before: tuple[set[str], Path | None],
         failure: str | None = None, debug: bool = False) -> int:
    """Run torchrun (the training's, or with `failure` the doctor's), passing stop signals on; map its end
    to 0, 75 (stopped after a checkpoint, or before training began: requeue), 2 (a usage error: the start the
    workers refused leaves the run directory as `before`, the names it held) or 1 (one line)."""
    launch_id = uuid.uuid4().hex
    budget = int(opts["stop_timeout"])
    env = worker_env(os.environ, cfg.run_dir, debug) | {LAUNCH_ID_VAR: launch_id}
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and "PET_SIGNALS_TO_HANDLE" not in env:
        # nohup: torchrun must not turn a hang-up into a stop either (its --signals-to-handle, TERM, INT, HUP
        # and QUIT by default); left ignored, SIGHUP stays ignored in torchrun and in the workers it starts.
        env["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGQUIT"
    if debug:
        (cfg.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # stderr is passed through line by line (passthrough.py: less the tracebacks that are not news) and kept
    # (the tail) to explain a failure afterwards.
    proc = signals.run(cmd, env)
    stop = signals.received
    tail: list[str] = []
    usage: list[str] = []  # a worker's usage error: torchrun is stopped rather than let retry it

    passthrough = Passthrough(sys.stderr)
    passing = threading.Lock()  # the pump feeds it; this thread closes it

    def pump():
        for line in proc.stderr:
            tail.append(line)
            del tail[:-400]
            with passing:
                passthrough.feed(line)

    def usage_error() -> bool:
        if not usage and (marker := markers.read(cfg.run_dir, "USAGE_ERROR", launch_id)) is not None:
            usage.append(marker.get("error", "a usage error"))
        return bool(usage)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    killed: set[int] = set()
    while (rc := _wait(proc, 0.5)) is None:
        signals.see()
        _end_unanswered(cfg.run_dir, launch_id, proc.pid, killed)
        if not usage and usage_error() and not stop:  # (a stop was passed on to torchrun already)
            proc.send_signal(signal.SIGTERM)  # the workers wait for it (train/__main__.py): nothing retries
    if stop:
        # torchrun ends early when a third SIGTERM reaches it (SLURM signals every process of the step,
        # and so does this launcher): the workers are still saving. Leaving now would let the scheduler
        # kill them; wait for them within the stop budget, as torchrun would have.
        left = _wait_for(signals.workers, stop[0][1] + budget + 5)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    # torchrun may have ended before the loop saw the marker: a rank's usage error at run time is followed by the
    # others' failures (the process group it tore down), and torchrun ends on the first of them at once.
    usage_error()
    pumping.join(timeout=5)
    try:
        try:
            judged = verdict(rc, cfg, signals, launch_id, budget, usage, tail, opts, failure)
        except Stopped:  # (the doctor's, stopped)
            with passing:
                passthrough.close()
            raise
        with passing:
            # torchrun's own traceback and report of the workers that failed (ChildFailedError) is held back to the
            # end, and dropped where the verdict's line names the cause (a usage error, whichever ended torchrun
            # first, this launcher's SIGTERM or the failure of a rank the error left without its peer; a rank's
            # own error; a hang)
            passthrough.close(failed_workers=judged.report)
        if judged.line:
            say_last(usage_line(judged.line, os.environ) if judged.code == EXIT_USAGE else judged.line)
        if (usage and markers.read(cfg.run_dir, "STARTED", launch_id) is None and opts["nnodes"] == "1"
                and signals.last_round == 0):
            # (several nodes share logs/ and .launch/; a later round's start follows one that may have trained)
            _undo_refused_start(cfg.run_dir, before)
        return judged.code
    finally:
        markers.forget(cfg.run_dir, launch_id)


def _entries(run_dir: Path) -> tuple[set[str], Path | None]:
    """The names in the run directory, and the outermost folder on its path that is not there yet (None: all are)."""
    made = None
    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            break
        made = folder
    try:
        return set(os.listdir(run_dir)), made
    except OSError:
        return set(), made


def _undo_refused_start(run_dir: Path, before: tuple[set[str], Path | None]) -> None:
    """A start the workers of this node alone refused, in torchrun's first round, before any training (a usage
    error, said once by the launcher): the folders that only this launch's processes wrote to (logs/ for the
    ranks' lines, .launch/ for its markers) go, and so
    do the run directory and the folders above it that this launch made. Where anything else is new there (a run
    began: config.yaml, checkpoints), nothing goes. (`python -m train` alone refuses before it writes anything.)"""
    held, made = before
    new = _entries(run_dir)[0] - held
    if not new <= {"logs", ".launch"}:
        return
    for name in new:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    if made is not None:
        for folder in (run_dir, *run_dir.parents):
            try:
                folder.rmdir()  # (not empty: another node's launcher wrote there meanwhile; it stays)
            except OSError:
                return
            if folder == made:
                return
