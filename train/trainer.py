"""Build the parts, resume, and train: one optimizer step = `accum` micro-batches on every rank."""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import math
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from train import optim
from train.checkpoint import pretrained
from train.checkpoint.checkpointer import Checkpointer
from train.checkpoint.dcp_io import error_text, error_traceback, first_error
from train.checkpoint.resume import check_fresh_start, decide
from train.checkpoint.storage import SaveError
from train.config import Config, ConfigError
from train.errors import EXIT_REQUEUE, say
from train.observe.log import RunLog, check_tracker
from train.observe.metrics import StepMeter
from train.parallel import data, distributed, hang, host_memory, wrapping
from train.parallel.data import to_device
from train.stops import markers
from train.stops.markers import Markers
from train.stops.signals import StopRequest
from train.task import Task, collate_fn


@dataclass
class Parts:
    """What fit() works on, built once by the entry point."""

    cfg: Config
    task: Task  # the user's model, data, loss and metrics (train/task.py)
    device: torch.device
    world_size: int
    raw: nn.Module  # the model: what checkpoints hold and evaluation runs (under FSDP: sharded in place)
    wrapped: nn.Module  # DDP(raw), or raw itself under FSDP and in one process (train/parallel/wrapping.py)
    step_loss: Callable[[object], torch.Tensor]  # batch -> the task's loss of `wrapped` (compiled: train.compile)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    stream: object  # data.TrainStream
    eval_loader: torch.utils.data.DataLoader
    log: RunLog
    stop: StopRequest  # whether the ranks agreed to stop (a signal to any of them)
    markers: Markers  # how this launch ends, for the launcher (train/stops/markers.py)
    step: int = 0  # optimizer steps done
    # Trainer counters that a checkpoint carries, so that a resumed run logs what an uninterrupted one does:
    window_loss: torch.Tensor | None = None  # this rank's loss sum since the last log step (float32)
    window_steps: int = 0  # steps in that sum
    eval_pending: bool = False  # an evaluation was due at `step` but a stop came first: done after resume
    saving: bool = False  # a save of `step` is under way (an error in it is told as the save's, not a step's)
    loads: frozenset[str] = frozenset()  # the model's tensors given memory only: a checkpoint or init_from fills them
    watched: frozenset[str] = frozenset()  # the floating buffers finite at the start, which check_weights watches


def autocast(cfg: Config, device: torch.device):
    p = cfg.train.precision
    return torch.autocast(device.type, dtype=wrapping.DTYPES[p], enabled=p != "fp32")


@torch.no_grad()
def evaluate(parts: Parts, ckpt: Checkpointer) -> dict[str, float] | None:
    """The task's metrics over the whole evaluation set: each rank takes a shard, sums are all-reduced.

    Returns None when a stop was agreed first: the ranks agree between batches, so a stop never waits
    for a long evaluation (shards differ by a batch at most; every rank takes the same number of turns)."""
    model = parts.raw
    # Every rank evaluates with rank 0's buffers (BatchNorm statistics), the ones a checkpoint holds (DDP
    # would broadcast them at the next forward anyway): the result does not depend on the world size.
    distributed.sync_buffers(model)
    turns = int(distributed.all_reduce_max(len(parts.eval_loader), parts.device))
    batches = iter(parts.eval_loader)
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    last = None
    try:
        for _ in range(turns):
            if parts.stop.agreed(parts.device):
                return None
            if (batch := next(batches, None)) is None:
                if wrapping.sharded(model):  # every rank's forward all-gathers: run one, not counted
                    with autocast(parts.cfg, parts.device):
                        parts.task.eval_step(model, last)
                continue
            last = to_device(parts, batch)
            with autocast(parts.cfg, parts.device):
                out = parts.task.eval_step(model, last)
            for k, v in out.items():
                v = v.detach().double() if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
                sums[k] = sums.get(k, 0) + v.to(parts.device)
    finally:
        model.train()
        wrapping.reshard(model)  # FSDP: the root's gathered parameters (embeddings, heads) are freed, not kept
    # Every rank has a batch (loaders() checks it), so every rank has the same keys in the same order.
    keys = list(sums)
    totals = dict(zip(keys, distributed.all_reduce_sum([sums[k].item() for k in keys], parts.device), strict=True))
    count = totals.pop("count", None)
    if not count:
        raise ConfigError(f"task {parts.cfg.task_name}: eval_step() must return a \"count\" > 0 with its sums")
    means = parts.task.summarize({k: v / count for k, v in totals.items()})
    return {f"eval_{k}": float(v) for k, v in means.items()}


def train_step(parts: Parts, batches, sizes: list[int], meter: StepMeter) -> torch.Tensor:
    """One optimizer step over micro-batches of `sizes` samples; returns the mean loss of this rank's share
    of the step (a tensor: no sync)."""
    cfg = parts.cfg
    optim.set_lr(parts.optimizer, optim.lr_at(parts.step, cfg.train.steps, cfg.optim))
    total = None
    accum, share, uneven = len(sizes), sum(sizes), len(set(sizes)) > 1
    for micro, size in enumerate(sizes):
        with meter.waiting_for_data():
            batch = next(batches)
        batch = to_device(parts, batch)
        # Only the last micro-step all-reduces (DDP) or reduce-scatters (FSDP); the others accumulate locally.
        sync = contextlib.nullcontext() if micro == accum - 1 else wrapping.no_sync(parts.wrapped)
        with sync, meter.computing():
            loss = parts.step_loss(batch)
            if not (torch.is_tensor(loss) and loss.dim() == 0):
                raise ConfigError(f"task {cfg.task_name}: loss() must return a scalar tensor, got "
                                  f"{type(loss).__name__}{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
            # Each micro-batch's mean loss weighted by its samples: the step's gradient is the mean over the share
            # (equal micro-batches: the same weight, 1 / accum, written as the division it always was: bitwise; one
            # micro-batch: no division, whose x / 1 is x, and its two kernels, forward and backward, go).
            if uneven:
                loss = loss * (size / share)
            elif accum > 1:
                loss = loss / accum
            parts.scaler.scale(loss).backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
    if cfg.train.grad_clip > 0:
        parts.scaler.unscale_(parts.optimizer)  # clip true gradients, not scaled ones
        nn.utils.clip_grad_norm_(parts.raw.parameters(), cfg.train.grad_clip)  # FSDP: over all shards
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.step += 1
    return total


def _micro_steps(sizes: list[int]) -> str:
    """'2 micro-batches of 12 samples', '3 micro-batches of 11, 11 and 10 samples'."""
    n = len(sizes)
    if len(set(sizes)) == 1:
        return f"{n} micro-batch{'es' if n > 1 else ''} of {sizes[0]} sample{'s' if sizes[0] > 1 else ''}"
    return f"{n} micro-batches of {', '.join(map(str, sizes[:-1]))} and {sizes[-1]} samples"


def ranks_in_sync(parts: Parts) -> bool:
    """Whether every rank holds bitwise the same parameters and buffers (BatchNorm statistics): DDP's
    promise for the first, evaluate()'s for the second; a cheap end-of-run check. Under FSDP each rank
    holds only its shard of each parameter, which is no copy of another rank's: the check is about the
    buffers (gathering the shards to compare would put the whole model on every rank)."""
    h = hashlib.sha256()
    for t in [*parts.raw.parameters(), *parts.raw.buffers()]:
        if not hasattr(t, "to_local"):  # a DTensor (FSDP's shard) is left out
            h.update(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    digests = [None] * parts.world_size
    torch.distributed.all_gather_object(digests, h.hexdigest())
    return len(set(digests)) == 1


def fit(parts: Parts, ckpt: Checkpointer, meter: StepMeter) -> dict | None:
    """Train to cfg.train.steps, logging, checkpointing and evaluating on the way.

    Returns the run's summary, or None when a stop signal ended it early (after a checkpoint)."""
    cfg, log = parts.cfg, parts.log
    sizes = parts.stream.sizes
    batches = iter(parts.stream)
    start_step, t_start = parts.step, time.perf_counter()
    parts.raw.train()
    if parts.eval_pending and parts.step < cfg.train.steps and log.evaluated(parts.step):
        parts.eval_pending = False  # resumed from a checkpoint saved before its evaluation, which was logged
    meter.start()
    while parts.step < cfg.train.steps:
        if parts.eval_pending and _evaluate_and_log(parts, ckpt, meter) is None:
            return _stop(parts, ckpt)  # the evaluation a stop pre-empted, run before the next step
        parts.window_loss += train_step(parts, batches, sizes, meter)
        parts.window_steps += 1
        meter.step_done()
        step = parts.step
        log.advance(step)
        logs = step % cfg.train.log_every == 0 or step == cfg.train.steps
        if logs:
            # The window may have begun before a resume: its sum and length come from the checkpoint.
            loss_sum, n = distributed.all_reduce_sum([parts.window_loss.item(), parts.window_steps], parts.device)
            log.train({"step": step, "epoch": parts.stream.epoch, "loss": loss_sum / n,
                       "lr": parts.optimizer.param_groups[0]["lr"]} | meter.window())
            if not math.isfinite(loss_sum) and cfg.train.precision != "fp16":  # (fp16: the GradScaler's skipped steps)
                raise diverged(parts, ckpt, f"the training loss of steps {step - parts.window_steps + 1}-{step} is "
                                          f"{loss_sum / n}")
            parts.window_loss.zero_()
            parts.window_steps = 0
        parts.eval_pending = bool(cfg.train.eval_every and step % cfg.train.eval_every == 0)
        # The stop is agreed before any evaluation, so that it never waits for one. Only where this step waits
        # for the device anyway (a log, an evaluation, a save) or follows a save (a stop in it ends with that
        # save) is the agreement waited for; elsewhere the host runs on and the stop lands a step later (one process
        # has nobody to agree with: its stop lands at once, StopRequest.agreed).
        now = logs or parts.eval_pending or ckpt.due(step) or ckpt.saved_step == step - 1
        if parts.stop.agreed(parts.device, now=now):
            return _stop(parts, ckpt)
        if ckpt.due(step):
            with meter.paused():
                _checked_save(parts, ckpt, ckpt.save)
            if parts.stop.agreed(parts.device):  # a stop that came during the save ends with it
                return _stop(parts, ckpt)
        if parts.eval_pending and step < cfg.train.steps:
            if _evaluate_and_log(parts, ckpt, meter) is None:
                return _stop(parts, ckpt)
    # The end (also reached by a relaunch whose last checkpoint is the final step): the final evaluation.
    parts.eval_pending = True
    if (result := _evaluate_and_log(parts, ckpt, meter)) is None:
        return _stop(parts, ckpt)
    wall = time.perf_counter() - t_start
    return {"steps": parts.step, "world_size": parts.world_size, "train_loss": log.last_train_loss, **result,
            "samples_per_s": (parts.step - start_step) * cfg.train.global_batch_size / max(wall, 1e-9),
            "wall_s": wall, "ranks_in_sync": ranks_in_sync(parts),
            "global_batch_size": cfg.train.global_batch_size, "precision": cfg.train.precision}


def _checked_save(parts: Parts, ckpt: Checkpointer, save: Callable[[Parts], object]) -> object:
    """`save(parts)` (a checkpoint's, or a stop's last) after check_weights; `parts.saving` meanwhile, left set if it
    raises: out_of_memory tells an error in it as the save's."""
    parts.saving = True
    check_weights(parts, ckpt)
    result = save(parts)
    parts.saving = False
    return result


def check_weights(parts: Parts, ckpt: Checkpointer) -> None:
    """Before a save: weights or buffers (BatchNorm's statistics, which one overflowed forward makes inf for good,
    also under fp16's GradScaler) that turned NaN or inf end the run with one line, never saved over the good
    checkpoints that retention would then delete. Every rank sums each of its tensors (FSDP: its shards) on the
    device, at saves only: a NaN or an inf makes the sum one; all ranks agree."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in parts.raw.parameters()]
    tensors += [b for name, b in parts.raw.named_buffers() if name in parts.watched]
    tensors = [t for t in tensors if t.is_floating_point() and t.numel()]
    bad = (~_finite_each(tensors)).sum() if tensors else torch.zeros((), device=parts.device)
    bad = bad.to(device=parts.device, dtype=torch.float32)
    torch.distributed.all_reduce(bad)
    if bad.item():
        raise diverged(parts, ckpt, f"the model's weights or buffers hold NaN or inf after step {parts.step}")


def finite_buffers(model: nn.Module) -> frozenset[str]:
    """The names of the model's floating buffers that hold no NaN or inf now: the ones check_weights watches (a
    buffer that starts non-finite, an attention mask of -inf, is the model's own)."""
    named = [(name, b) for name, b in model.named_buffers() if b.is_floating_point() and b.numel()]
    if not named:
        return frozenset()
    finite = _finite_each([b for _, b in named]).tolist()
    return frozenset(name for (name, _), ok in zip(named, finite, strict=True) if ok)


def _finite_each(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether each tensor holds no NaN or inf, one bool a tensor on their device: its float32 sum is finite (one
    reduction a tensor, no mask the size of each)."""
    return torch.stack([t.detach().sum(dtype=torch.float32) for t in tensors]).isfinite()


def diverged(parts: Parts, ckpt: Checkpointer, what: str) -> ConfigError:
    """The line of a run whose training diverged: nothing is saved from here on, a relaunch resumes from the last
    checkpoint (a usage error: with the same settings it would diverge again, so no launcher retries it)."""
    cfg, o = parts.cfg, parts.cfg.optim
    last = ckpt.saved_step if ckpt.saved_step is not None else ckpt.latest_step()
    fixes = [f"lower optim.lr (now {o.lr:g})", f"raise optim.warmup_steps (now {o.warmup_steps})"]
    if cfg.train.grad_clip <= 0:
        fixes.append("clip the gradients (train.grad_clip=1.0)")
    if cfg.train.precision == "fp16":
        fixes.append("train in bf16 or fp32 rather than fp16")
    start = (f"which resumes from the checkpoint of step {last}" if last is not None
             else "which starts again from step 0 (no checkpoint was saved yet)")
    return ConfigError(f"training diverged: {what}, and nothing is saved from it; {', '.join(fixes[:-1])} or "
                       f"{fixes[-1]}, then relaunch, {start}")


def _evaluate_and_log(parts: Parts, ckpt: Checkpointer, meter: StepMeter) -> dict[str, float] | None:
    with meter.paused():
        result = evaluate(parts, ckpt)
    if result is not None:
        parts.eval_pending = False
        parts.log.eval({"step": parts.step} | result)
    return result


def _stop(parts: Parts, ckpt: Checkpointer) -> None:
    step = _checked_save(parts, ckpt, ckpt.save_last)  # blocking: complete on this rank
    torch.distributed.barrier()  # complete on every rank: now every node's marker may say so
    parts.markers.stopped(step, parts.stop.signal)
    torch.distributed.barrier()  # no rank exits before every node's marker is written
    if step != parts.step:
        note = f" (the save of step {step} was the last; step {parts.step} is trained again after the resume)"
    else:
        note = " (its evaluation runs after the resume)" if parts.eval_pending else ""
    parts.log.info(f"stopped on {parts.stop.signal or 'a peer rank signal'} at step {step}, checkpoint saved{note}")
    return None


def configure_torch(cfg: Config) -> None:
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
    torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    torch.backends.cudnn.benchmark = not cfg.train.deterministic
    if cfg.train.deterministic:
        # cuBLAS is deterministic only with a fixed workspace (torch refuses its matmuls otherwise); read when
        # its first handle is made, after this. A value the user set stays.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def build(cfg: Config, denv: distributed.DistEnv, device: torch.device) -> Parts:
    if cfg.dist.strategy == "fsdp":
        host_memory.return_freed_memory()  # each step's gathered blocks, freed, go back: train/parallel/host_memory.py
    task = cfg.task_class(cfg.task, cfg.seed)
    train_set, eval_set = task.datasets()
    stream, eval_loader = data.loaders(cfg, train_set, eval_set, denv.rank, denv.world_size, device.type == "cuda",
                                       collate_fn(task, cfg.task_name))
    if cfg.dist.sync_bn and device.type != "cuda":
        raise ConfigError("dist.sync_bn needs CUDA GPUs (torch's SyncBatchNorm); on CPU use a GroupNorm "
                          "(task.norm=group for the built-in ResNets)")
    raw = task.model()
    if not isinstance(raw, nn.Module):
        raise ConfigError(f"task {cfg.task_name}: model() must return a torch.nn.Module, got {type(raw).__name__}")
    check_fresh_start(cfg)  # resume=never never overwrites an earlier run
    log = RunLog(cfg.run_dir, denv, cfg, unit=task.unit)  # only now: a config or data error leaves nothing behind
    if cfg.dist.sync_bn:
        raw = nn.SyncBatchNorm.convert_sync_batchnorm(raw)
    meta = wrapping.on_meta(raw)  # built on the meta device: no memory until it is sharded (FSDP) or wrapped
    loads = frozenset(_loaded_whole(cfg, task, raw, denv) if meta else ())
    if not meta:
        raw = raw.to(device)
    elif cfg.dist.strategy == "ddp":
        wrapping.materialize(raw, task, device, cfg.seed, skip=loads)
    if cfg.train.channels_last:
        raw = raw.to(memory_format=torch.channels_last)
    wrapped = wrapping.wrap(cfg, task, raw, device)  # DDP, or FSDP2 sharding raw in place
    if meta and cfg.dist.strategy == "fsdp":
        wrapping.materialize(raw, task, device, cfg.seed, skip=loads)  # each rank's shards only
    step_loss = step_loss_fn(cfg, task, wrapped, device)
    # The weights are made: from here each rank draws numbers of its own (dropout masks, a user's random
    # augmentation), as different samples on different GPUs should; a resume restores each rank's states.
    rank_seed = cfg.seed + 1_000_003 * (denv.rank + 1)
    random.seed(rank_seed)
    np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    return Parts(cfg=cfg, task=task, device=device, world_size=denv.world_size, raw=raw, wrapped=wrapped,
                 step_loss=step_loss, optimizer=optim.build(cfg.optim, raw, scaler.is_enabled()), scaler=scaler,
                 stream=stream, eval_loader=eval_loader, log=log,
                 stop=StopRequest(cfg.checkpoint.signal), markers=Markers(cfg.run_dir, denv.rank),
                 window_loss=torch.zeros((), device=device), loads=loads)


def step_loss_fn(cfg: Config, task: Task, wrapped: nn.Module, device: torch.device) -> Callable[[object], torch.Tensor]:
    """batch -> task.loss(wrapped, batch) under autocast. train.compile compiles the model and the loss together:
    the output layer's softmax and casts fuse with it (GPT-2 124M on an H200: 482,717 tokens/s against 433,731
    with the model alone compiled, bench/gpu_check.py's gpt stage). Under DDP the DDP module itself is compiled
    and the loss runs eagerly: torch splits a compiled DDP forward at its gradient buckets, so that their
    all-reduce overlaps the backward."""
    compiled = cfg.train.compile
    model = torch.compile(wrapped) if compiled and wrapping.replicated(wrapped) else wrapped

    def step_loss(batch):
        with autocast(cfg, device):
            return task.loss(model, batch)

    return torch.compile(step_loss) if compiled and model is wrapped else step_loss


def _loaded_whole(cfg: Config, task: Task, model: nn.Module, denv: distributed.DistEnv) -> set[str]:
    """The tensors of the meta-built `model` that this launch overwrites whole before the first step: all that
    a checkpoint holds where the run resumes one (rank 0's view of the run's checkpoints: the same on every
    rank), else those that init_from's files hold; their random init would be drawn for nothing."""
    found = [False]
    if denv.rank == 0:
        try:
            found[0] = bool(decide(cfg).candidates)
        except ConfigError:
            pass  # the resume says it, in one line
    if denv.world_size > 1:
        torch.distributed.broadcast_object_list(found, src=0)
    if found[0]:  # a resume loads every tensor of the model's state, or stops the launch
        return set(model.state_dict().keys())
    source = task.init_from()
    return pretrained.covers(model, task, source) if source else set()


FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no room: a full disk, a quota, a file size limit
UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


def save_failed(e: SaveError, cfg: Config, log: RunLog | None) -> str:
    """A failed save's line: what failed, and what to do about that. Only a full disk is told to make room and
    only an unwritable folder to fix it; any other error (a bug of the save itself, say) names itself, and its
    traceback goes to the rank's log file."""
    cause = first_error(e.__cause__ or e)
    again = "then relaunch the same command, which resumes from the latest"
    if isinstance(cause, OSError) and cause.errno in FULL:
        advice = f"make room (the disk or a quota of {cfg.run_dir} is full), {again}"
    elif isinstance(cause, OSError) and cause.errno in UNWRITABLE:
        advice = f"make {cfg.run_dir / 'checkpoints'} writable by this user, {again}"
    elif isinstance(cause, OSError):
        advice = f"check the file system of {cfg.run_dir} (a disk, a network mount), {again}"
    else:
        where = ""
        if log is not None:
            log.to_file(error_traceback(e.__cause__ or e).rstrip())
            where = f" (its traceback: {cfg.run_dir / 'logs' / f'rank{log.rank}.log'})"
        fallback = "; if it fails again, set checkpoint.async=false (blocking saves)" if cfg.checkpoint.async_ else ""
        advice = (f"not for want of room or permissions but an error of the save itself{where}: relaunch the same "
                  f"command, which resumes from the latest{fallback}, and report it")
    return f"a checkpoint could not be written; the ones before it are intact: {advice} ({error_text(cause)})"


def out_of_memory(e: BaseException, cfg: Config, parts: Parts | None, training: bool) -> str | None:
    """A device out of memory, in one line: where (a step, an evaluation, a save, before training), what torch tried to
    allocate and held, and the settings that lower what a step needs; None for any other error."""
    first = str(e).strip().split("\n")[0]
    if not isinstance(e, torch.OutOfMemoryError) and "CUDA error: out of memory" not in first:
        return None
    size = r"([\d.]+ [KMGT]?i?B)"
    found = [re.search(pattern, first) for pattern in (rf"Tried to allocate {size}", rf"this process has {size}",
                                                       rf"total capacity of {size}")]
    want, held, total = (m.group(1) if m else None for m in found)
    what = ", ".join(x for x in (f"tried to allocate {want}" if want else "",
                                 f"{held} of {total} in use by this process" if held and total else "") if x)
    when = ("before training began" if parts is None or not training else
            f"in the checkpoint save of step {parts.step}" if parts.saving else
            f"in the evaluation after step {parts.step}" if parts.eval_pending else f"at step {parts.step + 1}")
    fixes = [f"lower train.micro_batch_size (now {cfg.train.micro_batch_size}; train.global_batch_size stays, by "
             f"more micro-batches a step)" if cfg.train.micro_batch_size > 1 else ""]
    fixes += ["train in bf16 (train.precision=bf16)" if cfg.train.precision == "fp32" else "",
              "set train.activation_checkpointing=true" if not cfg.train.activation_checkpointing else "",
              "shard the model over the GPUs with dist.strategy=fsdp" if cfg.dist.strategy != "fsdp" else ""]
    fixes = [f for f in fixes if f] or ["train a smaller model or on a GPU with more memory"]
    return (f"out of GPU memory {when}{f' ({what})' if what else ''}: "
            f"{', '.join(fixes[:-1]) + ', or ' if len(fixes) > 1 else ''}{fixes[-1]}")


def run(cfg: Config, denv: distributed.DistEnv) -> int:
    """Distributed setup -> build -> resume -> fit -> checkpoint -> teardown (always). Returns the exit code;
    a usage error (ConfigError: data, devices, checkpoints, tracker) is raised to the entry point."""
    configure_torch(cfg)
    parts = ckpt = meter = None
    exit_code = 1  # what the tracker is told if this ends in an exception
    try:
        device = distributed.setup(denv, cfg.dist.backend, cfg.dist.timeout_s)
        check_tracker(cfg, denv.rank)  # e.g. W&B online without an API key: exit 2 before anything is written
        parts = build(cfg, denv, device)
        # The objects built so far (torch's modules, the model, the loader) live as long as the run: a full
        # collection no longer scans them. One took 0.1 s, inside whatever step or checkpoint load it fell in.
        gc.freeze()
        log = parts.log
        hang.start(cfg.run_dir, denv)  # the hosts of all ranks; who hung, should a collective time out
        ckpt = Checkpointer(cfg, denv.rank, denv.world_size, log)
        parts.stop.install()
        parts.markers.forget_stopped()
        resumed = ckpt.resume(parts)  # a mismatched checkpoint raises here, before anything is written
        source = "" if resumed else parts.task.init_from()  # the run's own checkpoints come first
        if not resumed and parts.loads - (pretrained.covers(parts.raw, parts.task, source) if source else set()):
            # build gave them no init, for a checkpoint that was there then and that the resume did not find
            raise ConfigError(f"the checkpoints of {cfg.run_dir} changed while this launch started: relaunch")
        if source:
            pretrained.load(parts.raw, parts.task, source, log)
        parts.watched = finite_buffers(parts.raw)
        log.truncate_metrics(parts.step)  # from step 0 too: the records of an attempt that saved nothing are redone
        if parts.step >= cfg.train.steps and log.completed(parts.step):
            log.info(f"run {cfg.run_dir} is already complete at step {parts.step}; nothing to do")
            return 0  # its record (config.yaml, run_info.json) stays that of the run that trained it
        log.run_info(cfg, denv, device)
        log.info(f"world size {denv.world_size} ({denv.launcher}), device {device}, "
                 f"{_micro_steps(cfg.micro_batches(denv.world_size))} per rank a step, "
                 f"run dir {cfg.run_dir}")
        whole, here = wrapping.parameter_counts(parts.raw)
        log.info(f"model: {whole:,} parameters, {here:,} of them held by this rank (dist.strategy={cfg.dist.strategy})")
        log.start_tracker(cfg, ckpt, resumed)
        meter = StepMeter.build(cfg, parts, denv.rank)
        parts.markers.started(parts.step)  # for the launcher: a stop from here on ends with a checkpoint
        summary = fit(parts, ckpt, meter)
        ckpt.wait()
        if summary is None:
            exit_code = EXIT_REQUEUE
            return EXIT_REQUEUE
        exit_code = 0
        evals = ", ".join(f"{k} {v:.4f}" for k, v in summary.items() if k.startswith("eval_"))
        log.info(f"done: {summary['steps']} steps, {evals}, {summary['samples_per_s']:.1f} samples/s, "
                 f"{summary['wall_s']:.1f} s")
        log.finish(summary)  # summary.json, the tracker's summary, report.png and report.txt
        parts.markers.finished(summary["steps"])
        return 0
    except Exception as e:  # a usage error (ConfigError) goes on to the entry point
        reason = None if isinstance(e, ConfigError) else distributed.describe_failure(e, cfg.dist.timeout_s)
        if reason is None and isinstance(e, SaveError):
            say(f"[rank {denv.rank}] error: {save_failed(e, cfg, parts.log if parts else None)}")
            return 1
        if reason is None and (oom := out_of_memory(e, cfg, parts, training=meter is not None)):
            # Its traceback (where: the forward, the backward, the optimizer) goes to the rank's log file; the line is
            # said once: under the launcher by its last line (the FAILED marker), else by the rank
            where = None
            if parts is not None:
                parts.log.to_file(error_traceback(e).rstrip())
                where = cfg.run_dir / "logs" / f"rank{denv.rank}.log"
            else:  # no log file yet: the traceback goes where an unexplained error's would
                sys.stderr.write(error_traceback(e))
            markers.write_failure(cfg.run_dir, denv.rank, e, oom, where)
            if not markers.launch_id():
                said = oom + (f" (its traceback: {where})" if where else "")
                say(f"[rank {denv.rank}] error: {said}" if denv.world_size > 1 else f"error: {said}")
            return 1
        if reason is None:
            if not isinstance(e, ConfigError):
                markers.write_failure(cfg.run_dir, denv.rank, e)  # this rank's own error: the launcher names it
            raise
        say(f"[rank {denv.rank}] error: {reason} ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        if reason.startswith("collective timed out") and (who := hang.report(cfg.run_dir, denv, cfg.dist.timeout_s)):
            say(f"[rank {denv.rank}] error: {who}")  # who did not join (train/parallel/hang.py)
        return 1
    finally:
        if ckpt is not None:
            try:
                ckpt.wait()  # an asynchronous save in flight is finished, never abandoned
            except SaveError as e:  # the run is already ending on an error of its own: both are told, and the
                # teardown goes on
                say(f"[rank {denv.rank}] error: {save_failed(e, cfg, parts.log if parts else None)}")
        if meter is not None and (trace := meter.close()) is not None:
            parts.log.info(trace)
        if parts is not None:
            parts.log.close(exit_code)
        hang.stop()
        # The model goes before the process group. DDP's reducer holds the group: freed after teardown(), on this
        # frame's return, it would destroy the gloo group, joining its threads without letting go of the GIL
        # while one of them waits for the GIL to free the last collective's tensors (torch 2.11, a hang after
        # "done" in about 1 run of 5 on a busy 2-core machine). Freed now, the group outlives it, and
        # destroy_process_group lets go of the GIL while it joins. (By reference count: build's objects are frozen,
        # out of gc's reach.)
        parts = meter = ckpt = None
        distributed.teardown()

