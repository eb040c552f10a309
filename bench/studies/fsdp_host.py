"""FSDP's host time a step, on one CPU process: what the Python of FSDP2's hooks costs where the model's own work
is negligible (a GPT of 12 blocks, 32 wide), against the same model unwrapped (one process's DDP strategy).

    python -m bench.studies.fsdp_host [--steps 40] [--layers 12] [--smoke]

On a GPU the host queues a step while the GPU runs the one before: this time is hidden as long as it stays under
the GPU's time a step (GPT-2 124M at 16 x 1024 on an H200: about 37 ms), and is the step's time once above it.
Each is timed by phase: forward and backward, gradient clipping, the optimizer (AdamW, foreach), zero_grad:
- model: the model itself, as one process trains under dist.strategy=ddp;
- fsdp: dist.strategy=fsdp, each block a unit (train/parallel/wrapping.py).
Zeroing the gradients instead of freeing them (FSDP2 then adds into them rather than making a DTensor for each
parameter's) was measured here too, 5 rounds: 44.5 ms a step against 44.4. Not kept.
A CPU overstates it: gloo hands each collective to a thread of its own, and CPU ranks free each block's
reduce-scatter input in Python (wrapping._one_block_at_a_time); a GPU's NCCL calls only queue kernels.
One gloo rank, one thread, bf16 autocast, eager; the variants in turn, 3 rounds: medians of milliseconds a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from bench.common import ROOT
from train import config, trainer
from train.parallel import wrapping

VARIANTS = ("model", "fsdp")
CONFIG = str(ROOT / "configs" / "gpt.yaml")


def timed(variant: str, layers: int, steps: int) -> dict:
    device = torch.device("cpu")
    sharded = variant == "fsdp"
    cfg = config.load(CONFIG, ["task.model=nano", f"task.n_layer={layers}", "task.seq_len=32", "train.precision=bf16",
                               f"dist.strategy={'fsdp' if sharded else 'ddp'}"])
    torch.manual_seed(0)
    task = cfg.task_class(cfg.task, 0)
    net = task.model()
    if not sharded:
        wrapping.materialize(net, task, device, 0)
    wrapped = wrapping.wrap(cfg, task, net, device)  # one process, ddp: the model itself
    if sharded:
        wrapping.materialize(net, task, device, 0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)
    step_loss = trainer.step_loss_fn(cfg, task, wrapped, device)
    g = task.gpt_config()
    x = torch.randint(0, g.vocab_size, (2, g.block_size + 1))
    batch = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
    parts = dict.fromkeys(("forward_backward", "clip", "optimizer", "zero_grad"), 0.0)

    def step():
        t0 = time.perf_counter()
        step_loss(batch).backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[key] += dt

    for _ in range(5):
        step()
    parts.update(dict.fromkeys(parts, 0.0))
    for _ in range(steps):
        step()
    ms = {k: round(v / steps * 1000, 2) for k, v in parts.items()}
    return {**ms, "total": round(sum(ms.values()), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3, help="each variant this many times, in turn: the medians")
    p.add_argument("--smoke", action="store_true", help="a few steps: a check of the script")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
    try:
        rounds = [{v: timed(v, args.layers, 3 if args.smoke else args.steps) for v in VARIANTS}
                  for _ in range(1 if args.smoke else args.rounds)]  # side by side, rounds against the noise
        fig = {v: {k: statistics.median(r[v][k] for r in rounds) for k in rounds[0][v]} for v in VARIANTS}
    finally:
        dist.destroy_process_group()
    fig["fsdp_extra_ms"] = round(fig["fsdp"]["total"] - fig["model"]["total"], 2)
    fig["fsdp_extra_ms_per_unit"] = round(fig["fsdp_extra_ms"] / (args.layers + 1), 2)  # the blocks and the root
    for v, f in fig.items():
        print(f"{v:18s} {json.dumps(f)}")
    print(json.dumps({"layers": args.layers, **fig}))


if __name__ == "__main__":
    main()
