"""The nanoGPT-style DDP loop a user writes: the speed baseline of `python -m train` on the language model.

    torchrun --nproc-per-node 2 bench/bare_gpt.py OUT_DIR DATA_DIR --steps 60 --micro-batch 16 \
        --model tiny --vocab-size 64 --seq-len 128 --lr 3e-3

As nanoGPT's train.py does it: DATA_DIR/train.bin (bare uint16 tokens) read through np.memmap, random
windows drawn with torch.randint on each rank (get_batch), the same GPT (train/tasks/gpt_model.py: the template's
model math, imported), AdamW over nanoGPT's two parameter groups (weight decay on matrices only),
linear warm-up then cosine decay, clipping at 1.0, and DDP with the template's default settings
(bucket_cap_mb=25, gradient_as_bucket_view=True). One micro-batch a step (no accumulation); rank 0 prints
its loss every --log-every steps (loss.item(), no all-reduce, as nanoGPT). No checkpoints, no evaluation,
no stop handling. Rank 0 writes OUT_DIR/times.json: the wall clock (time.time()) after each step.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _util import end_baseline
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train.tasks.gpt_model import GPT, preset  # noqa: E402  (the model math only)

p = argparse.ArgumentParser()
p.add_argument("out", type=Path)
p.add_argument("data", type=Path)
p.add_argument("--steps", type=int, default=60)
p.add_argument("--micro-batch", type=int, default=16)
p.add_argument("--model", default="tiny")
p.add_argument("--vocab-size", type=int, default=64)
p.add_argument("--seq-len", type=int, default=128)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--min-lr-ratio", type=float, default=0.1)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--weight-decay", type=float, default=0.1)
p.add_argument("--beta2", type=float, default=0.95)
p.add_argument("--grad-clip", type=float, default=1.0)
p.add_argument("--log-every", type=int, default=10)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(args.seed)  # the same initial weights on every rank
model = GPT(preset(args.model, vocab_size=args.vocab_size, block_size=args.seq_len))
ddp = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)
decay = [q for q in model.parameters() if q.dim() >= 2]
no_decay = [q for q in model.parameters() if q.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                         {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, args.beta2))
torch.manual_seed(args.seed + 1337 + rank)  # each rank draws its own windows


def get_batch():
    data = np.memmap(args.data / "train.bin", dtype=np.uint16, mode="r")  # reopened each batch, as nanoGPT
    ix = torch.randint(len(data) - args.seq_len, (args.micro_batch,))
    x = torch.stack([torch.from_numpy(data[i:i + args.seq_len].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.seq_len].astype(np.int64)) for i in ix])
    return x, y


def get_lr(it):
    if it < args.warmup:
        return args.lr * (it + 1) / args.warmup
    progress = min(1.0, (it - args.warmup) / max(1, args.steps - args.warmup))
    floor = args.lr * args.min_lr_ratio
    return floor + (args.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


times = []
x, y = get_batch()
for it in range(args.steps):
    for group in opt.param_groups:
        group["lr"] = get_lr(it)
    logits = ddp(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    x, y = get_batch()  # the next batch, as nanoGPT fetches it while the device works
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.time())
    if rank == 0 and (it + 1) % args.log_every == 0:
        print(f"iter {it + 1}: loss {loss.item():.4f}", flush=True)
end_baseline(rank, args.out, times)
