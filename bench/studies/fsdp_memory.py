"""Bytes each rank holds for the language model's parameters, gradients and AdamW state, DDP against FSDP.

    python -m bench.studies.fsdp_memory [--nproc 2] [--model tiny] [--json OUT]

On CPU ranks (gloo), counted after one training step (gradients kept): the tensors themselves, as
train/parallel/wrapping.py wraps the model for dist.strategy=ddp and fsdp; a DTensor counts its local shard. FSDP's
share should be about 1/world of DDP's (a little more: shards are padded to equal sizes). Activations and the
parameters FSDP gathers for one block at a time are not counted (they live only during forward/backward).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import write_json


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    return {"params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_bytes(v) for state in optimizer.state.values() for v in state.values()
                             if torch.is_tensor(v))}


def worker(rank: int, world: int, port: int, model: str, strategy: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from train import config, optim
        from train.parallel import wrapping

        cfg = config.load("configs/gpt.yaml", [f"task.model={model}", f"dist.strategy={strategy}",
                                               "optim.name=adamw"])
        torch.manual_seed(0)
        task = cfg.task_class(cfg.task, 0)
        net, cpu = task.model(), torch.device("cpu")  # on the meta device: given its memory as the trainer does
        if strategy == "ddp":
            wrapping.materialize(net, task, cpu, 0)
        wrapped = wrapping.wrap(cfg, task, net, cpu)
        if strategy == "fsdp":
            wrapping.materialize(net, task, cpu, 0)
        optimizer = optim.build(cfg.optim, net)
        T = task.gpt_config().block_size
        x = torch.randint(0, task.gpt_config().vocab_size, (2, T + 1))
        task.loss(wrapped, (x[:, :-1].contiguous(), x[:, 1:].contiguous())).backward()
        optimizer.step()
        counts = [None] * world
        dist.all_gather_object(counts, held(net, optimizer))
        if rank == 0:
            out.put(counts)
    finally:
        dist.destroy_process_group()
    from train.parallel.distributed import exit_process

    exit_process(0)  # not through Python's finalization, which DDP's gloo threads can abort (see there)


def measure(model: str, strategy: str, nproc: int) -> list[dict[str, int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(worker, args=(nproc, port, model, strategy, out), nprocs=nproc, start_method="spawn")
    return out.get()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="tiny",
                   help="a preset of train/tasks/gpt_model.py: nano, tiny, gpt2 (~2 GB per DDP rank)")
    p.add_argument("--smoke", action="store_true", help="the nano model")
    p.add_argument("--json")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = "nano" if args.smoke else args.model
    fig = {}
    for strategy in ("ddp", "fsdp"):
        ranks = measure(model, strategy, args.nproc)
        worst = max(ranks, key=lambda r: sum(r.values()))
        fig[strategy] = worst
        print(f"{strategy:5s} per rank (largest of {args.nproc}): " + ", ".join(
            f"{k} {v / 2**20:.2f} MiB" for k, v in worst.items()) + f", total {sum(worst.values()) / 2**20:.2f} MiB")
    fig["ratio"] = sum(fig["fsdp"].values()) / sum(fig["ddp"].values())
    print(f"FSDP / DDP bytes per rank: {fig['ratio']:.3f} (1/world = {1 / args.nproc:.3f}), model {model}")
    write_json(args.json, fig)


if __name__ == "__main__":
    main()
