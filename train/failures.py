"""The one line a failed run ends with, for the failures the trainer can explain: a checkpoint that could not be
written, a device out of memory, a training that diverged. Plain values in, one line out: what failed, and what
to do about it. (A collective that timed out or a peer that died: train/parallel/distributed.describe_failure.)"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import torch

from train.config import Config

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no room: a full disk, a quota, a file size limit
UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


def save_failed(cause: BaseException, text: str, run_dir: Path, async_save: bool, traceback_at: Path | None) -> str:
    """A failed save's line. `cause`: the first error of the save, `text` its words. Only a full disk is told to
    make room and only an unwritable folder to fix it; any other error (a bug of the save itself, say) names
    itself and where its traceback is (`traceback_at`: the rank's log file)."""
    again = "then relaunch the same command, which resumes from the latest"
    if isinstance(cause, OSError) and cause.errno in FULL:
        advice = f"make room (the disk or a quota of {run_dir} is full), {again}"
    elif isinstance(cause, OSError) and cause.errno in UNWRITABLE:
        advice = f"make {run_dir / 'checkpoints'} writable by this user, {again}"
    elif isinstance(cause, OSError):
        advice = f"check the file system of {run_dir} (a disk, a network mount), {again}"
    else:
        where = f" (its traceback: {traceback_at})" if traceback_at is not None else ""
        fallback = "; if it fails again, set checkpoint.async=false (blocking saves)" if async_save else ""
        advice = (f"not for want of room or permissions but an error of the save itself{where}: relaunch the same "
                  f"command, which resumes from the latest{fallback}, and report it")
    return f"a checkpoint could not be written; the ones before it are intact: {advice} ({text})"


def out_of_memory(e: BaseException, when: str, cfg: Config) -> str | None:
    """A device out of memory, in one line: `when` it happened (at a step, in an evaluation, a save, before
    training), what torch tried to allocate and held, and the settings that lower what a step needs; None for any
    other error."""
    first = str(e).strip().split("\n")[0]
    if not isinstance(e, torch.OutOfMemoryError) and "CUDA error: out of memory" not in first:
        return None
    size = r"([\d.]+ [KMGT]?i?B)"
    found = [re.search(pattern, first) for pattern in (rf"Tried to allocate {size}", rf"this process has {size}",
                                                       rf"total capacity of {size}")]
    want, held, total = (m.group(1) if m else None for m in found)
    what = ", ".join(x for x in (f"tried to allocate {want}" if want else "",
                                 f"{held} of {total} in use by this process" if held and total else "") if x)
    t = cfg.train
    fixes = [f"lower train.micro_batch_size (now {t.micro_batch_size}; train.global_batch_size stays, by "
             f"more micro-batches a step)" if t.micro_batch_size > 1 else ""]
    fixes += ["train in bf16 (train.precision=bf16)" if t.precision == "fp32" else "",
              "set train.activation_checkpointing=true" if not t.activation_checkpointing else "",
              {"ddp": "shard the model over the GPUs with dist.strategy=fsdp",
               "hsdp": "shard the model over more GPUs (a larger dist.shard_size, or dist.strategy=fsdp)"}.get(
                  cfg.dist.strategy, "")]
    fixes = [f for f in fixes if f] or ["train a smaller model or on a GPU with more memory"]
    return (f"out of GPU memory {when}{f' ({what})' if what else ''}: "
            f"{', '.join(fixes[:-1]) + ', or ' if len(fixes) > 1 else ''}{fixes[-1]}")


def diverged(what: str, last_checkpoint: int | None, cfg: Config) -> str:
    """The line of a run whose training diverged (`what` was found): nothing is saved from here on, a relaunch
    resumes from the last checkpoint (a usage error: with the same settings it would diverge again, so no launcher
    retries it)."""
    o = cfg.optim
    fixes = [f"lower optim.lr (now {o.lr:g})", f"raise optim.warmup_steps (now {o.warmup_steps})"]
    if cfg.train.grad_clip <= 0:
        fixes.append("clip the gradients (train.grad_clip=1.0)")
    if cfg.train.precision == "fp16":
        fixes.append("train in bf16 or fp32 rather than fp16")
    start = (f"which resumes from the checkpoint of step {last_checkpoint}" if last_checkpoint is not None
             else "which starts again from step 0 (no checkpoint was saved yet)")
    return (f"training diverged: {what}, and nothing is saved from it; {', '.join(fixes[:-1])} or {fixes[-1]}, "
            f"then relaunch, {start}")
