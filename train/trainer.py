"""The training loop: one optimizer step = `accum` micro-batches on every rank, then all-reduced grads."""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from train import distributed, optim
from train.checkpoint import Checkpointer
from train.config import Config
from train.log import RunLog

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Parts:
    """What fit() works on, built once by the entry point."""

    cfg: Config
    device: torch.device
    world_size: int
    raw: nn.Module  # the bare model: what checkpoints hold and evaluation runs
    ddp: DDP
    step_model: nn.Module  # ddp, or torch.compile(ddp)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    stream: object  # data.TrainStream
    eval_loader: torch.utils.data.DataLoader
    log: RunLog
    step: int = 0  # optimizer steps done


def autocast(parts: Parts):
    p = parts.cfg.train.precision
    return torch.autocast(parts.device.type, dtype=DTYPES[p], enabled=p != "fp32")


@torch.no_grad()
def evaluate(parts: Parts) -> tuple[float, float]:
    """Loss and accuracy over the whole evaluation set: each rank takes a shard, sums are all-reduced."""
    model = parts.raw
    model.eval()
    loss_sum = correct = count = 0.0
    for x, y in parts.eval_loader:
        x, y = _to_device(parts, x, y)
        with autocast(parts):
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    model.train()
    loss_sum, correct, count = distributed.all_reduce_sum([loss_sum, correct, count], parts.device)
    return loss_sum / count, correct / count


def _to_device(parts: Parts, x: torch.Tensor, y: torch.Tensor):
    fmt = torch.channels_last if parts.cfg.train.channels_last else torch.contiguous_format
    return (x.to(parts.device, non_blocking=True, memory_format=fmt), y.to(parts.device, non_blocking=True))


def train_step(parts: Parts, batches, accum: int) -> torch.Tensor:
    """One optimizer step; returns the mean loss of this rank's micro-batches (a tensor: no sync)."""
    cfg = parts.cfg
    optim.set_lr(parts.optimizer, optim.lr_at(parts.step, cfg.train.steps, cfg.optim))
    total = torch.zeros((), device=parts.device)
    for micro in range(accum):
        x, y = _to_device(parts, *next(batches))
        # Only the last micro-step all-reduces; the others accumulate gradients locally.
        sync = contextlib.nullcontext() if micro == accum - 1 else parts.ddp.no_sync()
        with sync:
            with autocast(parts):
                loss = F.cross_entropy(parts.step_model(x), y) / accum
            parts.scaler.scale(loss).backward()
        total += loss.detach().float()
    if cfg.train.grad_clip > 0:
        parts.scaler.unscale_(parts.optimizer)  # clip true gradients, not scaled ones
        nn.utils.clip_grad_norm_(parts.raw.parameters(), cfg.train.grad_clip)
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.step += 1
    return total


def ranks_in_sync(parts: Parts) -> bool:
    """Whether every rank holds bitwise the same parameters (DDP's promise; a cheap end-of-run check)."""
    h = hashlib.sha256()
    for p in parts.raw.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * parts.world_size
    torch.distributed.all_gather_object(digests, h.hexdigest())
    return len(set(digests)) == 1


def fit(parts: Parts, ckpt: Checkpointer) -> dict | None:
    """Train to cfg.train.steps, logging, evaluating and checkpointing on the way.

    Returns the run's summary, or None when a stop signal ended it early (after a checkpoint)."""
    cfg, log = parts.cfg, parts.log
    accum = cfg.accum_steps(parts.world_size)
    batches = iter(parts.stream)
    start_step, t_start = parts.step, time.perf_counter()
    window_loss, window_steps, t_window = torch.zeros((), device=parts.device), 0, time.perf_counter()
    train_loss = eval_loss = eval_acc = float("nan")
    parts.raw.train()
    while parts.step < cfg.train.steps:
        window_loss += train_step(parts, batches, accum)
        window_steps += 1
        step = parts.step
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            loss_sum, n = distributed.all_reduce_sum([window_loss.item(), window_steps], parts.device)
            elapsed = time.perf_counter() - t_window
            train_loss = loss_sum / n
            log.metrics({"step": step, "epoch": parts.stream.epoch, "loss": train_loss,
                         "lr": parts.optimizer.param_groups[0]["lr"],
                         "samples_per_s": window_steps * cfg.train.global_batch_size / elapsed,
                         "step_time_s": elapsed / window_steps})
            log.info(f"step {step}/{cfg.train.steps} epoch {parts.stream.epoch} loss {train_loss:.4f} "
                     f"lr {parts.optimizer.param_groups[0]['lr']:.4g} "
                     f"{window_steps * cfg.train.global_batch_size / elapsed:.1f} samples/s")
            window_loss.zero_()
            window_steps, t_window = 0, time.perf_counter()
        if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == cfg.train.steps:
            eval_loss, eval_acc = evaluate(parts)
            log.metrics({"step": step, "eval_loss": eval_loss, "eval_accuracy": eval_acc})
            log.info(f"eval step {step}: loss {eval_loss:.4f} accuracy {eval_acc:.4f}")
        stop = ckpt.stop_agreed(parts.device)
        if stop or ckpt.due(step):
            ckpt.save(parts, blocking=stop)
        if stop:
            log.info(f"stopped on {ckpt.stop_signal or 'a peer rank signal'} at step {step}, checkpoint saved")
            return None
    wall = time.perf_counter() - t_start
    return {"steps": parts.step, "world_size": parts.world_size, "train_loss": train_loss,
            "eval_loss": eval_loss, "eval_accuracy": eval_acc,
            "samples_per_s": (parts.step - start_step) * cfg.train.global_batch_size / max(wall, 1e-9),
            "wall_s": wall, "ranks_in_sync": ranks_in_sync(parts), "global_batch_size": cfg.train.global_batch_size, "precision": cfg.train.precision}
