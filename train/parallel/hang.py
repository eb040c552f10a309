"""Who hung: when a collective times out, name the ranks that did not join it, their host, the collective,
and where each one that can still answer was (its innermost frame of train/ or the user's code).

torch's own mechanisms do the work:
- the flight recorder (TORCH_FR_BUFFER_SIZE, set by train/launch/launcher.py) records every collective of the
  group with its sequence number, for gloo as for NCCL; a rank's last entries say which collective it is in
  (not retired) or the last one it entered;
- the process group's c10d store carries the question and the answers: each rank keeps one thread blocked
  on a store key (no polling, nothing per step); a rank whose collective timed out sets it, and every rank
  that can still run Python answers with its flight-recorder state and its stack (faulthandler, every
  thread, into <run_dir>/logs/rank<N>.stacks.txt). A rank frozen outright (SIGSTOP, a deadlock that holds
  the GIL) cannot answer: it is named as such;
- the first rank to time out composes one line and leaves it to every node's launcher (the .HANG marker
  of each launch id, all-gathered at start with the hostnames and each rank's process), which prints it as
  its last line.
A rank found stuck outside any collective ends itself once the line is written, so that its node's
torchrun ends too. One that did not answer cannot: the marker names its process, and its node's launcher
kills it (train/launch/launcher.py), rather than leave it to torchrun's fixed 30 s grace, or for ever where it
is its node's only worker and the store's host (then nothing on that node fails). TRAIN_HANG_REPORT=0 turns
the thread off (the flight recorder is torchrun's setting).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import pickle
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from train.errors import say
from train.parallel.distributed import DistEnv, exit_process, hostname
from train.stops import markers
from train.stops.markers import launch_id, process_start

PREFIX = "ddp-template/hang/"
ANSWER_S = 5.0  # how long the first rank to time out waits for the others' answers


class Peer(NamedTuple):
    host: str
    launch_id: str | None
    pid: int = 0
    started: int | None = None  # the process's start time (markers.process_start): with pid, one process


PEERS: list[Peer] = []  # every rank's, all-gathered at start
_ctx: dict = {}


def host_of(rank: int) -> str:
    return PEERS[rank].host if 0 <= rank < len(PEERS) else "?"


def me() -> Peer:
    return Peer(hostname(), launch_id(), os.getpid(), process_start(os.getpid()))


def start(run_dir: Path, denv: DistEnv) -> None:
    """Once, after the process group exists (collective: every rank calls it): all-gather each rank's host,
    launch id and process, and start this rank's answering thread."""
    PEERS.clear()
    if denv.world_size == 1:
        PEERS.append(me())
        return
    gathered: list = [None] * denv.world_size
    dist.all_gather_object(gathered, tuple(me()))
    PEERS.extend(Peer(*p) for p in gathered)
    if launch_id():  # a line left by a group this launch ran before (torchrun restarted it) is not this one's
        markers.path(run_dir, launch_id(), "HANG").unlink(missing_ok=True)
    if os.environ.get("TRAIN_HANG_REPORT", "1") in ("", "0"):
        return
    _ctx.update(rank=denv.rank, run_dir=run_dir, store=_store(None), report_store=_store(ANSWER_S),
                main=threading.main_thread())
    threading.Thread(target=_answer, name="hang-answer", daemon=True).start()


def stop() -> None:
    """At this rank's end (every exit of the trainer): its answering thread returns, so that it is not left
    waiting on a store that rank 0's exit closes (torch would log that failure, with its C++ frames)."""
    if "report_store" in _ctx and not _ctx.get("reporting"):  # (after a report its connection may be stuck)
        try:
            _ctx["report_store"].set(f"wake/{_ctx['rank']}", "end")
        except Exception:
            pass


def _store(timeout_s: float | None) -> dist.Store:
    """A connection of its own to the group's store (the main thread's is never held by this thread)."""
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(datetime.timedelta(days=365) if timeout_s is None else datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(PREFIX, store)


def fr_state() -> tuple[str, int, bool] | None:
    """(operation, sequence number, still in it) of this rank's oldest collective not finished, else of its
    last one, from the flight recorder of the default group; None without one (TORCH_FR_BUFFER_SIZE unset)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        entries = pickle.loads(_dump_fr_trace(True, False, False)).get("entries", [])
    except Exception:
        return None
    entries = [e for e in entries if e.get("pg_id") == 0 and not e.get("is_p2p")]
    if not entries:
        return None
    open_ = [e for e in entries if not e.get("retired")]
    e = open_[0] if open_ else entries[-1]
    return e["profiling_name"].split(":")[-1], int(e["collective_seq_id"]), bool(open_)


_LIBS = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "purelib", "platlib")})


def user_frame(frame) -> str | None:
    """The innermost frame of train/ or the user's code (not the standard library, not an installed package):
    `file.py:LINE function (code)`."""
    import linecache

    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<") and not os.path.realpath(name).startswith(_LIBS):
            code = linecache.getline(name, frame.f_lineno).strip()
            code = code if len(code) <= 80 else code[:77] + "..."
            return f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name}" + (f" ({code})" if code else "")
        frame = frame.f_back
    return None


def _state(rank: int) -> dict:
    fr = fr_state()
    state = {"rank": rank, "op": fr[0] if fr else None, "seq": fr[1] if fr else None,
             "in_collective": fr[2] if fr else None}
    if not state["in_collective"]:
        state["where"] = user_frame(sys._current_frames().get(_ctx["main"].ident))
    return state


def _dump_stacks(rank: int, run_dir: Path) -> None:
    try:
        with open(run_dir / "logs" / f"rank{rank}.stacks.txt", "w") as f:
            f.write(f"rank {rank} on {host_of(rank)}, asked at {time.strftime('%Y-%m-%d %H:%M:%S')}: every thread\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
    except OSError:
        pass


def _answer() -> None:
    """The answering thread: blocked on the store until a rank's collective times out."""
    rank, store = _ctx["rank"], _ctx["store"]
    try:
        if store.get(f"wake/{rank}") == b"end":  # this rank's own end (stop()): the store may go any moment
            return
        state = _state(rank)
        store.compare_set(f"state/{rank}", "", json.dumps(state))  # a rank that timed out has said its own
        _dump_stacks(rank, _ctx["run_dir"])
        if state["in_collective"] or _ctx.get("reporting"):
            return  # its own timeout reports it
        store.wait(["done"], datetime.timedelta(seconds=ANSWER_S + 10))
        line = store.get("line").decode()
    except Exception:  # the store is gone: the job ended, or is ending
        return
    if _ctx.get("reporting"):  # its collective timed out meanwhile: the main thread ends it
        return
    say(f"[rank {rank}] error: {line}")
    exit_process(1)  # stuck outside a collective: end, so that this node's torchrun ends too


def _ranges(ranks: list[int]) -> str:
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(f"{ranks[i]}" if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def compose(states: dict[int, dict | None], op: str | None, seq: int | None, world: int, timeout_s: float) -> str:
    """The one line, from each rank's answer (None: no answer)."""
    what = f"{op} #{seq}" if op else "the collective"
    waited = [r for r in range(world) if (s := states.get(r)) and s.get("in_collective") and s.get("seq") == seq]
    missing = [r for r in range(world) if r not in waited]
    names = " and ".join(f"rank {r} on {host_of(r)}" for r in missing[:4]) + (
        f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    line = f"{names} did not join {what} ({_ranges(waited)} waited {timeout_s:g} s)" if waited else \
        f"{names} did not join {what}"
    for r in missing[:4]:
        s = states.get(r)
        if s is None:
            line += f"; rank {r} did not answer (stopped or frozen)"
        elif s.get("in_collective"):
            line += f"; rank {r} was waiting in {s['op']} #{s['seq']}"
        else:
            line += f"; rank {r} was in {s.get('where') or 'code outside train/ and the task'}"
    return line


def report(run_dir: Path, denv: DistEnv, timeout_s: float) -> str | None:
    """After this rank's collective timed out: the one line naming who did not join it, left for every node's
    launcher. Returned by the first rank to time out, which composes it (None on the others: they wait until
    it is written, so that none ends its node's torchrun before); also None where no report can be made.
    Bounded in time: a store whose host is frozen (rank 0's process under env://) accepts connections and
    never answers, so the exchange runs on a thread of its own and is given up after a few seconds."""
    if denv.world_size == 1 or "store" not in _ctx:
        return None
    rank = denv.rank
    _ctx["reporting"] = True  # this rank's answering thread leaves the ending to this one
    fr = fr_state()
    op, seq = (fr[0], fr[1]) if fr else (None, None)
    result: dict = {}

    def run() -> None:
        try:
            result["line"] = _exchange(run_dir, denv, op, seq, timeout_s)
        except Exception:  # the store's host is gone
            pass

    exchange = threading.Thread(target=run, name="hang-report", daemon=True)
    exchange.start()
    exchange.join(2 * ANSWER_S + 5)
    if "line" in result:
        return result["line"]
    line = (f"rank 0 on {host_of(0)} did not answer (stopped or frozen, or its host was lost: it holds the process "
            f"group's store); rank {rank} waited {timeout_s:g} s in {f'{op} #{seq}' if op else 'a collective'}")
    _leave(run_dir, line, [0])
    return line


def _exchange(run_dir: Path, denv: DistEnv, op: str | None, seq: int | None, timeout_s: float) -> str | None:
    store = _ctx["report_store"]  # connected at start: a new connection to a frozen store would wait forever
    store.set(f"state/{denv.rank}", json.dumps({"rank": denv.rank, "op": op, "seq": seq, "in_collective": True}))
    if store.add("composer", 1) != 1:
        store.wait(["done"], datetime.timedelta(seconds=ANSWER_S + 5))
        return None
    for r in range(denv.world_size):
        store.set(f"wake/{r}", "ask")
    deadline = time.monotonic() + ANSWER_S
    keys = [f"state/{r}" for r in range(denv.world_size)]
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    states = {r: json.loads(store.get(k)) if store.check([k]) else None for r, k in enumerate(keys)}
    line = compose(states, op, seq, denv.world_size, timeout_s)
    line += f"; every rank's stack: {run_dir / 'logs'}/rank*.stacks.txt"
    _leave(run_dir, line, [r for r, s in states.items() if s is None])
    store.set("line", line)
    store.set("done", "1")
    return line


def _leave(run_dir: Path, line: str, unanswered: list[int]) -> None:
    """The line for every node's launcher: the .HANG marker of each launch id (train/launch/launcher.py reads
    it), with the processes of the ranks that did not answer."""
    frozen = [{"rank": r, **PEERS[r]._asdict()} for r in unanswered if r < len(PEERS)]
    for lid in {p.launch_id for p in PEERS if p.launch_id}:
        with contextlib.suppress(OSError):
            markers.write(run_dir, "HANG", {"time": time.time(), "error": line, "launch_id": lid,
                                            "unanswered": frozen})
