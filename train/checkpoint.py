"""Checkpoints: this module alone decides when to save, what to keep and which one is latest.

Layout, in <run_dir>/checkpoints/:
    step_00000100.pt     torch.save of a dict of tensors and plain types (torch.load(weights_only=True))
    step_00000100.json   its size and CRC-32, written after the .pt is in place
    latest               the name of the latest complete checkpoint
    abandoned/<time>-resumed-at-step-<N>/   checkpoints after step N, set aside by a resume from step N
A write goes to a temporary file in the same directory, is fsynced and renamed into place, then the
directory is fsynced; only then does `latest` move. A process killed at any point leaves the previous
checkpoint intact, and a checkpoint without its .json, or whose bytes fail the CRC, never counts.
"""

from __future__ import annotations

import ctypes
import io
import json
import mmap
import os
import random
import re
import signal
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from train.config import Config, ConfigError, to_dict
from train.distributed import launch_id

FORMAT = 1
NAME = re.compile(r"^step_(\d{8})\.pt$")
EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped on a signal after saving; launchers requeue/restart on it
# Always a stop (torchrun, Kubernetes, SLURM, Ctrl-C, a hang-up); plus checkpoint.signal. torchrun passes TERM,
# INT, HUP and QUIT on to the workers as they came; HUP stays ignored where it was (nohup: see train/launch.py).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


# ---------------------------------------------------------------- files

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask Linux to start writing these pages to disk now, so the final fsync has little left to do."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE: start, do not wait


try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (OSError, AttributeError):  # not Linux
    _sync_file_range = None


class _CRCWriter(io.RawIOBase):
    """The file torch.save streams into: keeps a CRC-32 of the bytes (computed on a second thread
    while this one writes; zlib releases the GIL) and starts disk writeback as it goes."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0
        self._pool = ThreadPoolExecutor(1)

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        crc = self._pool.submit(zlib.crc32, b, self.crc)
        n = self.f.write(b)
        self.crc = crc.result()
        if len(b) >= 1 << 20:
            self.f.flush()
            _start_writeback(self.f.fileno(), self.size, len(b))
        self.size += len(b)
        return n

    def close(self) -> None:
        self._pool.shutdown()
        super().close()


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_checkpoint(state: dict, directory: Path, step: int, extra: dict | None = None) -> Path:
    """Write one complete checkpoint and move `latest` to it (the caller is the one writing rank).
    `extra` goes into its .json."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:08d}.pt"
    meta = dict(extra or {})

    def write_pt(f):
        with _CRCWriter(f) as w:
            torch.save(state, w)
            meta.update(crc32=w.crc, bytes=w.size)

    _write_atomic(path, write_pt)
    meta |= {"step": step, "file": path.name, "time": time.time()}
    _write_atomic(path.with_suffix(".json"), lambda f: f.write(json.dumps(meta).encode()))
    _fsync_dir(directory)
    _write_atomic(directory / "latest", lambda f: f.write(f"{path.name}\n".encode()))
    _fsync_dir(directory)
    return path


def read_checkpoint(path: Path) -> dict:
    """Load and verify one checkpoint; raises ValueError saying what is wrong with it.

    The file is memory-mapped: the CRC pass pulls it into the page cache, and the tensors are then
    read from there when copied into the model and optimizer."""
    meta_path = path.with_suffix(".json")
    if not meta_path.exists():
        raise ValueError("incomplete (no .json: the save did not finish)")
    try:
        meta = json.loads(meta_path.read_text())
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != meta.get("bytes"):
                raise ValueError(f"fails its checksum ({size} bytes, expected {meta.get('bytes')})")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                crc = zlib.crc32(m)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable ({e})") from None
    if crc != meta.get("crc32"):
        raise ValueError("fails its checksum (CRC-32 differs)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a file that passes its CRC but does not load is corrupt all the same
        raise ValueError(f"does not load ({type(e).__name__}: {e})") from None


def complete_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints with their .json, newest first, none newer than the one `latest` names."""
    if not directory.is_dir():
        return []
    found = sorted((p for p in directory.iterdir() if NAME.match(p.name) and p.with_suffix(".json").exists()),
                   reverse=True)
    latest = directory / "latest"
    if latest.exists():
        name = latest.read_text().strip()
        if NAME.match(name):
            found = [p for p in found if p.name <= name]
    return found


def _meta(path: Path) -> dict:
    try:
        return json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def write_launch_marker(run_dir: Path, name: str, marker: dict) -> None:
    """<run_dir>/.launch/<launch id>.<name>: what the workers tell the launcher of one node (train/launch.py
    reads it and removes it)."""
    folder = run_dir / ".launch"
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / f"{marker['launch_id']}.{name}", lambda f: f.write(json.dumps(marker).encode()))


# ---------------------------------------------------------------- state

def _rng_state(device: torch.device) -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    *mt, version, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _to_host(obj):
    """A copy on the CPU that training can no longer change (for asynchronous saving)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def _task_diff(cfg: Config, state: dict) -> str:
    """How the checkpoint's task.* keys differ from this run's, as ` (it has task.model=resnet18, this run
    task.model=resnet34)`; empty when they are the same or unknown."""
    theirs = (state.get("config") or {}).get("task")
    if not isinstance(theirs, dict):
        return ""
    ours = to_dict(cfg)["task"]
    keys = [k for k in dict.fromkeys([*theirs, *ours]) if theirs.get(k) != ours.get(k)]
    if not keys:
        return ""
    return (" (it has " + ", ".join(f"task.{k}={theirs.get(k)}" for k in keys[:3])
            + ", this run " + ", ".join(f"task.{k}={ours.get(k)}" for k in keys[:3]) + ")")


def _model_mismatch(expected: dict, got: dict) -> str | None:
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [f"{k} {tuple(got[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in got and tuple(got[k].shape) != tuple(v.shape)]
    problems = []
    if shapes:
        problems.append(f"{len(shapes)} shape(s) differ, first {shapes[0]} (checkpoint vs config)")
    if missing:
        problems.append(f"{len(missing)} missing, first {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected, first {unexpected[0]}")
    return "; ".join(problems) or None


def model_state(parts) -> tuple[dict, dict]:
    """The whole model's and optimizer's state dicts. Under FSDP (parameters sharded over the ranks) they are
    gathered to rank 0's memory, which alone gets them (the others get empty dicts): every rank calls this."""
    from train.parallel import sharded

    if not sharded(parts.raw):
        return parts.raw.state_dict(), parts.optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(parts.raw, options=opts),
            get_optimizer_state_dict(parts.raw, parts.optimizer, options=opts))


def load_model_state(parts, model: dict, optimizer: dict) -> None:
    """model_state()'s dicts back into the model and optimizer; under FSDP each rank keeps its shards of them."""
    from train.parallel import sharded

    if not sharded(parts.raw):
        parts.raw.load_state_dict(model)
        parts.optimizer.load_state_dict(optimizer)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(parts.raw, model, options=opts)
    set_optimizer_state_dict(parts.raw, parts.optimizer, optimizer, options=opts)


def check_fresh_start(cfg: Config) -> None:
    """resume=never starts afresh, which must not overwrite an earlier run's checkpoints and metrics."""
    if cfg.resume != "never":
        return
    found = [p.name for p in (cfg.run_dir / "checkpoints", cfg.run_dir / "metrics.jsonl", cfg.run_dir / "summary.json")
             if p.exists() and (p.is_file() or any(p.iterdir()))]
    if found:
        raise ConfigError(f"resume=never but {cfg.run_dir} already holds a run ({', '.join(found)}): choose a new "
                          f"run.name or run.dir for the fresh start, or resume=auto to continue it")


# ---------------------------------------------------------------- the manager

class Checkpointer:
    def __init__(self, cfg: Config, rank: int, world_size: int, log):
        self.cfg, self.rank, self.world_size, self.log = cfg, rank, world_size, log
        self.dir = cfg.run_dir / "checkpoints"
        self.stop_signal: str | None = None  # the signal this rank received, if any
        self.stopping = False  # all ranks agreed to stop: the next save is the last
        self.saved_step: int | None = None  # the step of the last save started in this process
        self.resumed_from: Path | None = None  # the checkpoint this process resumed from
        # With resume=PATH into this run's own directory (a rollback): PATH, relative to the run directory. It
        # goes into the .json of every save, so that a relaunch knows the rollback is done (find_resume).
        self.rollback: str | None = None
        self._pending: threading.Thread | None = None
        self._error: BaseException | None = None
        self.tracker_id: str | None = None  # the experiment tracker's run id, kept across resumes

    # ---- stop requests
    def install_signal_handler(self) -> None:
        """SIGTERM (what torchrun, Kubernetes and SLURM send), SIGINT (Ctrl-C), SIGHUP and SIGQUIT (which
        torchrun passes on unchanged) and checkpoint.signal request a stop. A second signal changes nothing:
        the save it asked for is already coming."""

        def request_stop(signum, frame):  # only sets a flag: the ranks agree at the next step or eval batch
            self.stop_signal = self.stop_signal or signal.Signals(signum).name

        for name in {*STOP_SIGNALS, self.cfg.checkpoint.signal}:
            sig = getattr(signal, name)
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup
            signal.signal(sig, request_stop)

    def stop_agreed(self, device: torch.device) -> bool:
        """All ranks agree to stop if any got the signal (an all-reduce, so nobody waits alone): a signal
        that reached one rank (one node's kubelet, one srun task) stops them all at the same step."""
        if self.stopping:
            return True
        flag = torch.tensor([1.0 if self.stop_signal else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopping = bool(flag.item())
        return self.stopping

    def _mark(self, name: str, step: int, **fields) -> None:
        """A marker in the run directory: `name` for the user (rank 0), and for each node's launcher
        (train/launch.py) one under .launch/ named by the id of its launch (each node's launcher has its own):
        every node's first local rank writes its own."""
        marker = {"step": step, "time": time.time(), "launch_id": launch_id()} | fields
        if self.rank == 0:
            _write_atomic(self.cfg.run_dir / name, lambda f: f.write(json.dumps(marker).encode()))
        if launch_id() and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            write_launch_marker(self.cfg.run_dir, name, marker)

    def _mark_stopped(self, step: int) -> None:
        """Tell the launcher this exit was a stop after a checkpoint, not a crash (removed on resume)."""
        self._mark("STOPPED", step, signal=self.stop_signal)

    def mark_started(self, step: int) -> None:
        """Tell the launcher training begins (every rank is resumed and handles stop signals): a stop from
        now on must end with a checkpoint; one that came earlier lost nothing. Every rank calls it."""
        self._mark("STARTED", step)

    def mark_finished(self, step: int) -> None:
        """Tell the launcher the run is complete (summary.json written). Every rank calls it."""
        if launch_id() and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            write_launch_marker(self.cfg.run_dir, "FINISHED", {"step": step, "launch_id": launch_id()})

    # ---- saving
    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def save(self, parts, blocking: bool = False) -> None:
        """Called on every rank (each rank's RNG states and loss window are gathered); rank 0 writes."""
        self.saved_step = parts.step
        mine = {"rng": _rng_state(parts.device),
                "window": {"loss": float(parts.window_loss.item()), "steps": parts.window_steps}}
        ranks = [None] * self.world_size
        dist.all_gather_object(ranks, mine)
        model, optimizer = model_state(parts)  # collective under FSDP
        if self.rank != 0:
            return
        self.wait()  # the next save waits for the previous one
        state = {
            "format": FORMAT,
            "model": model,
            "optimizer": optimizer,
            "scaler": parts.scaler.state_dict(),
            "step": parts.step,
            "data": parts.stream.state_dict() | {"seed": self.cfg.seed},
            "rng": [r["rng"] for r in ranks],
            "window": [r["window"] for r in ranks],  # the loss of each rank since the last log step
            "eval_pending": parts.eval_pending,
            "world_size": self.world_size,
            "config": to_dict(self.cfg),
            "tracker": {"run_id": self.tracker_id},
        }
        if self.cfg.checkpoint.async_ and not blocking:
            state = _to_host(state)  # training blocks only for this copy
            self._pending = threading.Thread(target=self._write, args=(state, parts.step), daemon=True)
            self._pending.start()
        else:
            self._write(state, parts.step)
            self._raise_pending_error()

    def save_and_stop(self, parts) -> int:
        """The last save of a stopped run, then the STOPPED marker for the launcher; no rank exits before
        rank 0 has written both. Returns the step the run stopped at (that of its last checkpoint).

        A stop ends with the last save if it is of this step or of the one before: a save in flight
        (checkpoint.async, or a stop that came during a blocking save) is waited for, never written twice,
        and a step trained since it is trained again after the resume. Otherwise this step is saved,
        blocking. Either way a stop costs at most one step and one save (README: the stop budget)."""
        if self.saved_step is not None and parts.step - self.saved_step <= 1:
            step = self.saved_step
        else:
            self.save(parts, blocking=True)
            step = parts.step
        if self.rank == 0:
            self.wait()
        dist.barrier()  # the checkpoint is complete: every node's marker says so
        self._mark_stopped(step)
        dist.barrier()
        return step

    def _write(self, state: dict, step: int) -> None:
        try:
            t = time.perf_counter()
            path = write_checkpoint(state, self.dir, step, {"rollback": self.rollback} if self.rollback else None)
            self._retain()
            self.log.info(f"saved {path} in {time.perf_counter() - t:.2f} s")
        except BaseException as e:  # reported by the training thread at the next save or at exit
            self._error = e

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"checkpoint save failed: {err}") from err

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        self._raise_pending_error()

    def _retain(self) -> None:
        """Keep the newest `keep` checkpoints and, with keep_every, every K-th step for good."""
        c = self.cfg.checkpoint
        ckpts = sorted((p for p in self.dir.iterdir() if NAME.match(p.name)), reverse=True)
        for p in ckpts[c.keep:]:
            step = int(NAME.match(p.name).group(1))
            if c.keep_every and step % c.keep_every == 0:
                continue
            p.with_suffix(".json").unlink(missing_ok=True)  # first: without it the .pt no longer counts
            p.unlink(missing_ok=True)

    # ---- resuming
    def find_resume(self) -> list[Path]:
        """Candidates to resume from, best first, per cfg.resume (rank 0).

        resume=PATH is where a new run starts. Once this run directory holds complete checkpoints of its
        own, the same command line relaunched (a requeue, a torchrun or pod restart) continues from them as
        resume=auto does, PATH last. A PATH inside this run directory rolls the run back to it, once: the
        saves after the rollback carry PATH in their .json, and a relaunch continues from those."""
        r = self.cfg.resume
        if r == "never":
            return []
        own = complete_checkpoints(self.dir)
        if r == "auto":
            return own
        p = Path(r)
        if _inside(p, self.cfg.run_dir) and p.resolve() not in (self.cfg.run_dir.resolve(), self.dir.resolve()):
            self.rollback = str(p.resolve().relative_to(self.cfg.run_dir.resolve()))
        try:
            targets = self._resume_targets(p)
        except ConfigError:
            if not own:
                raise
            targets = []  # PATH is gone, but this run no longer needs it
        if own and (self.rollback is None or any(_meta(c).get("rollback") == self.rollback for c in own)):
            self.log.info(f"resume={r}: this run directory holds checkpoints of its own (newest {own[0].name}), "
                          f"so this is a relaunch: continuing from them as resume=auto does, not from {r}")
            return own + [t for t in targets if t not in own]
        if self.rollback is not None:
            self.log.info(f"resume={r}: rolling this run back to it (its checkpoints after it are set aside)")
        else:
            self.log.info(f"resume={r}: a new run from it (the run directory holds no checkpoint of its own)")
        return targets

    @staticmethod
    def _resume_targets(p: Path) -> list[Path]:
        if p.is_file():
            return [p]
        for d in (p, p / "checkpoints"):
            if d.is_dir() and (found := complete_checkpoints(d)):
                return found
        raise ConfigError(f"resume: {p} is neither a checkpoint file nor a folder holding checkpoints")

    def resume(self, parts) -> bool:
        """Load the best complete checkpoint into parts; False when starting fresh."""
        if self.rank == 0:
            (self.cfg.run_dir / "STOPPED").unlink(missing_ok=True)
            if self.dir.is_dir():  # leftovers of a save that was killed: never counted
                for p in self.dir.glob(".*.tmp*"):
                    p.unlink(missing_ok=True)
        candidates, error = self._agreed_candidates()
        if error is not None:
            raise ConfigError(error)
        for path in candidates:
            t = time.perf_counter()
            try:
                state, problem = read_checkpoint(path), None
            except ValueError as e:
                state, problem = None, str(e)
            # Every rank resumes from the same checkpoint: one that any rank cannot read is skipped by all.
            unreadable = self._ranks_failing(problem is not None, parts.device)
            if unreadable:
                why = problem or f"cannot be read by rank(s) {', '.join(map(str, unreadable))}"
                self.log.warning(f"checkpoint {path} {why}; all ranks trying the previous one")
                continue
            self._load(parts, state, path, time.perf_counter() - t)
            self.resumed_from = path
            if self.rank == 0:
                self._set_aside_after(parts.step)
            return True
        if self.cfg.resume not in ("auto", "never"):
            raise ConfigError(f"resume: no loadable checkpoint at {self.cfg.resume}")
        return False

    def _set_aside_after(self, step: int) -> None:
        """Move this run's checkpoints after `step` (abandoned by a resume from it: a rollback, or a fall back
        past corrupt newer ones) to abandoned/<time>-resumed-at-step-<step>/, so that they are kept but no
        longer count: retention would otherwise delete each new save as it is written (they sort above it)
        and `latest` could name one of them."""
        if not self.dir.is_dir():
            return
        after = sorted(p for p in self.dir.iterdir() if (m := re.match(r"^step_(\d{8})\.(pt|json)$", p.name))
                       and int(m.group(1)) > step)
        if not after:
            return
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-resumed-at-step-{step}"
        for n in range(100):
            folder = self.dir / "abandoned" / (stamp if n == 0 else f"{stamp}.{n}")
            try:
                folder.mkdir(parents=True)
                break
            except FileExistsError:
                continue
        for p in sorted(after, key=lambda p: p.suffix != ".json"):  # each .json first: then its .pt never counts
            os.replace(p, folder / p.name)
        latest = self.dir / "latest"
        if latest.exists() and latest.read_text().strip() in {p.name for p in after}:
            if kept := complete_checkpoints(self.dir):
                _write_atomic(latest, lambda f: f.write(f"{kept[0].name}\n".encode()))
            else:
                latest.unlink()
        _fsync_dir(folder)
        _fsync_dir(self.dir)
        names = ", ".join(p.name for p in after if p.suffix == ".pt") or ", ".join(p.name for p in after)
        self.log.info(f"resumed at step {step}: this run's later checkpoints ({names}) are set aside in {folder}, "
                      f"kept but no longer counted (retention, `latest`, resume=auto)")

    def _agreed_candidates(self) -> tuple[list[Path], str | None]:
        """Rank 0's list of checkpoints to try (or its usage error), the same on every rank: a node with a
        stale listing of a shared folder must not pick another step."""
        found: list = [None, None]
        if self.rank == 0:
            try:
                found[0] = [str(p) for p in self.find_resume()]
            except ConfigError as e:
                found[1] = str(e)
        if self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return [Path(p) for p in found[0] or []], found[1]

    def _ranks_failing(self, failed: bool, device: torch.device) -> list[int]:
        """The ranks for which `failed` is true (every rank calls this)."""
        flags = torch.zeros(self.world_size, device=device)
        flags[self.rank] = float(failed)
        if self.world_size > 1:
            dist.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]

    def _load(self, parts, state: dict, path: Path, seconds: float) -> None:
        if (problem := _model_mismatch(parts.raw.state_dict(), state["model"])) is not None:
            raise ConfigError(f"checkpoint {path} does not match the model of this run{_task_diff(self.cfg, state)}: "
                              f"{problem}")
        was = state.get("config", {}).get("dist", {}).get("strategy", "ddp")
        if was != self.cfg.dist.strategy:  # the optimizer's state is keyed by parameter names under FSDP
            raise ConfigError(f"checkpoint {path} was trained with dist.strategy={was}: resume it with the same "
                              f"strategy (this run has dist.strategy={self.cfg.dist.strategy})")
        load_model_state(parts, state["model"], state["optimizer"])
        if parts.scaler.is_enabled() and not state["scaler"]:
            was = state.get("config", {}).get("train", {}).get("precision", "fp32/bf16")
            self.log.warning(f"checkpoint {path} was trained in {was} (no loss scaler): train.precision=fp16 "
                             f"starts a fresh GradScaler (scale {parts.scaler.get_scale():g})")
        else:
            parts.scaler.load_state_dict(state["scaler"])  # a disabled scaler (fp32, bf16) ignores it
        parts.step = int(state["step"])
        parts.eval_pending = bool(state.get("eval_pending", False))
        parts.stream.load_state_dict(state["data"])
        self.tracker_id = state.get("tracker", {}).get("run_id")
        if state["world_size"] == self.world_size:
            _set_rng_state(state["rng"][self.rank], parts.device)
            if "window" in state:  # this rank's loss sum since the last log step, bit for bit
                window = state["window"][self.rank]
                parts.window_loss.fill_(window["loss"])
                parts.window_steps = int(window["steps"])
        else:
            seen = state["step"] * self.cfg.train.global_batch_size
            self.log.warning(f"world size changed from {state['world_size']} to {self.world_size}: continuing "
                             f"after {seen} samples seen, but no longer bitwise identical to an uninterrupted run")
        self.log.info(f"resumed from {path} at step {parts.step} (epoch {parts.stream.epoch}, "
                      f"{parts.stream.samples_in_epoch} samples into it) in {seconds:.2f} s")
