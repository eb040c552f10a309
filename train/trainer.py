"""Build the parts, resume, and train: one optimizer step = `accum` micro-batches on every rank.

Each component decides its own "when": the checkpointer when to save (`due`), the evaluation when to run
(`due`), the run log when to log (`due`), the stop request when the ranks agree to stop (`agreed`). `fit` only
orders them around each step; train/failures.py words the failures it can explain.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from train import failures, optim, relaunch
from train.checkpoint import pretrained, resume
from train.checkpoint.checkpointer import Checkpointer
from train.checkpoint.dcp_io import error_text, error_traceback, first_error
from train.checkpoint.state import TrainState
from train.checkpoint.storage import SaveError
from train.config import Config, ConfigError, shard_ranks
from train.errors import EXIT_REQUEUE, say
from train.evaluation import Evaluation
from train.observe.log import RunLog, check_tracker
from train.observe.metrics import StepMeter
from train.parallel import data, distributed, hang, host_memory, wrapping
from train.parallel.data import to_device
from train.startup import note_imports
from train.stops import markers
from train.stops.markers import Markers
from train.stops.signals import StopRequest
from train.task import Task, collate_fn


@dataclass
class Training:
    """What fit() works on, built once by `build`: the model as it trains and what a step needs. `state` is
    what a checkpoint holds."""

    cfg: Config
    task: Task  # the user's model, data, loss and metrics (train/task.py)
    device: torch.device
    world_size: int
    wrapped: nn.Module  # DDP(state.model), or the model itself under FSDP and in one process (parallel/wrapping.py)
    step_loss: Callable[[object], torch.Tensor]  # batch -> the task's loss of `wrapped` (compiled: train.compile)
    state: TrainState
    evaluation: Evaluation
    log: RunLog
    stop: StopRequest  # whether the ranks agreed to stop (a signal to any of them)
    markers: Markers  # how this launch ends, for the launcher (train/stops/markers.py)
    loads: frozenset[str] = frozenset()  # the model's tensors given memory only: a checkpoint or init_from fills them
    watched: frozenset[str] = frozenset()  # the floating buffers finite at the start, which check_weights watches
    # What the run is doing, for the line of an error in it: "build" (before training), "step", "evaluation", "save"
    doing: str = "build"
    said_no_count: bool = False  # whether the log said a step had no counted target (once a launch)

    def when(self) -> str:
        """Where in the run an error happened, in words: "at step 3", "in the evaluation after step 2"."""
        step = self.state.step
        return {"build": "before training began", "save": f"in the checkpoint save of step {step}",
                "evaluation": f"in the evaluation after step {step}"}.get(self.doing, f"at step {step + 1}")


def train_step(t: Training, batches, sizes: list[int], meter: StepMeter) -> torch.Tensor | None:
    """One optimizer step over micro-batches of `sizes` samples; returns this rank's part of the step's loss (a
    tensor: no sync), or None for a step with no counted target on any rank (task.count()), which moves no weight.

    A task without count(): each micro-batch's mean loss weighted by its samples, the mean over the rank's share
    (DDP/FSDP average over the ranks). A task with count(): each micro-batch's loss is its sum over its counted
    targets; their number over the whole step (all micro-batches, all ranks) is all-reduced while the last
    micro-batch computes, and the gradients are scaled by world_size / that count before clipping (the gradient
    all-reduce already divided by world_size): the step's gradient is the one of its summed loss over its count,
    whatever the world size and the micro-batch split."""
    cfg, state = t.cfg, t.state
    optim.set_lr(state.optimizer, optim.lr_at(state.step, cfg.train.steps, cfg.optim))
    total = None
    accum, share, uneven = len(sizes), sum(sizes), len(set(sizes)) > 1
    local = None  # the rank's counted targets so far this step (a task with count()), a host tensor
    for micro, size in enumerate(sizes):
        with meter.waiting_for_data():
            batch = next(batches)
        meter.units(t.task.units(batch), size)  # on the host, as count()
        if (counted := t.task.count(batch)) is not None:  # on the batch as the loader made it: on the host
            local = counted if local is None else local + counted
        if micro == accum - 1 and local is not None:
            global_count = _count_over_ranks(t, local)  # launched before the last micro-batch's compute
        batch = to_device(batch, t.device, cfg.train.channels_last)
        # Only the last micro-step all-reduces (DDP) or reduce-scatters (FSDP); the others accumulate locally.
        sync = contextlib.nullcontext() if micro == accum - 1 else wrapping.no_sync(t.wrapped)
        with sync, meter.computing():
            loss = t.step_loss(batch)
            if not (torch.is_tensor(loss) and loss.dim() == 0):
                raise ConfigError(f"task {cfg.task_name}: loss() must return a scalar tensor, got "
                                  f"{type(loss).__name__}{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
            # Without count(): each micro-batch's mean loss weighted by its samples, the step's gradient the mean
            # over the share. Equal micro-batches divide by `accum` (the same weight, and the same bits as ever);
            # one micro-batch is not divided at all (x / 1 is x: two kernels fewer). With count(): the sums as
            # they are, scaled once after the backward.
            if local is None and uneven:
                loss = loss * (size / share)
            elif local is None and accum > 1:
                loss = loss / accum
            state.scaler.scale(loss).backward()
        total = loss.detach().float() if total is None else total + loss.detach().float()
    if local is not None:
        scale = _scale_by_count(t, local, global_count)
        if scale is None:
            state.optimizer.zero_grad(set_to_none=True)
            state.step += 1
            return None
        total = total * scale  # the rank's summed loss * world_size / count: its part of the step's loss
    if cfg.train.grad_clip > 0:
        state.scaler.unscale_(state.optimizer)  # clip true gradients, not scaled ones
        nn.utils.clip_grad_norm_(state.model.parameters(), cfg.train.grad_clip)  # FSDP: over all shards
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    return total


def _count_over_ranks(t: Training, local: torch.Tensor):
    """The step's counted targets over all ranks: the rank's `local` count all-reduced (SUM, float64: exact up to
    2**53) asynchronously, a (tensor on the device, work) pair; one process: (None, None), nothing to reduce."""
    if t.world_size == 1:
        return None, None
    count = local.detach().to(device=t.device, dtype=torch.float64, non_blocking=True)
    return count, torch.distributed.all_reduce(count, async_op=True)


def _scale_by_count(t: Training, local: torch.Tensor, global_count) -> torch.Tensor | None:
    """After the backward of a step of a task with count(): its gradients scaled by world_size / the step's count
    over all ranks, in place (a float32 tensor, also returned: the loss's scale); None when no rank counted any
    target, the gradients left as they are (zero) for the caller to drop, said once in the log. No host wait where
    this rank counted a target: the host reads the all-reduced count only where its own is 0, which every rank with
    a count of 0 does alike (only all of them together skip the step)."""
    count, work = global_count
    here = local.item()  # a host tensor (count() on the loader's batch): no wait for the device
    if work is not None:
        work.wait()  # NCCL: the stream waits for the all-reduce, not the host
    if here == 0 and (count is None or count.item() == 0):
        if not t.said_no_count:
            t.said_no_count = True
            if t.log.is_main:  # every rank skips alike: one line for all
                t.log.warning(f"step {t.state.step + 1}: no target counts in the loss on any rank (task.count() is 0 "
                              f"for all of the step's batches): the step moves no weight and the optimizer skips "
                              f"it (said once)")
        return None
    if count is None:
        scale = torch.full((), 1.0 / float(here), dtype=torch.float32, device=t.device)
    else:
        scale = (t.world_size / count).to(torch.float32)
    grads = [p.grad for p in t.state.model.parameters() if p.grad is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP: each rank's shard
    if grads:
        torch._foreach_mul_(grads, scale)
    return scale


def _micro_steps(sizes: list[int]) -> str:
    """'2 micro-batches of 12 samples', '3 micro-batches of 11, 11 and 10 samples'."""
    n = len(sizes)
    if len(set(sizes)) == 1:
        return f"{n} micro-batch{'es' if n > 1 else ''} of {sizes[0]} sample{'s' if sizes[0] > 1 else ''}"
    return f"{n} micro-batches of {', '.join(map(str, sizes[:-1]))} and {sizes[-1]} samples"


def ranks_in_sync(t: Training) -> bool:
    """Whether the ranks that should hold bitwise the same tensors do: every rank the same buffers (BatchNorm
    statistics: the evaluation's promise), and the same parameters as every rank that holds the same part of
    them (DDP's promise, HSDP's between its replicas: each place in a group holds one shard); a cheap
    end-of-run check. Under FSDP each rank's shard is its own, compared with nobody's (gathering the shards to
    compare would put the whole model on every rank)."""
    model = t.state.model
    ranks, place = wrapping.shard_group(model)
    held, buffers = hashlib.sha256(), hashlib.sha256()
    compared = [] if ranks == t.world_size else model.parameters()  # FSDP: no shard has a copy
    for digest, tensors in ((held, compared), (buffers, model.buffers())):
        for x in tensors:
            x = x.to_local() if hasattr(x, "to_local") else x  # a DTensor: this rank's shard
            digest.update(x.detach().cpu().reshape(-1).view(torch.uint8).numpy())  # (no copy of its bytes)
    everyone = [None] * t.world_size
    torch.distributed.all_gather_object(everyone, (place, held.hexdigest(), buffers.hexdigest()))
    return digests_agree(everyone)


def digests_agree(everyone: list[tuple[int, str, str]]) -> bool:
    """(place in the shard group, parameters' digest, buffers' digest) of each rank: the same buffers everywhere,
    the same parameters at each place."""
    held: dict[int, set[str]] = {}
    for place, params, _ in everyone:
        held.setdefault(place, set()).add(params)
    return len({b for _, _, b in everyone}) == 1 and all(len(h) == 1 for h in held.values())


def _groups(cfg: Config, model: nn.Module, world_size: int) -> str:
    """HSDP's layout for the model's log line: ', shards over groups of 2 ranks, 4 replicas'."""
    if cfg.dist.strategy != "hsdp":
        return ""
    ranks = wrapping.shard_group(model)[0]
    replicas = world_size // ranks
    return f", shards over groups of {ranks} rank{'s' * (ranks > 1)}, {replicas} replica{'s' * (replicas > 1)}"


def fit(t: Training, ckpt: Checkpointer, meter: StepMeter) -> dict | None:
    """Train to cfg.train.steps: after each step the log, the stop, the save and the evaluation, in that order,
    each when its component says it is due.

    Returns the run's summary, or None when a stop signal ended it early (after a checkpoint)."""
    cfg, log, state = t.cfg, t.log, t.state
    sizes = state.data.sizes
    batches = iter(state.data)
    start_step, t_start = state.step, time.perf_counter()
    state.model.train()
    if state.eval_pending and state.step < cfg.train.steps and log.evaluated(state.step):
        state.eval_pending = False  # resumed from a checkpoint saved before its evaluation, which was logged
    meter.start()
    while state.step < cfg.train.steps:
        # The evaluation a stop pre-empted runs before the next step
        if state.eval_pending and _evaluate(t, meter) is None:
            return _stop(t, ckpt)
        t.doing = "step"
        if (loss := train_step(t, batches, sizes, meter)) is not None:  # None: a step with no counted target
            state.window_loss += loss
            state.window_steps += 1
        meter.step_done()
        step = state.step
        if step == start_step + 1:
            note_imports()  # for a standby beside this worker (train/launch/standby.py)
        log.advance(step)
        if logs := log.due(step):
            _log_window(t, ckpt, meter)
        state.eval_pending = t.evaluation.due(step)
        # The stop is agreed before any evaluation, so that it never waits for one. Only where this step waits
        # for the device anyway (a log, an evaluation, a save) or follows a save (a stop in it ends with that
        # save) is the agreement waited for; elsewhere the host runs on and the stop lands a step later (one process
        # has nobody to agree with: its stop lands at once, StopRequest.agreed).
        now = logs or state.eval_pending or ckpt.due(step) or ckpt.saved_step == step - 1
        if t.stop.agreed(t.device, now=now):
            return _stop(t, ckpt)
        if ckpt.due(step):
            with meter.paused():
                _checked_save(t, ckpt, ckpt.save)
            if t.stop.agreed(t.device):  # a stop that came during the save ends with it
                return _stop(t, ckpt)
        elif ckpt.memory.due(step):
            ckpt.save_memory(state)  # copied while the next step runs (its optimizer step waits for the copy)
        if state.eval_pending and step < cfg.train.steps and _evaluate(t, meter) is None:
            return _stop(t, ckpt)
    # The end (also reached by a relaunch whose last checkpoint is the final step): the final evaluation.
    state.eval_pending = True
    if (result := _evaluate(t, meter)) is None:
        return _stop(t, ckpt)
    wall = time.perf_counter() - t_start
    return {"steps": state.step, "world_size": t.world_size, "train_loss": log.last_train_loss, **result,
            "samples_per_s": (state.step - start_step) * cfg.train.global_batch_size / max(wall, 1e-9),
            "wall_s": wall, "ranks_in_sync": ranks_in_sync(t),
            "global_batch_size": cfg.train.global_batch_size, "precision": cfg.train.precision}


def _log_window(t: Training, ckpt: Checkpointer, meter: StepMeter) -> None:
    """A log step: the mean loss of the steps since the last one, over all ranks (the window may have begun
    before a resume: its sum and length come from the checkpoint); a loss that is not finite ends the run."""
    state, step = t.state, t.state.step
    loss_sum, n = distributed.all_reduce_sum([state.window_loss.item(), state.window_steps], t.device)
    # n: the window's steps that counted a target (task.count()); a window of none has no loss (NaN), not a divergence
    # "lr": the schedule's rate of the window's last step (the base; a task's group trains at it times its lr_scale)
    lr = optim.lr_at(step - 1, t.cfg.train.steps, t.cfg.optim)
    t.log.train({"step": step, "epoch": state.data.epoch, "loss": loss_sum / n if n else math.nan}
                | optim.rates(state.optimizer, lr) | meter.window())
    if n and not math.isfinite(loss_sum) and t.cfg.train.precision != "fp16":  # (fp16: the GradScaler's skipped steps)
        raise _diverged(t, ckpt, f"the training loss of steps {step - state.window_steps + 1}-{step} is "
                                 f"{loss_sum / n}")
    state.window_loss.zero_()
    state.window_steps = 0


def _evaluate(t: Training, meter: StepMeter) -> dict[str, float] | None:
    """The evaluation due now, logged; None when a stop came first (it stays pending: the checkpoint says so)."""
    t.doing = "evaluation"
    with meter.paused():
        result = t.evaluation.run(t.state.model)
    if result is not None:
        t.state.eval_pending = False
        t.log.eval({"step": t.state.step} | result)
    return result


def _checked_save(t: Training, ckpt: Checkpointer, save: Callable[[TrainState], object]) -> object:
    """`save(state)` (a checkpoint's, or a stop's last) after check_weights; an error in either is told as the
    save's."""
    t.doing = "save"
    check_weights(t, ckpt)
    result = save(t.state)
    t.doing = "step"
    return result


def check_weights(t: Training, ckpt: Checkpointer) -> None:
    """Before a save: weights or buffers (BatchNorm's statistics, which one overflowed forward makes inf for good,
    also under fp16's GradScaler) that turned NaN or inf end the run with one line, never saved over the good
    checkpoints that retention would then delete. Every rank sums each of its tensors (FSDP: its shards) on the
    device, at saves only: a NaN or an inf makes the sum one; all ranks agree."""
    model = t.state.model
    tensors = [x.to_local() if hasattr(x, "to_local") else x for x in model.parameters()]
    tensors += [b for name, b in model.named_buffers() if name in t.watched]
    tensors = [x for x in tensors if x.is_floating_point() and x.numel()]
    bad = (~_finite_each(tensors)).sum() if tensors else torch.zeros((), device=t.device)
    bad = bad.to(device=t.device, dtype=torch.float32)
    torch.distributed.all_reduce(bad)
    if bad.item():
        raise _diverged(t, ckpt, f"the model's weights or buffers hold NaN or inf after step {t.state.step}")


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
    return torch.stack([x.detach().sum(dtype=torch.float32) for x in tensors]).isfinite()


def _diverged(t: Training, ckpt: Checkpointer, what: str) -> ConfigError:
    last = ckpt.saved_step if ckpt.saved_step is not None else ckpt.latest_step()
    return ConfigError(failures.diverged(what, last, t.cfg))


def _stop(t: Training, ckpt: Checkpointer) -> None:
    step = _checked_save(t, ckpt, ckpt.save_last)  # blocking: complete on this rank
    torch.distributed.barrier()  # complete on every rank: now every node's marker may say so
    t.markers.stopped(step, t.stop.signal)
    torch.distributed.barrier()  # no rank exits before every node's marker is written
    if step != t.state.step:
        note = f" (the save of step {step} was the last; step {t.state.step} is trained again after the resume)"
    else:
        note = " (its evaluation runs after the resume)" if t.state.eval_pending else ""
    t.log.info(f"stopped on {t.stop.signal or 'a peer rank signal'} at step {step}, checkpoint saved{note}")
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


def build(cfg: Config, denv: distributed.DistEnv, device: torch.device, decision: resume.Decision) -> Training:
    """Everything a run trains with, for the launch's resume decision: a model that a checkpoint will fill is
    given memory but no initial values."""
    if cfg.dist.strategy != "ddp":
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
    resume.check_fresh_start(cfg)  # resume=never never overwrites an earlier run
    optim.param_groups(raw, task.param_groups(raw), cfg.optim.weight_decay, cfg.task_name)  # its mistakes: now
    log = RunLog(cfg.run_dir, denv, cfg, unit=task.unit)  # only now: a config or data error leaves nothing behind
    if cfg.dist.sync_bn:
        raw = nn.SyncBatchNorm.convert_sync_batchnorm(raw)
    meta = wrapping.on_meta(raw)  # built on the meta device: no memory until it is sharded (FSDP, HSDP) or wrapped
    loads = frozenset(_loaded_whole(task, raw, decision) if meta else ())
    if not meta:
        raw = raw.to(device)
    elif cfg.dist.strategy == "ddp":
        wrapping.materialize(raw, task, device, cfg.seed, skip=loads)
    if cfg.train.channels_last:
        raw = raw.to(memory_format=torch.channels_last)
    shards = shard_ranks(cfg, denv.world_size, denv.local_world_size)
    wrapped = wrapping.wrap(cfg, task, raw, device, shards)  # DDP, or FSDP2 sharding raw in place (HSDP: in groups)
    if meta and cfg.dist.strategy != "ddp":
        wrapping.materialize(raw, task, device, cfg.seed, skip=loads)  # each rank's shards only
    step_loss = step_loss_fn(cfg, task, wrapped, device)
    # The weights are made: from here each rank draws numbers of its own (dropout masks, a user's random
    # augmentation), as different samples on different GPUs should; a resume restores each rank's states.
    rank_seed = cfg.seed + 1_000_003 * (denv.rank + 1)
    random.seed(rank_seed)
    np.random.seed(rank_seed % 2**32)
    torch.manual_seed(rank_seed)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    # The task's groups are asked of the model as it trains (FSDP's parameters are its own): names and identities hold
    optimizer = optim.build(cfg.optim, raw, scaler.is_enabled(), task.param_groups(raw), cfg.task_name)
    state = TrainState(model=raw, optimizer=optimizer, scaler=scaler, data=stream, device=device,
                       window_loss=torch.zeros((), device=device))
    stop = StopRequest(cfg.checkpoint.signal)
    return Training(cfg=cfg, task=task, device=device, world_size=denv.world_size, wrapped=wrapped,
                    step_loss=step_loss, state=state, evaluation=Evaluation(cfg, task, eval_loader, device, stop),
                    log=log, stop=stop, markers=Markers(cfg.run_dir, denv.rank), loads=loads)


def step_loss_fn(cfg: Config, task: Task, wrapped: nn.Module, device: torch.device) -> Callable[[object], torch.Tensor]:
    """batch -> task.loss(wrapped, batch) under autocast. train.compile compiles the model and the loss together,
    so that the output layer's softmax and casts fuse with it (docs/dev/design-notes.md). Under DDP the DDP
    module itself is compiled and the loss runs eagerly: torch splits a compiled DDP forward at its gradient
    buckets, so that their all-reduce overlaps the backward."""
    compiled = cfg.train.compile
    model = torch.compile(wrapped) if compiled and wrapping.replicated(wrapped) else wrapped

    def step_loss(batch):
        with wrapping.autocast(cfg, device):
            return task.loss(model, batch)

    return torch.compile(step_loss) if compiled and model is wrapped else step_loss


def _loaded_whole(task: Task, model: nn.Module, decision: resume.Decision) -> set[str]:
    """The tensors of the meta-built `model` that this launch overwrites whole before the first step: all that
    a checkpoint holds where the decision has candidates (a resume loads every tensor of the model's state, or
    stops the launch), else those that init_from's files hold; their random init would be drawn for nothing."""
    if decision.candidates:
        return set(model.state_dict().keys())
    source = task.init_from()
    return pretrained.covers(model, task, source) if source else set()


def run(cfg: Config, denv: distributed.DistEnv) -> int:
    """Distributed setup -> resume decision -> build -> resume -> fit -> checkpoint -> teardown (always). Returns
    the exit code; a usage error (ConfigError: data, devices, checkpoints, tracker) is raised to the entry point."""
    configure_torch(cfg)
    t = ckpt = meter = None
    exit_code = 1  # what the tracker is told if this ends in an exception
    try:
        device = distributed.setup(denv, cfg.dist.backend, cfg.dist.timeout_s)
        check_tracker(cfg, denv.rank)  # e.g. W&B online without an API key: exit 2 before anything is written
        # the one resume decision of this launch, over the disk's checkpoints and the states in host memory
        decision = resume.agree(cfg, denv.rank, denv.world_size, denv.local_world_size)
        t = build(cfg, denv, device, decision)
        # The objects built so far (torch's modules, the model, the loader) live as long as the run: a full
        # collection no longer scans them, so none lands inside a step or a checkpoint load.
        gc.freeze()
        log, state = t.log, t.state
        hang.start(cfg.run_dir, denv)  # the hosts of all ranks; who hung, should a collective time out
        ckpt = Checkpointer(cfg, denv.rank, denv.world_size, log, denv.local_world_size)
        t.stop.install()
        t.markers.forget_stopped()
        resumed = ckpt.resume(state, decision)  # a mismatched checkpoint raises here, before anything is written
        ckpt.memory.keep_up_to(state.step if resumed else None)  # newer states in host memory: another future's
        source = "" if resumed else t.task.init_from()  # the run's own checkpoints come first
        if source:
            pretrained.load(state.model, t.task, source, log)
        t.watched = finite_buffers(state.model)
        log.truncate_metrics(state.step)  # from step 0 too: the records of an attempt that saved nothing are redone
        if state.step >= cfg.train.steps and log.completed(state.step):
            if line := relaunch.refusal(ckpt.changes, cfg.run_dir, state.step):
                raise ConfigError(line)  # a change that needs training, on a run with no step left
            ignored = "".join(f", {c} changes nothing here" for c in ckpt.changes)
            log.info(f"run {cfg.run_dir} is already complete at step {state.step}; nothing to do{ignored}")
            ckpt.memory.clear()
            return 0  # its record (config.yaml, run_info.json) stays that of the run that trained it
        log.run_info(cfg, denv, device)
        log.info(f"world size {denv.world_size} ({denv.launcher}), device {device}, "
                 f"{_micro_steps(cfg.micro_batches(denv.world_size))} per rank a step, "
                 f"run dir {cfg.run_dir}")
        whole, here = wrapping.parameter_counts(state.model)
        trained = sum(p.numel() for p in state.model.parameters() if p.requires_grad)  # (a DTensor's: whole)
        frozen = f"; {trained:,} of them trained, the rest frozen" if trained < whole else ""
        log.info(f"model: {whole:,} parameters, {here:,} of them held by this rank (dist.strategy={cfg.dist.strategy}"
                 f"{_groups(cfg, state.model, denv.world_size)}){frozen}")
        if line := optim.described(state.optimizer, state.model):
            log.info(line)
        log.start_tracker(cfg, ckpt, resumed)
        meter = StepMeter.build(cfg, denv.rank, denv.world_size, device, t.task, state.model, t.evaluation.loader,
                                log, state.step)
        t.markers.started(state.step)  # for the launcher: a stop from here on ends with a checkpoint
        summary = fit(t, ckpt, meter)
        ckpt.wait()
        ckpt.memory.clear()  # the run ends with its disk checkpoint (finished, or stopped): host memory is let go
        if summary is None:
            exit_code = EXIT_REQUEUE
            return EXIT_REQUEUE
        exit_code = 0
        evals = ", ".join(f"{k} {v:.4f}" for k, v in summary.items() if k.startswith("eval_"))
        log.info(f"done: {summary['steps']} steps, {evals}, {summary['samples_per_s']:.1f} samples/s, "
                 f"{summary['wall_s']:.1f} s")
        log.finish(summary)  # summary.json, the tracker's summary, report.png and report.txt
        t.markers.finished(summary["steps"])
        return 0
    except Exception as e:  # a usage error (ConfigError) goes on to the entry point
        code = _failed(e, cfg, denv, t, "before training began" if meter is None or t is None else t.when())
        _drop_frames(e)
        if code is None:
            raise
        return code
    finally:
        if ckpt is not None:
            try:
                ckpt.wait()  # an asynchronous save in flight is finished, never abandoned
            except SaveError as e:  # the run is already ending on an error of its own: both are told, and the
                # teardown goes on
                say(f"[rank {denv.rank}] error: {_save_failed(e, cfg, t.log if t else None)}")
        if meter is not None and (trace := meter.close()) is not None:
            t.log.info(trace)
        if t is not None:
            t.log.close(exit_code)
        hang.stop()
        # The model goes before the process group. DDP's reducer holds the group: freed after teardown(), on this
        # frame's return, it would destroy the gloo group, joining its threads without letting go of the GIL
        # while one of them waits for the GIL to free the last collective's tensors (torch 2.11: a hang after
        # "done", now and then). Freed now, the group outlives it, and destroy_process_group lets go of the GIL
        # while it joins. (By reference count: build's objects are frozen, out of gc's reach.)
        t = meter = ckpt = None
        distributed.teardown()


def _drop_frames(e: BaseException | None) -> None:
    """Clear the locals of the frames an exception's traceback holds (fit's and resume's hold the model) and those
    of the exceptions it chains: otherwise the model outlives the process group while the exception propagates (see
    run's `finally`). The traceback still tells file, line and function."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def _save_failed(e: SaveError, cfg: Config, log: RunLog | None) -> str:
    """failures.save_failed's line for a SaveError; an error of the save itself leaves its traceback in the rank's
    log file."""
    cause = first_error(e.__cause__ or e)
    traceback_at = None
    if log is not None and not isinstance(cause, OSError):
        log.to_file(error_traceback(e.__cause__ or e).rstrip())
        traceback_at = cfg.run_dir / "logs" / f"rank{log.rank}.log"
    return failures.save_failed(cause, error_text(cause), cfg.run_dir, cfg.checkpoint.async_, traceback_at)


def _failed(e: Exception, cfg: Config, denv: distributed.DistEnv, t: Training | None, when: str) -> int | None:
    """An exception that ended the run: told in one line where it can be explained (a save, out of memory, a
    collective), and the exit code; None for any other error (and a usage error), which the caller raises on, its
    rank's failure marked for the launcher. (Raised from here, this frame would keep `t` and its model alive past
    the process group's teardown: see run's `finally`.)"""
    reason = None if isinstance(e, ConfigError) else distributed.describe_failure(e, cfg.dist.timeout_s)
    if reason is None and isinstance(e, SaveError):
        say(f"[rank {denv.rank}] error: {_save_failed(e, cfg, t.log if t else None)}")
        return 1
    if reason is None and (oom := failures.out_of_memory(e, when, cfg)):
        # Its traceback (where: the forward, the backward, the optimizer) goes to the rank's log file; the line is
        # said once: under the launcher by its last line (the FAILED marker), else by the rank
        where = None
        if t is not None:
            t.log.to_file(error_traceback(e).rstrip())
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
        return None
    say(f"[rank {denv.rank}] error: {reason} ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if reason.startswith("collective timed out") and (who := hang.report(cfg.run_dir, denv, cfg.dist.timeout_s)):
        say(f"[rank {denv.rank}] error: {who}")  # who did not join (train/parallel/hang.py)
    return 1
