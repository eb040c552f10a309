"""The bare loop of the GPT: the baseline `python -m train` on the language model is measured against, on CPU
ranks (bench/suite/lm_overhead.py) and on a GPU (bench/check/gpu.py's gpt stage, bench/suite/gpu.py).

    torchrun --nproc-per-node 2 -m bench.baselines.gpt OUT_DIR [--data DIR] key=value ...   # DDP, gloo or NCCL
    python -m bench.baselines.gpt OUT_DIR [--data DIR] key=value ...                         # one process

The key=value overrides are `python -m train --config configs/gpt.yaml`'s: the loop reads its sizes and
hyper-parameters from the same config (train.config.load), and nothing else of the template runs. As nanoGPT's
train.py: the template's GPT (train/tasks/gpt_model.py: the model math, built from the task's GPTConfig) and its
loss; AdamW over two parameter groups (weight decay on matrices only; fused on a GPU), linear warm-up then cosine
decay, clipping at train.grad_clip; DDP with the template's default settings when there are several ranks;
train.compile compiles the model with its loss (under DDP: the DDP module, its loss eager), as the trainer does;
bf16 autocast where train.precision says so. One micro-batch a step, no checkpoints, no evaluation, no stop
handling. Batches: with --data, nanoGPT's get_batch (DIR/train.bin of uint16 tokens through np.memmap, random
windows, each rank its own); without, one batch of random tokens made once on the device (no loader at all).
Every train.log_every steps rank 0 reads the loss (loss.item(), no all-reduce, as nanoGPT; on a GPU a wait for
it), so the wall clock of those steps is the device's too.

Rank 0 writes OUT_DIR/times.json: `times` (the wall clock, time.time(), after each step), `tokens_per_step` (all
ranks), `flops_per_token` (nanoGPT's count), `device`, `peak_gib` (a GPU's). `windows` reads rates from it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench.common import end_baseline


def windows(times: list[float], every: int, skip: int) -> list[float]:
    """Seconds a step of each window of `every` steps (ending at a step whose loss rank 0 read), after `skip`."""
    marks = [times[i - 1] for i in range(every, len(times) + 1, every)][skip:]
    return [(b - a) / every for a, b in zip(marks, marks[1:], strict=False)]


def tokens_per_s(fig: dict, every: int, skip: int) -> float:
    """The median of the windows' tokens/s (the trainer's figure is the median of its log windows too)."""
    return fig["tokens_per_step"] / statistics.median(windows(fig["times"], every, skip))


def train(cfg, data: Path | None = None) -> dict:
    """The loop, on this process's ranks (a process group if one is initialized); rank 0's figures (see above)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from train.tasks.gpt_model import GPT

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    task = cfg.task_class(cfg.task, cfg.seed)
    g = task.gpt_config()
    model = GPT(g).to(device)
    net = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True) if world > 1 else model
    o, t = cfg.optim, cfg.train
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=(0.9, o.beta2), fused=cuda)
    seq, batch = g.block_size, t.micro_batch_size
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16")
    forward = torch.compile(net) if t.compile and world > 1 else net

    def loss_of(x, y):
        with amp:
            return task.loss(forward, (x, y))

    step_loss = torch.compile(loss_of) if t.compile and world == 1 else loss_of
    torch.manual_seed(cfg.seed + 1337 + rank)  # each rank draws its own windows

    def get_batch():
        tokens = np.memmap(data / "train.bin", dtype=np.uint16, mode="r")  # reopened each batch, as nanoGPT
        ix = torch.randint(len(tokens) - seq, (batch,))
        x = torch.stack([torch.from_numpy(tokens[i:i + seq].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(tokens[i + 1:i + 1 + seq].astype(np.int64)) for i in ix])
        if cuda:
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    if data is None:
        resident = torch.randint(0, g.vocab_size, (batch, seq + 1), device=device)
        resident = resident[:, :-1].contiguous(), resident[:, 1:].contiguous()

    def get_lr(it):
        if it < o.warmup_steps:
            return o.lr * (it + 1) / o.warmup_steps
        progress = min(1.0, (it - o.warmup_steps) / max(1, t.steps - o.warmup_steps))
        floor = o.lr * o.min_lr_ratio
        return floor + (o.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    times = []
    x, y = get_batch() if data is not None else resident
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for it in range(t.steps):
        for group in opt.param_groups:
            group["lr"] = get_lr(it)
        loss = step_loss(x, y)
        if data is not None:
            x, y = get_batch()  # the next batch, as nanoGPT fetches it while the device works
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (it + 1) % t.log_every == 0:
            print(f"iter {it + 1}: loss {loss.item():.4f}", flush=True)
        times.append(time.time())
    fig = {"times": times, "tokens_per_step": world * batch * seq, "flops_per_token": task.flops_per_sample(model)
           / seq, "device": torch.cuda.get_device_name(device) if cuda else "cpu", "precision": t.precision}
    if cuda:
        fig["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return fig


def main() -> None:
    from train import config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--data", type=Path, help="a folder with nanoGPT's train.bin (default: random tokens, resident)")
    p.add_argument("overrides", nargs="*", help="configs/gpt.yaml's key=value overrides, as python -m train's")
    args = p.parse_intermixed_args()
    cfg = config.load("configs/gpt.yaml", args.overrides)
    ranks = "WORLD_SIZE" in os.environ  # under torchrun: DDP
    if ranks:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    fig = train(cfg, args.data)
    if ranks:
        end_baseline(dist.get_rank(), args.out, fig)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "times.json").write_text(json.dumps(fig) + "\n")


if __name__ == "__main__":
    main()
