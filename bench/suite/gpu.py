"""GPU training throughput on synthetic data (run it where a GPU is; `--smoke` runs a tiny CPU version).

    python -m bench.suite.gpu [--steps 50] [--json OUT]

- ResNet-50, 224x224, batch 256, bf16 autocast, channels_last, with and without torch.compile:
  images/s per GPU, against NVIDIA's published 2,470 images/s for ResNet-50 with AMP on one A100 80GB
  (DeepLearningExamples); the goal on an H100 is at least 1.5x that.
- ResNet-18 on CIFAR-sized input (32x32, the CIFAR stem), batch 256, bf16, channels_last.
- The AMP speed-up: ResNet-50 in bf16 against fp32 (TF32 matmuls, the project's default).
- GPT-2 small (124M, the `gpt2` preset of train/tasks/gpt_model.py) in the bare loop of the GPT
  (bench/baselines/gpt.py), 1024-token windows, micro-batch 16, bf16 autocast, torch.compile, fused AdamW: tokens/s
  and MFU (nanoGPT's 6N + attention FLOPs per token, against the
  device's dense bf16 peak); llm.c reports about 40% MFU for it on an H100, the goal here.
One process, one GPU, the project's model builder; timing with CUDA events after warm-up steps.

    torchrun --nproc-per-node 8 -m bench.suite.gpu --lm [--steps 20] [--micro-batch 8] [--compile] [--json OUT]

- The language model (GPT-2 small, 124M, windows of 1024 tokens, micro-batch 8 per GPU, bf16, AdamW) wrapped by
  train/parallel/wrapping.py with DDP and with FSDP (dist.strategy): tokens/s over all GPUs and the peak memory of
  the fullest GPU. `--lm --smoke` runs it on CPU ranks (gloo) with the nano model: a check of the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import trace_summary, write_json
from train.observe.metrics import peak_flops
from train.tasks.image import ImageClassification

A100_RESNET50_AMP = 2470.0  # images/s, NVIDIA DeepLearningExamples, 1x A100 80GB, AMP


def seconds_per_step(loss, opt: torch.optim.Optimizer, steps: int, device: torch.device, warmup: int) -> float:
    """The mean time of a training step (loss(), backward, optimizer) after warm-up steps (and compilation)."""
    def step():
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(max(warmup, steps // 5)):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def images_per_s(name: str, size: int, batch: int, precision: str, compile_: bool, steps: int,
                 device: torch.device, warmup: int = 3) -> float:
    cfg = ImageClassification.Config(model=name, image_size=size, num_classes=1000 if size > 64 else 10)
    net = ImageClassification(cfg, 0).model().to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    step_model = torch.compile(net) if compile_ else net
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]

    def loss():
        with torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32"):
            return F.cross_entropy(step_model(x), y)

    return batch / seconds_per_step(loss, opt, steps, device, warmup)


def gpt_tokens_per_s(smoke: bool, steps: int) -> dict:
    """GPT-2 124M (the nano model in the smoke) through the bare loop of the GPT (bench/baselines/gpt.py), in this
    process: random tokens on the device, 16 x 1024, bf16, compiled with its loss; tokens/s (the median of windows of
    steps // 5 steps after two such windows) and the MFU where the device's peak is known."""
    from bench.baselines import gpt
    from train import config

    every = 1 if smoke else max(1, steps // 5)
    size = ["task.model=nano", "task.seq_len=32", "train.micro_batch_size=2", "train.precision=fp32"] if smoke else \
        ["task.model=gpt2", "task.seq_len=1024", "task.vocab_size=50304", "train.micro_batch_size=16",
         "train.precision=bf16", "train.compile=true"]
    size += [f"train.global_batch_size={2 if smoke else 16}", f"train.steps={4 if smoke else steps + 2 * every}"]
    cfg = config.load("configs/gpt.yaml", [*size, f"train.log_every={every}"])
    fig = gpt.train(cfg)
    out = {"gpt2_tokens_per_s": gpt.tokens_per_s(fig, every, skip=1 if smoke else 2)}
    peak = peak_flops(fig["device"], fig["precision"], True) if torch.cuda.is_available() else None
    if peak:
        out["gpt2_mfu"] = out["gpt2_tokens_per_s"] * fig["flops_per_token"] / peak
    return out


def _lm_run(strategy: str, model: str, batch: int, seq: int, compile_: bool, warmup: int, steps: int,
            device: torch.device, trace: bool = True) -> tuple[float, float, dict | None]:
    """Tokens/s over all ranks, the largest peak of allocated memory of any rank (0 on CPU), and rank 0's trace of
    3 steps more (trace_summary; None on the other ranks)."""
    import torch.distributed as dist

    from train import config, optim, trainer
    from train.parallel import wrapping

    cuda, world, sharded = device.type == "cuda", dist.get_world_size(), strategy.startswith("fsdp")
    cfg = config.load("configs/gpt.yaml", [f"task.model={model}", "task.vocab_size=50304", f"task.seq_len={seq}",
                                           "optim.name=adamw", "train.precision=bf16", f"train.compile={compile_}",
                                           f"dist.strategy={'fsdp' if sharded else 'ddp'}",
                                           f"dist.reshard_after_forward={strategy != 'fsdp_keep'}"])
    torch.manual_seed(0)
    task = cfg.task_class(cfg.task, 0)
    net = task.model()  # on the meta device: given its memory as the trainer does
    if not sharded:
        wrapping.materialize(net, task, device, 0)
    if strategy == "ddp":  # DDP itself, also on one process (where the trainer trains the plain model)
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(net, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True)
    elif strategy in ("fsdp_pairs", "fsdp_fp32"):
        wrapped = _fsdp_other(strategy, task, net)
    else:
        wrapped = wrapping.wrap(cfg, task, net, device)  # plain: one process's DDP strategy, the model itself
    if sharded:
        wrapping.materialize(net, task, device, 0)
    opt = optim.build(cfg.optim, net)
    step_loss = trainer.step_loss_fn(cfg, task, wrapped, device)  # compiled as the trainer compiles (train.compile)
    if strategy == "fsdp_model" and compile_:  # the FSDP module compiled alone, its loss eager (the trainer's way
        model = torch.compile(wrapped)  # until 7b771c3: FSDP / DDP 0.85 on an H200 then, 0.50 after)

        def step_loss(batch):
            with wrapping.autocast(cfg, device):
                return task.loss(model, batch)
    g = task.gpt_config()
    x = torch.randint(0, g.vocab_size, (batch, g.block_size + 1), device=device)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step():
        step_loss((inp, tgt)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else 0], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    summary = _traced(step, 3, cuda, trace and dist.get_rank() == 0)  # every rank steps (collectives); rank 0 traces
    return world * batch * g.block_size * steps / seconds, peak.item(), summary


def _fsdp_other(strategy: str, task, net: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 as train/parallel/wrapping.py shards the GPT (bf16), with fewer calls of its hooks a step, at a cost
    each: fsdp_pairs, two blocks a unit (half the units; a unit holds two blocks gathered); fsdp_fp32, the
    parameters gathered in fp32 and cast by autocast inside the compiled blocks (one copy a parameter, not a cast
    and a copy; twice an all-gather's bytes on several GPUs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=None if strategy == "fsdp_fp32" else torch.bfloat16,
                              reduce_dtype=torch.float32)
    blocks, size = list(task.blocks(net)), 2 if strategy == "fsdp_pairs" else 1
    units = [blocks[i:i + size] for i in range(0, len(blocks), size)]
    for unit in units:  # the last unit stays gathered for its backward, as wrapping.wrap's last block
        fully_shard(unit if size > 1 else unit[0], reshard_after_forward=unit is not units[-1], mp_policy=mp)
    fully_shard(net, mp_policy=mp)
    return net


def _traced(step, steps: int, cuda: bool, traced: bool) -> dict | None:
    """A torch.profiler trace of `steps` more steps, summed up (bench/_util.py's trace_summary): the host's time a
    step against the GPU's busy share, the kernels that take the time, the host's waits. Untraced: the steps
    alone (None)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    if not traced:
        for _ in range(steps):
            step()
        return None

    with tempfile.TemporaryDirectory() as d:
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(steps):
                with torch.profiler.record_function(f"ProfilerStep#{_}"):
                    step()
            if cuda:
                torch.cuda.synchronize()
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return trace_summary(path, steps, top=6)


def lm_strategies(steps: int, smoke: bool, batch: int = 16, compile_: bool = False,
                  variants: tuple[str, ...] = ("ddp", "fsdp"), trace: bool = True) -> dict:
    """DDP against FSDP for the language model, under torchrun: every rank runs this."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model, seq, warmup = ("nano", 32, 1) if smoke else ("gpt2", 1024, 3 + 2 * compile_)
    batch = 2 if smoke else batch
    fig: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "lm_world_size": world,
                 "lm_micro_batch": batch, "lm_seq_len": seq, "lm_compile": compile_}
    done = []
    for name in variants:
        strategy, _, size = name.partition("_b")  # fsdp_b32: FSDP at a micro-batch of 32
        torch._dynamo.reset()  # each variant compiles as in a process of its own: a new batch size stays static
        t = time.perf_counter()
        try:
            tokens_s, peak, summary = _lm_run(strategy, model, int(size) if size and not smoke else batch, seq,
                                              compile_, warmup, steps, device, trace)
        except Exception as e:  # a variant that fails says so; the others are measured (every rank fails alike)
            fig[f"lm_{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            continue
        done.append(name)
        fig[f"lm_{name}_seconds"] = round(time.perf_counter() - t, 1)  # its build, compilation, steps and trace
        fig[f"lm_{name}_tokens_per_s"], fig[f"lm_{name}_peak_gib_per_gpu"] = tokens_s, peak / 2**30
        if summary is not None:
            fig[f"lm_{name}_trace"] = summary
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for name in done:  # each against DDP and the model alone at its own micro-batch (the same _bN)
        size = name[len(name.partition("_b")[0]):]  # "" or "_b32"
        for base in (f"ddp{size}", f"plain{size}"):
            if base == name or base not in done:
                continue
            if cuda:
                fig[f"lm_{name}_over_{base}_memory"] = (fig[f"lm_{name}_peak_gib_per_gpu"]
                                                        / fig[f"lm_{base}_peak_gib_per_gpu"])
            fig[f"lm_{name}_over_{base}_speed"] = fig[f"lm_{name}_tokens_per_s"] / fig[f"lm_{base}_tokens_per_s"]
    dist.destroy_process_group()
    return fig if rank == 0 else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="seconds, on CPU: tiny sizes, no compile")
    p.add_argument("--lm", action="store_true", help="DDP against FSDP for the language model (under torchrun)")
    p.add_argument("--micro-batch", type=int, default=16, help="--lm: windows of 1024 tokens a GPU a step")
    p.add_argument("--variants", default="ddp,fsdp", help="--lm: of plain (the model itself, as one process trains), "
                   "ddp, fsdp, fsdp_keep (fsdp, dist.reshard_after_forward=false: each block gathered once a step), "
                   "fsdp_model (fsdp, --compile compiling the model alone, not with its loss), fsdp_pairs (two blocks "
                   "a unit), fsdp_fp32 (parameters gathered in fp32, cast by autocast); "
                   "_bN after one (fsdp_b32) measures it at a micro-batch of N, against ddp_bN")
    p.add_argument("--compile", action="store_true", help="--lm: torch.compile the wrapped model")
    p.add_argument("--no-trace", action="store_true", help="--lm: no torch.profiler trace of each variant")
    p.add_argument("--json")
    args = p.parse_args()
    if args.lm:
        if not args.smoke and not torch.cuda.is_available():
            raise SystemExit("bench/gpu.py --lm needs CUDA GPUs (or --smoke for a CPU check of the script)")
        fig = lm_strategies(args.steps if not args.smoke else 1, args.smoke, args.micro_batch, args.compile,
                            tuple(args.variants.split(",")), not args.no_trace)
        for k, v in fig.items():
            print(f"{k:28s} {v if isinstance(v, str) else json.dumps(v) if isinstance(v, dict) else f'{v:.3f}'}")
        if fig:
            write_json(args.json, fig)
        return
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU (or --smoke for a CPU check of the script)")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    device = torch.device("cpu" if args.smoke else "cuda")
    big, small, batch, steps = (224, 32, 256, args.steps) if not args.smoke else (16, 16, 2, 1)
    warmup = 3 if not args.smoke else 0  # the smoke checks the script runs (one step each); its figures mean nothing
    name = "resnet50" if not args.smoke else "resnet18"
    fig = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"}
    fig["resnet50_bf16"] = images_per_s(name, big, batch, "bf16", False, steps, device, warmup)
    fig["resnet50_fp32"] = images_per_s(name, big, batch, "fp32", False, steps, device, warmup)
    fig["resnet50_bf16_compile"] = images_per_s(name, big, batch, "bf16", not args.smoke, steps, device, warmup)
    fig["resnet18_cifar_bf16"] = images_per_s("resnet18", small, batch, "bf16", False, steps, device, warmup)
    fig |= gpt_tokens_per_s(args.smoke, steps)
    fig["amp_speedup"] = fig["resnet50_bf16"] / fig["resnet50_fp32"]
    best = max(fig["resnet50_bf16"], fig["resnet50_bf16_compile"])
    fig["vs_a100_published"] = best / A100_RESNET50_AMP
    for k, v in fig.items():
        print(f"{k:24s} {v if isinstance(v, str) else f'{v:.2f}'}")
    print(f"ResNet-50 best {best:.0f} images/s = {fig['vs_a100_published']:.2f}x NVIDIA's A100 80GB AMP figure "
          f"({A100_RESNET50_AMP:.0f}); goal on an H100: >= 1.5x")
    if "gpt2_mfu" in fig:
        print(f"GPT-2 124M: {fig['gpt2_tokens_per_s']:.0f} tokens/s, MFU {fig['gpt2_mfu']:.1%}; goal (llm.c on an "
              f"H100): >= 40%")
    write_json(args.json, fig)


if __name__ == "__main__":
    main()
