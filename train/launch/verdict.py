"""How a launch ended, in one exit code and one line: the workers' markers of the round that ended, the
launches before it (History: the same checkpoint step failing again and again), and torchrun's output
explained.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import NamedTuple

from train import config
from train.checkpoint.storage import NAME, complete_checkpoints, memory_records
from train.errors import EXIT_REQUEUE, EXIT_USAGE, say
from train.launch.command import usage_line
from train.launch.forwarding import Signals, Stopped
from train.launch.rendezvous import split_endpoint
from train.stops import markers

LAST_SAID: list[str] = []  # the launcher's last line of this launch (the restart-loop check quotes it)


def say_last(line: str) -> None:
    """A line of the launcher on stderr, kept as its last (History quotes it when it refuses a restart loop)."""
    LAST_SAID[:] = [line]
    say(line)


# The last line of a torchrun traceback that the launcher's one line explains: the traceback is not shown.
QUIET_TRACEBACK = re.compile(r"^(torch\.distributed\.\S*)?(RendezvousConnectionError|RendezvousTimeoutError|"
                             r"RendezvousClosedError|DistNetworkError|DistStoreError)\b")

# What torchrun's output says, and what to tell the user (first match wins).
HINTS = [
    (re.compile(r"(?s)\A(?=.*RendezvousConnectionError)"  # the store answered once, then the connection broke
                r"(?=.*(Failed to recv|Connection was likely closed|Connection reset by peer|Broken pipe))"),
     "the rendezvous host {endpoint} was lost (its c10d store stopped answering): the other nodes cannot go on "
     "without it; restart the job on every node with the same --rdzv-id (a scheduler's restart does): it resumes "
     "from the latest checkpoint"),
    (re.compile(r"EADDRINUSE|Address already in use"),
     "the rendezvous port {port} is already in use on {host}: choose another --rdzv-endpoint port, or stop "
     "what holds it (ss -ltnp 'sport = :{port}')"),
    (re.compile(r"RendezvousTimeoutError"),
     "rendezvous timed out: not every node joined {endpoint} in time; check that each node runs the same "
     "--rdzv-id and --rdzv-endpoint, that {endpoint} is reachable from every node, or raise "
     "--rdzv-conf join_timeout=SECONDS"),
    (re.compile(r"RendezvousConnectionError|DistNetworkError|Connection refused|Name or service not known"),
     "cannot reach the rendezvous at {endpoint}: is the first node up, does its name resolve here, and is "
     "the port open between nodes?"),
    (re.compile(r"collective timed out|Timed out waiting|Watchdog caught collective operation timeout"),
     "a collective timed out: a rank hung or died (see the per-rank logs in the run directory); raise "
     "dist.timeout_s if steps are legitimately slower"),
]
# Once a round began training its rendezvous worked: a DistNetworkError or a refused connection is then what the
# other ranks say of a peer gone (the store it hosted closed), not a rendezvous to blame.
AFTER_START = [(re.compile(r"RendezvousConnectionError|Name or service not known"), hint)
               if hint.startswith("cannot reach the rendezvous") else (pattern, hint) for pattern, hint in HINTS]


def explain(output: str, opts: dict[str, str | None], started: bool = False) -> str:
    """One line: why torchrun failed and what to try. `started`: the round that ended began training (its
    rendezvous worked)."""
    endpoint = opts["rdzv_endpoint"] or "the local rendezvous"
    host, port = split_endpoint(opts["rdzv_endpoint"]) if opts["rdzv_endpoint"] else ("localhost", "?")
    for pattern, hint in AFTER_START if started else HINTS:
        if pattern.search(output):
            return hint.format(endpoint=endpoint, host=host, port=port)
    restarts = opts["max_restarts"]
    block = output.rpartition("Root Cause")[2].split("=" * 20)[0]
    fields = dict(re.findall(r"^\s*(host|rank|exitcode)\s*:\s*(-?\S+)", block, re.M))
    if len(fields) == 3:
        rank, where, code = fields["rank"], fields["host"], fields["exitcode"]
        how = f"was killed by signal {-int(code)}" if int(code) < 0 else f"exited with code {code}"
        if int(code) == -9:  # the kernel's out-of-memory killer (a container's memory limit too) sends SIGKILL
            how += " (SIGKILL: most often the out-of-memory killer; `dmesg` or the pod's status says)"
        return (f"rank {rank} on {where} {how}, and torchrun gave up after {restarts} restart(s) "
                f"(--max-restarts={restarts}); see its log in the run directory")
    return f"torchrun failed (--max-restarts={restarts}); see the output above and the run directory's logs"


class History:
    """Restart loops: a job whose every launch fails before its checkpoint step advances (a bad node, a data
    file that crashes a worker, a rendezvous host that never comes up) would be requeued or recreated for
    ever. Each node's launcher keeps, in <run_dir>/.launch/history[.<node>].json (written atomically), the
    step its launches started from and how many in a row failed there; the launch that makes it
    --max-failed-launches ends with exit 2 (the scheduler stops retrying) and one line naming the step and
    its last failure. A launch that advances the step or finishes starts the count again; a stop (a
    preemption) neither counts nor resets it; after the exit 2 the count starts again, for the relaunch by
    hand."""

    def __init__(self, run_dir: Path, opts: dict[str, str | None], memory: Path | None = None) -> None:
        self.limit = int(opts.get("max_failed_launches") or 0)
        node = "" if opts["nnodes"] == "1" else "." + re.sub(r"[^\w.-]", "_", opts["node_rank"] or socket.gethostname())
        self.path = run_dir / ".launch" / f"history{node}.json"
        self.checkpoints = run_dir / "checkpoints"
        self.memory = memory  # the run's states in host memory on this node (checkpoint.memory_every)
        self.start = self._step()

    def _step(self) -> int:
        """The newest step a relaunch would resume from: on disk, or in this node's host memory."""
        found = complete_checkpoints(self.checkpoints)
        disk = int(NAME.match(found[0].name).group(1)) if found else 0
        held = memory_records(self.memory)[:1] if self.memory is not None else []
        return max([disk, *(step for step, *_ in held)])

    def _read(self) -> dict:
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def _write(self, record: dict | None) -> None:
        with contextlib.suppress(OSError):  # the count is a safeguard: a run directory that refuses it still runs
            if record is None:
                self.path.unlink(missing_ok=True)
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)

    def end(self, rc: int, failed: bool) -> int:
        """The launcher's exit code, rc or 2 for a restart loop; updates the history. Progress is the step a
        relaunch resumes from, in memory too: torchrun's restarts within a launch go on from there."""
        if rc == 0 or self._step() > self.start:
            self._write(None)
            return rc
        if not failed:
            return rc
        before = self._read()
        count = before.get("failed", 0) + 1 if before.get("step") == self.start else 1
        last = LAST_SAID[0] if LAST_SAID else f"exit {rc}"
        if self.limit and count >= self.limit:
            self._write(None)
            cause = last.removeprefix('error: ').removeprefix('launch: ')
            say_last(usage_line(f"error: {count} launches in a row failed without advancing the checkpoint past "
                                f"step {self.start} (the last: {cause}): not retried (exit {EXIT_USAGE}); fix the "
                                f"cause and relaunch, or raise --max-failed-launches (MAX_FAILED_LAUNCHES)",
                                os.environ))
            return EXIT_USAGE
        self._write({"step": self.start, "failed": count, "last": last, "time": time.time()})
        return rc


def _first_failure(run_dir: Path, launch_id: str, ended: int) -> dict | None:
    """The first FAILED marker (a rank's own error: train/stops/markers.py) of the last round that wrote one,
    if that round is not older than the one that ended."""
    found = markers.failures(run_dir, launch_id)
    last = max((m.get("round", 0) for m in found), default=-1)
    return next((m for m in found if m.get("round", 0) == last), None) if last >= ended else None


class Verdict(NamedTuple):
    code: int  # the launcher's exit code
    line: str | None  # its last line (None: said already)
    report: bool = True  # whether torchrun's report of the failed workers (ChildFailedError) adds to the line


def verdict(rc: int, cfg: config.Config, signals: Signals, launch_id: str, budget: int, usage: list[str],
            tail: list[str], opts: dict[str, str | None], failure: str | None) -> Verdict:
    """The launcher's exit code for how torchrun ended, and its last line. torchrun's restarts (--max-restarts)
    keep the launch's id: a STOPPED or STARTED marker counts only if the round that ended wrote it, the round
    running when the stop came, else the last one torchrun ran (whose workers cleared the markers of the
    rounds before it, train/__main__.py). torchrun's report of its failed workers, whose "root cause" is the
    first rank to end (after a rank's own error, often a peer it left behind), is left out where the line names
    the cause: a usage error, a rank's own error, a hang."""
    stop = signals.received
    if rc == 0:
        return Verdict(0, None)
    if usage:
        return Verdict(EXIT_USAGE, f"error: {usage[0]} (found by the workers; not retried)", report=False)
    if rc == EXIT_USAGE:  # torchrun's process found it before any worker started (torchrun.py): its line is out
        return Verdict(EXIT_USAGE, None)
    if failure is not None and stop:
        raise Stopped(signals.name)  # the doctor trains nothing
    if stop and markers.read(cfg.run_dir, "FINISHED", launch_id) is not None:
        return Verdict(0, "launch: the run finished before the stop took effect (exit 0)")
    found = {name: markers.read(cfg.run_dir, name, launch_id) for name in ("STARTED", "STOPPED")}
    ended = signals.round if stop else max([signals.last_round, *(m.get("round", 0) for m in found.values() if m)])
    started, stopped = (m if m is not None and m.get("round", 0) == ended else None for m in found.values())
    if stopped is not None:
        name = signals.name if stop else stopped.get("signal") or "a peer rank signal"
        return Verdict(EXIT_REQUEUE, f"launch: stopped on {name}; the workers checkpointed: relaunch to continue "
                                     f"(exit {EXIT_REQUEUE})")
    if stop and started is None:
        return Verdict(EXIT_REQUEUE, f"launch: stopped on {signals.name} before the workers began training "
                                     f"(rendezvous, start-up or resume); nothing was trained since the last "
                                     f"checkpoint: relaunch to continue (exit {EXIT_REQUEUE})")
    if stop:
        return Verdict(1, f"error: stopped on {signals.name}, but no checkpoint was written within the stop budget "
                          f"(--stop-timeout={budget} s), after which the workers are killed: raise STOP_TIMEOUT "
                          f"(one step plus one checkpoint save plus a margin), and the scheduler's grace period "
                          f"above it")
    if failure is None and (own := _first_failure(cfg.run_dir, launch_id, ended)) is not None:
        # A rank's own error, not what the others ran into after it (a peer gone, the store it hosted closed:
        # torchrun's output then reads like a rendezvous or a network that failed).
        where = f"its traceback: {own['traceback']}" if own.get("traceback") else "its traceback is above"
        return Verdict(1, f"error: rank {own.get('rank')} failed: {own.get('error')} ({where})", report=False)
    if failure is None and (hang := markers.read(cfg.run_dir, "HANG", launch_id)) is not None:
        # train/parallel/hang.py's line
        return Verdict(1, f"error: {hang.get('error', 'a collective timed out')}", report=False)
    return Verdict(1, failure or f"error: {explain(''.join(tail), opts, started is not None)}")
