"""Checkpointer: when to save, the save itself (blocking, or asynchronous in a writer thread of its own),
what to keep, and loading the checkpoint the resume decision chose (train/checkpoint/resume.py). It saves and
loads a TrainState (train/checkpoint/state.py) and nothing else of the trainer.

Layout, in <run_dir>/checkpoints/:
    step_00000100/           one checkpoint: a torch.distributed.checkpoint (DCP) folder
        __0_0.distcp, ...    the model's and optimizer's tensors, __<rank>_<n>.distcp: every rank writes (DCP
                             spreads DDP's replicated tensors over the ranks; FSDP's shards are each rank's own),
                             up to checkpoint.threads files at once
        .metadata            DCP's index of the tensors (rank 0)
        trainer.pt           the rest (rank 0): step, data position, each rank's RNG states and loss window,
                             the loss scaler, the optimizer's hyper-parameters, the config (weights_only)
        manifest.json        the size and CRC-32 of each file above, written last, by rank 0
    latest                   the name of the latest complete checkpoint
    abandoned/<time>-resumed-at-step-<N>/   checkpoints after step N, set aside by a resume from step N
A save goes to .step_00000100.tmp/: every rank writes and fsyncs its files, rank 0 adds the manifest once
all have, fsyncs, renames the folder into place, and only then moves `latest`. A process killed at any
point leaves the previous checkpoint intact; a folder without its manifest, or with a file that fails its
size or CRC, never counts. Loading runs no code from the files: DCP reads the tensors (its .metadata is
unpickled with a whitelist of DCP's own classes), torch.load(weights_only=True) the rest. A resume onto
another world size reshards on load (DCP). Checkpoints of this project before DCP (one step_00000100.pt
and its .json) are converted by `python -m train.checkpoint --convert RUN_DIR`; train/export.py writes
one plain file of a checkpoint's weights.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import threading
import time
from concurrent import futures
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import set_state_dict

from train import optim, relaunch
from train.checkpoint.dcp_io import (
    ASYNC_TYPE,
    BackgroundWriter,
    ChecksummedFiles,
    Reader,
    buffers_copied,
    error_text,
    merge,
    planner,
    rng_state,
    set_rng_state,
    stager_reusable,
    tensor_state,
    write_threads,
)
from train.checkpoint.memory import HostMemory, MemoryState
from train.checkpoint.resume import Decision, config_diff, shapes, shapes_of, state_mismatch
from train.checkpoint.state import TrainState
from train.checkpoint.storage import (
    FORMAT,
    MANIFEST,
    NAME,
    TRAINER,
    SaveError,
    complete_checkpoints,
    fsync_dir,
    inside,
    own_files,
    publish,
    remove,
    verify,
    write_atomic,
)
from train.config import Config, OptimConfig, to_dict
from train.errors import ConfigError
from train.parallel.distributed import sync_buffers


class Checkpointer:
    def __init__(self, cfg: Config, rank: int, world_size: int, log, per_node: int = 1):
        self.cfg, self.rank, self.world_size, self.log = cfg, rank, world_size, log
        self.dir = cfg.run_dir / "checkpoints"
        self.saved_step: int | None = None  # the step of the last save started in this process
        self.resumed_from: Path | None = None  # the checkpoint this process resumed from
        # With resume=PATH into this run's own directory (a rollback): PATH, relative to the run directory. It
        # goes into the manifest of every save, so that a relaunch knows the rollback is done (resume.decide).
        self.rollback: str | None = None
        self._pending: futures.Future | None = None  # a save being written in the background
        self._jobs: queue.SimpleQueue | None = None  # what the writer thread does (checkpoint.async)
        # DCP's collectives (and this module's during a save) run in a process group of their own: an
        # asynchronous save's never interleave with training's (gloo: DCP's are on host memory).
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.dist.timeout_s))
        self._error: BaseException | None = None
        self._removing: list[threading.Thread] = []  # deletions of checkpoints that retention let go
        self._stager: DefaultStager | None = None  # checkpoint.async's host copy, made the first time
        self._staging: futures.Future | None = None  # that copy being made, for the next optimizer step
        self._gate_handle = None  # the optimizer step's pre-hook that waits for it
        self.staging_wait_s = 0.0  # how long optimizer steps waited for it in all (bench/suite/checkpoint.py)
        self.tracker_id: str | None = None  # the experiment tracker's run id, kept across resumes
        self.changes: list[relaunch.Change] = []  # what this launch changes of the run it resumed (train/relaunch.py)
        self.fresh: list[str] = []  # the parameters trained here that the resumed checkpoint has no optimizer state of
        self.memory = HostMemory(cfg, rank, world_size, per_node, log, self._group)  # checkpoint.memory_every

    # ---- saving
    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint in the run (None: there is none)."""
        found = complete_checkpoints(self.dir)
        return int(NAME.match(found[0].name).group(1)) if found else None

    def save(self, state: TrainState, blocking: bool = False) -> None:
        """Called on every rank: every rank writes its share of the tensors (DCP); rank 0 the rest, then the
        manifest. With checkpoint.async (and not `blocking`), training goes on at once: DCP copies the
        tensors to host memory while the next step's forward and backward run (its optimizer step waits for
        the copy: _gate), and writes the files in the background, one save at a time."""
        self.saved_step = state.step
        mine = {"rng": rng_state(state.device),  # gathered to rank 0's trainer.pt by _write
                "window": {"loss": float(state.window_loss.item()), "steps": state.window_steps}}
        self.wait()  # the next save waits for the previous one
        # DCP writes each replicated tensor from one rank of its choosing: every rank holds rank 0's buffers
        # (BatchNorm statistics), those that DDP would give them at the start of the next forward anyway.
        sync_buffers(state.model)
        tensors, rest = tensor_state(state.model, state.optimizer, state.step)
        trainer = self._trainer(state) | {"rest": rest} if self.rank == 0 else None
        tmp = self.dir / f".step_{state.step:08d}.tmp"
        threads = write_threads(tensors, self.cfg.checkpoint.threads, self.world_size)
        background = self.cfg.checkpoint.async_ and not blocking
        writer = (BackgroundWriter if background else dcp.FileSystemWriter)(tmp, sync_files=True, thread_count=threads)
        writer.fs = ChecksummedFiles()
        if background:
            tensors["model"] = buffers_copied(tensors.get("model", {}), state.model)
            self._gate(state.optimizer)
            stager, self._staging, self._pending = self._host_copy(state.device), futures.Future(), futures.Future()
            job = (tensors, writer, stager, tmp, state.step, trainer, mine, self._staging, self._pending)
            self._writer_jobs(state.device).put(lambda: self._write_async(*job))
        else:
            write_tensors = lambda: dcp.save(tensors, storage_writer=writer, planner=planner(),  # noqa: E731
                                             process_group=self._group)
            self._write(write_tensors, tmp, state.step, trainer, mine, writer.fs)
            self._raise_pending_error()

    def _trainer(self, state: TrainState) -> dict:
        """trainer.pt less the ranks' own parts (their RNG states and loss windows) and the optimizer's rest."""
        return {
            "format": FORMAT,
            "scaler": state.scaler.state_dict(),
            "step": state.step,
            "data": state.data.state_dict() | {"seed": self.cfg.seed},
            "eval_pending": state.eval_pending,
            "world_size": self.world_size,
            "config": to_dict(self.cfg),
            "tracker": {"run_id": self.tracker_id},
        }

    def save_memory(self, state: TrainState) -> None:
        """A copy of the state into host memory (checkpoint.memory_every: train/checkpoint/memory.py), every rank."""
        sync_buffers(state.model)
        mine = {"rng": rng_state(state.device),
                "window": {"loss": float(state.window_loss.item()), "steps": state.window_steps}}
        self.memory.save(state, self._trainer(state), mine)

    def _writer_jobs(self, device: torch.device) -> queue.SimpleQueue:
        """This process's checkpoint writer: one daemon thread, started at the first asynchronous save and
        reused: a thread started per save costs the training thread its start (docs/dev/design-notes.md)."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()

            def work(jobs: queue.SimpleQueue = self._jobs) -> None:
                if device.type == "cuda":  # a new thread's current GPU is cuda:0, whatever its rank's
                    torch.cuda.set_device(device)
                for job in iter(jobs.get, None):
                    job()

            threading.Thread(target=work, daemon=True, name="checkpoint-writer").start()
        return self._jobs

    def _write_async(self, tensors: dict, writer, stager: DefaultStager, tmp: Path, step: int, trainer: dict | None,
                     mine: dict, staged: futures.Future, done: futures.Future) -> None:
        """checkpoint.async, in the writer thread: DCP's async_save copies the tensors to host memory here
        (the optimizer's next step waits for that: _gate), then writes them from DCP's own thread."""
        try:
            try:
                written = dcp.async_save(tensors, storage_writer=writer, planner=planner(), async_stager=stager,
                                         process_group=self._group, async_checkpointer_type=ASYNC_TYPE)
            finally:
                staged.set_result(None)
            self._write(written.result, tmp, step, trainer, mine, writer.fs)
        except BaseException as e:  # reported by the training thread at the next save or at exit
            self._error = e
        finally:
            done.set_result(None)

    def _host_copy(self, device: torch.device) -> DefaultStager:
        """What an asynchronous save copies the tensors into: host memory allocated at the first save and
        reused by every later one (pinned on a GPU; shared with DCP's process when it writes from one), at
        the cost of one more copy of this rank's state in host memory. A fresh allocation each save cost more
        than the copy itself (bench/suite/checkpoint.py). The copy runs in the writer thread while the next step's
        forward and backward run (_gate); on a GPU it is queued on the default stream, after the step.
        Where torch's stager cannot be reused (stager_reusable: torch 2.11's), a fresh one each save."""
        if self._stager is None or not stager_reusable():
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=device.type == "cuda",
                use_shared_memory=ASYNC_TYPE == dcp.state_dict_saver.AsyncCheckpointerType.PROCESS,
                use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def _gate(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the optimizer's next step wait until an asynchronous save's host copy is made: parameters and
        optimizer state change only there, so training blocks for the copy only where forward and backward
        did not cover it (buffers, which a forward changes, were copied before: buffers_copied)."""
        if self._gate_handle is None:
            self._gate_handle = optimizer.register_step_pre_hook(lambda *_: self._wait_for_staging())

    def _wait_for_staging(self) -> None:
        if self._staging is not None:
            t = time.perf_counter()
            futures.wait([self._staging])  # a failed copy is reported with the write's error (_write)
            self.staging_wait_s += time.perf_counter() - t
            self._staging = None

    def save_last(self, state: TrainState) -> int:
        """The last save of a stopped run, complete on this rank when this returns; the step the run stopped
        at (that of its last checkpoint).

        A stop ends with the last save if it is of this step or of the one before: a save in flight
        (checkpoint.async, or a stop that came during a blocking save) is waited for, never written twice,
        and a step trained since it is trained again after the resume. Otherwise this step is saved,
        blocking. Either way a stop costs at most one step and one save (docs/stops.md: the stop budget)."""
        if self.saved_step is not None and state.step - self.saved_step <= 1:
            step = self.saved_step
        else:
            self.save(state, blocking=True)
            step = state.step
        self.wait()
        return step

    def _write(self, write_tensors, tmp: Path, step: int, trainer: dict | None, mine: dict,
               fs: ChecksummedFiles) -> None:
        """Every rank: `write_tensors` (DCP's write of the tensors, or the wait for it), then its RNG states and
        loss window (`mine`) and the CRC-32s of its files to rank 0, which writes the rest (trainer.pt), the
        manifest and `latest` (publish). In checkpoint.async's thread, off the training thread's time."""
        try:
            t = time.perf_counter()
            write_tensors()
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, mine, group=self._group)
            try:
                if fs.failed is not None:
                    raise fs.failed
                if self.rank == 0:
                    trainer["rng"] = [r["rng"] for r in ranks]
                    trainer["window"] = [r["window"] for r in ranks]  # each rank's loss since the last log step
                    write_atomic(tmp / TRAINER, lambda f: torch.save(trainer, f))
                own = own_files(tmp, self.rank, fs.crcs)
            except OSError as e:  # still sent: no rank waits alone in the gather
                own = e
            files = [None] * self.world_size
            dist.all_gather_object(files, own, group=self._group)
            if failed := [f for f in files if isinstance(f, OSError)]:
                raise failed[0]
            if self.rank == 0:
                extra = {"world_size": self.world_size} | ({"rollback": self.rollback} if self.rollback else {})
                path = publish(self.dir, tmp, step, {k: v for f in files for k, v in f.items()}, extra)
                self._retain()
                self.log.info(f"saved {path} in {time.perf_counter() - t:.2f} s")
        except BaseException as e:  # reported by the training thread at the next save or at exit
            self._error = e

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise SaveError(f"checkpoint save failed: {error_text(err)}") from err

    def wait(self) -> None:
        """Until the save in flight (checkpoint.async) is complete and the checkpoints it replaced are
        deleted; raises its error."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self._staging = None
        while self._removing:
            self._removing.pop().join()
        self._raise_pending_error()

    def _retain(self) -> None:
        """Keep the newest `keep` checkpoints and, with keep_every, every K-th step for good."""
        c = self.cfg.checkpoint
        ckpts = sorted((p for p in self.dir.iterdir() if NAME.match(p.name)), reverse=True)
        for p in ckpts[c.keep:]:
            step = int(NAME.match(p.name).group(1))
            if c.keep_every and step % c.keep_every == 0:
                continue
            self._removing.append(remove(p, later=True))

    # ---- resuming
    @property
    def resumed_own(self) -> bool:
        """Whether this launch resumed this run's own state (its checkpoints, host memory), not another run's:
        also the case of a resume=PATH run relaunched, which continues from its own checkpoints."""
        path = self.resumed_from
        return path is not None and (isinstance(path, MemoryState) or inside(path, self.cfg.run_dir))

    def resume(self, state: TrainState, decision: Decision) -> bool:
        """Load the first of the decision's candidates that loads on every rank into `state`; False when starting
        fresh. What it does in each case is RESUME_CASES (train/checkpoint/resume.py)."""
        self.wait()  # this process's own save and deletions, if any, are done: what is left over is a killed one's
        if self.rank == 0:
            if self.dir.is_dir():  # leftovers of a save (or a removal) that was killed: never counted
                for p in self.dir.glob(".*.tmp*"):
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            if self.cfg.resume != "never":
                self.log.info(decision.line(self.cfg.resume))
        self.rollback, candidates = decision.rollback, decision.candidates
        failed: list[str] = []  # "step_00000020 <what is wrong with it>" of each that did not load
        # this run's model and optimizer, as DCP takes them
        tensors, rest = tensor_state(state.model, state.optimizer, state.step) if candidates else ({}, {})
        expected = {part: shapes_of(tensors.get(part, {})) for part in ("model", "optimizer")}
        ours = (rest.get("optimizer") or {}).get("param_groups") or []  # this launch's groups, parameters by name
        self.memory.run_id = decision.memory_id
        for path in candidates:
            t = time.perf_counter()
            if isinstance(path, MemoryState):
                if self._resume_memory(state, path, ours, t):
                    return True
                continue
            # Every rank resumes from the same checkpoint: one that any rank cannot read is skipped by all.
            if problem := self._agreed_problem(self._check(path)):
                self.log.warning(f"checkpoint {path} {problem}; all ranks trying the previous one")
                failed.append(f"{path.name} {problem}")
                continue
            trainer = torch.load(path / TRAINER, map_location="cpu", weights_only=True)
            # A relaunch (the run's own checkpoint) that changes a key its rule refuses: named before any tensor
            # is read, and nothing is written.
            saved = ((trainer.get("rest") or {}).get("optimizer") or {}).get("param_groups") or []
            self.changes = relaunch.changes(trainer.get("config") or {}, self.cfg) + relaunch.group_changes(saved,
                                                                                                            ours)
            # A parameter frozen since the save has optimizer state there that nothing reads; one trained again has
            # none there: it starts afresh (a checkpoint that records no groups: neither)
            then = _trained(saved if saved else ours)
            self.fresh, dropped = sorted(_trained(ours) - then), then - _trained(ours)
            if inside(path, self.cfg.run_dir) and (line := relaunch.refusal(self.changes, self.cfg.run_dir, None)):
                raise ConfigError(line)
            metadata = Reader(path).read_metadata()
            # A checkpoint of another model or optimizer is no damage to fall back from: the same config
            # meets the same mismatch in every checkpoint of the run. It is named, and nothing is trained.
            theirs = {"model": shapes(metadata, "model"),
                      "optimizer": _without(shapes(metadata, "optimizer"), dropped)}
            mine = {"model": expected["model"], "optimizer": _without(expected["optimizer"], set(self.fresh))}
            for part, section in (("model", "task"), ("optimizer", "optim")):
                if (mismatch := state_mismatch(mine[part], theirs[part])) is not None:
                    raise ConfigError(f"checkpoint {path} does not match the {part} of this run"
                                      f"{config_diff(self.cfg, trainer, section)}: {mismatch}; relaunch with "
                                      f"the {section}.* settings it was trained with, or start afresh with a new "
                                      f"run.name")
            if problem := self._agreed_problem(self._load_tensors(state, path, trainer)):
                self.log.warning(f"checkpoint {path} {problem}; all ranks trying the previous one")
                failed.append(f"{path.name} {problem}")
                continue
            self._load(state, trainer, path, time.perf_counter() - t)
            self.resumed_from = path
            if self.rank == 0:
                self._set_aside_after(state.step)
            return True
        if self.cfg.resume not in ("auto", "never"):
            raise ConfigError(f"resume: no loadable checkpoint at {self.cfg.resume}"
                              + (f" ({failed[0]})" if failed else ""))
        if failed:  # resume=auto: the run has checkpoints and none loads. Training from step 0 would lose them.
            more = f" (and {len(failed) - 1} more that do not load either)" if len(failed) > 1 else ""
            raise ConfigError(f"resume=auto: no checkpoint of this run loads: {failed[0]}{more}. Nothing was "
                              f"trained and every checkpoint is left as it is: fix what changed since they were "
                              f"written (the Python or torch version, the config, a run directory that every "
                              f"node must share), resume from another with resume=PATH, or start afresh with a "
                              f"new run.name")
        return False

    def _check(self, path: Path) -> str | None:
        """What is wrong with a checkpoint, from this rank's share of its files (None: nothing)."""
        try:
            verify(path, self.rank, self.world_size)
            torch.load(path / TRAINER, map_location="cpu", weights_only=True)
            Reader(path).read_metadata()
        except ValueError as e:
            return str(e)
        except Exception as e:  # a file that passes its CRC but does not load is corrupt all the same
            return f"does not load ({error_text(e)})"
        return None

    def _load_tensors(self, state: TrainState, path: Path, trainer: dict) -> str | None:
        """DCP's load of the model and optimizer (every rank reads what it holds: a reshard when the world
        size or the sharding changed); what went wrong, or None."""
        tensors, rest = tensor_state(state.model, state.optimizer, state.step)  # the shapes to read into
        fresh = set(self.fresh)
        try:
            # A parameter trained again (frozen in the checkpoint) keeps the state this optimizer made for it
            optimizer = tensors.get("optimizer", {})
            wanted = tensors | {"optimizer": optimizer | {"state": {
                k: v for k, v in optimizer.get("state", {}).items() if k not in fresh}}} if fresh else tensors
            dcp.load(wanted, storage_reader=Reader(path), process_group=self._group)
            self._set_state(state, tensors, trainer["rest"], rest, fresh)
        except (Exception, CheckpointException) as e:
            return f"does not load ({error_text(e)})"
        return None

    @staticmethod
    def _set_state(state: TrainState, tensors: dict, saved_rest: dict, rest: dict, fresh: set[str]) -> None:
        """The loaded tensors and the checkpoint's rest into the model and optimizer."""
        loaded = merge(tensors, saved_rest)
        # This launch's groups, parameters by name (torch matches the saved state to them by name): the
        # checkpoint's may be others (Task.param_groups, requires_grad changed; said in _load), and this
        # launch's optim.* values and kernels apply, not the checkpoint's.
        if "optimizer" in rest:
            loaded["optimizer"]["param_groups"] = rest["optimizer"]["param_groups"]
        with optim.own_settings(state.optimizer):
            set_state_dict(state.model, state.optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optimizer"])
        optim.start_afresh(state.optimizer, state.model, fresh)

    def _resume_memory(self, state: TrainState, candidate: MemoryState, ours: list, t: float) -> bool:
        """A state in host memory (resume.with_memory chose it), on every rank: loaded, or False (all ranks try
        the disk's next). Its changes are a relaunch's: a refused one stops the start as from disk."""
        problem, loaded = None, None
        try:
            loaded = self.memory.load(state, candidate)
        except (Exception, CheckpointException) as e:
            problem = f"does not load ({error_text(e)})"
        if problem := self._agreed_problem(problem):
            self.log.warning(f"{candidate} {problem}; all ranks trying the disk's checkpoints")
            return False
        trainer = loaded["trainer"]
        saved = ((trainer.get("rest") or {}).get("optimizer") or {}).get("param_groups") or []
        self.changes = relaunch.changes(trainer.get("config") or {}, self.cfg) + relaunch.group_changes(saved, ours)
        if line := relaunch.refusal(self.changes, self.cfg.run_dir, None):
            raise ConfigError(line)
        self._set_state(state, loaded["tensors"], trainer["rest"], loaded["rest"], set())
        self._load(state, trainer, candidate, time.perf_counter() - t)
        self.resumed_from = candidate
        if self.rank == 0:
            self._set_aside_after(state.step)
        return True

    def _set_aside_after(self, step: int) -> None:
        """Move this run's checkpoints after `step` (abandoned by a resume from it: a rollback, or a fall back
        past corrupt newer ones), and any step folder without its manifest (no save of this project: a copy), to
        abandoned/<time>-resumed-at-step-<step>/, so that they are kept but no longer count: retention would
        otherwise delete each new save as it is written (they sort above it) and `latest` could name one of them."""
        if not self.dir.is_dir():
            return
        after = sorted(p for p in self.dir.iterdir()
                       if (m := NAME.match(p.name)) and (int(m.group(1)) > step or not (p / MANIFEST).exists()))
        if not after:
            return
        what = "this run's later checkpoints" if all((p / MANIFEST).exists() for p in after) else \
            "this run's later checkpoints and its step folders without a manifest"
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-resumed-at-step-{step}"
        for n in range(100):
            folder = self.dir / "abandoned" / (stamp if n == 0 else f"{stamp}.{n}")
            try:
                folder.mkdir(parents=True)
                break
            except FileExistsError:
                continue
        for p in after:  # a folder's rename is atomic: it counts where it was, or not at all
            os.replace(p, folder / p.name)
        latest = self.dir / "latest"
        if latest.exists() and latest.read_text().strip() in {p.name for p in after}:
            if kept := complete_checkpoints(self.dir):
                write_atomic(latest, lambda f: f.write(f"{kept[0].name}\n".encode()))
            else:
                latest.unlink()
        fsync_dir(folder)
        fsync_dir(self.dir)
        names = ", ".join(p.name for p in after)
        self.log.info(f"resumed at step {step}: {what} ({names}) are set aside in {folder}, kept but no longer "
                      f"counted (retention, `latest`, resume=auto)")

    def _agreed_problem(self, problem: str | None) -> str | None:
        """The first rank's problem with a checkpoint, the same on every rank (None: no rank has one)."""
        problems = [problem]
        if self.world_size > 1:
            problems = [None] * self.world_size
            dist.all_gather_object(problems, problem)
        for rank, p in enumerate(problems):
            if p is not None:
                return p + (f" (rank {rank})" if self.world_size > 1 else "")
        return None

    def _load(self, train_state: TrainState, state: dict, path: Path, seconds: float) -> None:
        """The rest of the run's state (trainer.pt: `state`), after the tensors."""
        ts = train_state
        if ts.scaler.is_enabled() and not state["scaler"]:
            was = state.get("config", {}).get("train", {}).get("precision", "fp32/bf16")
            self.log.warning(f"checkpoint {path} was trained in {was} (no loss scaler): train.precision=fp16 "
                             f"starts a fresh GradScaler (scale {ts.scaler.get_scale():g})")
        else:
            ts.scaler.load_state_dict(state["scaler"])  # a disabled scaler (fp32, bf16) ignores it
        ts.step = int(state["step"])
        ts.eval_pending = bool(state.get("eval_pending", False))
        data_state = state["data"]
        own = isinstance(path, MemoryState) or inside(path, self.cfg.run_dir)
        other_data = relaunch.data_changed(self.changes) or (not own and any(c.key == "task.name" for c in
                                                                             self.changes))
        if other_data:
            # The position in the old data (its epoch, the samples read) means nothing in the new data
            what = ", ".join(map(str, relaunch.data_changed(self.changes))) or "another task"
            self.log.info(f"the data changed ({what}): training goes on from step {ts.step} at the new data's "
                          f"beginning")
        elif data_state.get("seed", self.cfg.seed) != self.cfg.seed and not own:
            # A new run from another run's checkpoint (a fine-tune) may choose its own seed; a relaunch of this
            # run may not (TrainStream refuses it): the rest of its epoch would follow another permutation.
            self.log.warning(f"a new run from {path}, trained with seed={data_state['seed']}: from its data "
                             f"position on, this run's seed={self.cfg.seed} orders the data")
            data_state = data_state | {"seed": self.cfg.seed}
        if not other_data:
            ts.data.load_state_dict(data_state)
        self.tracker_id = state.get("tracker", {}).get("run_id")
        if state["world_size"] == self.world_size:
            set_rng_state(state["rng"][self.rank], ts.device)
            if "window" in state:  # this rank's loss sum since the last log step, bit for bit
                window = state["window"][self.rank]
                ts.window_loss.fill_(window["loss"])
                ts.window_steps = int(window["steps"])
        else:
            seen = state["step"] * self.cfg.train.global_batch_size
            self.log.warning(f"world size changed from {state['world_size']} to {self.world_size}: continuing "
                             f"after {seen} samples seen, but no longer bitwise identical to an uninterrupted run")
        self.log.info(f"resumed from {path} at step {ts.step} (epoch {ts.data.epoch}, "
                      f"{ts.data.samples_in_epoch} samples into it) in {seconds:.2f} s")
        if line := schedule_change(self.cfg, state.get("config") or {}, ts.step):
            self.log.info(line)
        if own and ts.step < self.cfg.train.steps and (line := relaunch.applied_line(self.changes, ts.step)):
            self.log.info(line)
        if self.fresh:
            names = ", ".join(self.fresh[:3]) + (f" and {len(self.fresh) - 3} more" if len(self.fresh) > 3 else "")
            self.log.info(f"optimizer state starts afresh for {names}: frozen in {path}, which holds none")


def _trained(groups: list[dict]) -> set[str]:
    """The names of the parameters in an optimizer state dict's param groups."""
    return {n for g in groups for n in g.get("params", [])}


def _without(found: dict, params: set[str]) -> dict:
    """{name: shape} of an optimizer's tensors ("state.<parameter>.<key>", "param_groups...") less the state of
    `params`."""
    if not params:
        return found
    return {k: v for k, v in found.items()
            if not (k.startswith("state.") and k[len("state."):].rpartition(".")[0] in params)}


def schedule_change(cfg: Config, theirs: dict, step: int) -> str | None:
    """The one line a relaunch with a changed train.steps or optim.* value logs: what changed, and the
    learning rate from here on (the schedule is a function of the step and these keys: optim.lr_at)."""
    ours = to_dict(cfg)
    changed = [(f"optim.{k}", v, ours["optim"].get(k)) for k, v in (theirs.get("optim") or {}).items()
               if k in ours["optim"] and ours["optim"][k] != v]
    if (theirs.get("train") or {}).get("steps", cfg.train.steps) != cfg.train.steps:
        changed.insert(0, ("train.steps", theirs["train"]["steps"], cfg.train.steps))
    if not changed:
        return None
    what = ", ".join(f"{key} {old} -> {new}" for key, old, new in changed)
    if step >= cfg.train.steps:
        return f"relaunch with {what}: the run already has {step} of train.steps={cfg.train.steps}; nothing to train"
    try:
        before = optim.lr_at(step, theirs["train"]["steps"], OptimConfig(**theirs["optim"]))
        was = f" (the checkpoint's schedule: {before:.4g})"
    except (KeyError, TypeError):  # a checkpoint of keys this version no longer has
        was = ""
    now = optim.lr_at(step, cfg.train.steps, cfg.optim)
    end = cfg.optim.lr * cfg.optim.min_lr_ratio
    warm = (f"warming up to {cfg.optim.lr:.4g} at step {cfg.optim.warmup_steps}, then "
            if step < cfg.optim.warmup_steps else "")
    return (f"relaunch with {what}: applied from step {step}; the learning rate is {now:.4g} there{was}, "
            f"{warm}decaying (cosine) to {end:.4g} at step {cfg.train.steps}")
