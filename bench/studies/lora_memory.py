"""Each rank's peak memory and step time of a LoRA fine-tune and of a frozen-backbone one, against the full fine-tune
of the same model, under FSDP.

    python -m bench.studies.lora_memory [--nproc 2] [--layers 8] [--hidden 512] [--seq-len 128] [--steps 8]
    python -m bench.studies.lora_memory --device cuda --nproc 1 --layers 16 --hidden 2048   # a GPU

A random Llama (written here with transformers' save_pretrained, --layers decoder layers of width --hidden, MLP
8/3 wider, vocabulary 8192) and random token shards, trained three times by `python -m train.launch` with
configs/hf.yaml (FSDP2, AdamW), each rank one window of --seq-len tokens a step:
- full: every weight trains (task.lora_rank=0);
- frozen: only the last decoder layer, the final norm and the head train (FrozenBackbone below: requires_grad=False
  on the rest, which gives them no gradient, no AdamW state and no reduce-scatter);
- lora: LoRA adapters of rank --rank on q_proj and v_proj (task.lora_rank), the rest frozen.
On CPU ranks (gloo, fp32) a sampler thread in each rank (bench/suite/fsdp_run_memory.py's, started by a
sitecustomize.py: the run is not changed) records the peak RSS of its steps; on GPUs (bf16), the trainer's
peak_mem_gib (torch.cuda.max_memory_allocated, the highest rank's). The step time is the median of the steps after
the first (metrics.jsonl's step_time_s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, train_records
from bench.suite.fsdp_run_memory import OUT_VAR, labelled, sampling_site
from train.tasks.hf import CausalLM

VOCAB = 8192


class FrozenBackbone(CausalLM):
    """The Hugging Face task with every weight frozen but the last decoder layer's, the final norm's and the
    head's."""

    def model(self):
        model = super().model()
        last = len(self.blocks(model)) - 1
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith((f"model.layers.{last}.", "model.norm.", "lm_head.")))
        return model


def make_model(folder: Path, layers: int, hidden: int) -> int:
    """A random Llama saved in `folder`; its parameters."""
    import torch
    import transformers

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, intermediate_size=hidden * 8 // 3,
                                      vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def make_shards(folder: Path, tokens: int) -> None:
    import numpy as np

    from train.tasks import shards

    folder.mkdir()
    rng = np.random.default_rng(0)
    shards.write_shard(folder / "random_train_000000.bin", rng.integers(0, VOCAB, tokens, dtype=np.uint16))
    shards.write_shard(folder / "random_val_000000.bin", rng.integers(0, VOCAB, tokens // 8, dtype=np.uint16))


MODES = {"full": [], "frozen": ["task.name=bench.studies.lora_memory:FrozenBackbone"],
         "lora": ["task.lora_rank={rank}"]}


def run(args: argparse.Namespace, mode: str, work: Path) -> dict:
    out, run_dir, site = work / f"rss-{mode}", work / f"run-{mode}", sampling_site(work)
    out.mkdir()
    cuda = args.device == "cuda"
    cmd = [sys.executable, "-m", "train.launch", f"--nproc-per-node={args.nproc}", "--", "--config", "configs/hf.yaml",
           f"run.dir={run_dir}", f"task.path={work / 'model'}", f"task.data={work / 'shards'}",
           f"task.seq_len={args.seq_len}", *(m.format(rank=args.rank) for m in MODES[mode]),
           f"train.steps={args.steps}", f"train.global_batch_size={args.nproc}", "train.micro_batch_size=1",
           "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", "data.num_workers=0",
           "log.wandb.mode=disabled", "log.report=false", "resume=never", "optim.warmup_steps=0",
           f"train.precision={'bf16' if cuda else 'fp32'}", "dist.strategy=fsdp", *args.overrides]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])}
    if not cuda:
        env[OUT_VAR] = str(out)
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    log = (run_dir / "logs" / "rank0.log").read_text()
    line = next(x for x in log.splitlines() if "INFO model: " in x)
    whole = int(line.split("model: ")[1].split(" parameters")[0].replace(",", ""))
    trained = int(line.split("; ")[1].split(" of them")[0].replace(",", "")) if "trained, the rest" in line else whole
    records = train_records(run_dir)
    figures = {"trained": trained, "step_s": statistics.median(r["step_time_s"] for r in records[1:]),
               "wall_s": time.time() - t}
    if cuda:
        figures["peak_gib"] = max(r.get("peak_mem_gib", 0.0) for r in records)
    else:  # each rank's peak RSS over its steps (the first, and the later ones)
        phases = [labelled(json.loads((out / f"rank{r}.json").read_text())["phases"]) for r in range(args.nproc)]
        figures["rank_step_mib"] = [max(p.get("step 1", 0.0), p.get("steps", 0.0)) for p in phases]
        figures["rank_start_mib"] = [p.get("start", 0.0) for p in phases]
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rank", type=int, default=8, help="the LoRA rank")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--modes", default="full,frozen,lora")
    p.add_argument("--json")
    args, args.overrides = p.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="lora-memory-") as d:
        work = Path(d)
        params = make_model(work / "model", args.layers, args.hidden)
        make_shards(work / "shards", max(20_000, 4 * args.steps * args.nproc * (args.seq_len + 1)))
        results = {}
        for mode in args.modes.split(","):
            results[mode] = run(args, mode, work)
            print(f"  {mode}: {results[mode]['wall_s']:.0f} s", flush=True)
    m = params * 4 / 2**20
    where = f"{args.nproc} GPU rank(s), bf16" if args.device == "cuda" else f"{args.nproc} CPU ranks (gloo), fp32"
    print(f"FSDP on {where}, AdamW: a Llama of {args.layers} layers of width {args.hidden} ({params / 1e6:.1f}M "
          f"parameters, M = {m:.0f} MiB in fp32), a window of {args.seq_len} tokens a rank a step")
    full = results.get("full")
    for mode, f in results.items():
        if args.device == "cuda":
            memory = f"peak {f['peak_gib']:.2f} GiB"
            if full and mode != "full":
                memory += f" ({f['peak_gib'] - full['peak_gib']:+.2f} GiB against full)"
        else:
            memory = "peak RSS of the steps " + ", ".join(f"rank {r}: {x:.0f} MiB" for r, x in
                                                          enumerate(f["rank_step_mib"]))
            if full and mode != "full":
                diffs = [(x - y) / m for x, y in zip(f["rank_step_mib"], full["rank_step_mib"], strict=True)]
                memory += " (" + ", ".join(f"{x:+.2f} M" for x in diffs) + " against full)"
        time_ = f"step {f['step_s'] * 1e3:.0f} ms"
        if full and mode != "full":
            time_ += f" (x{f['step_s'] / full['step_s']:.2f})"
        print(f"{mode:7s} {f['trained'] / 1e6:8.2f}M trained ({f['trained'] / params:6.2%}); {memory}; {time_}")
    if args.json:
        Path(args.json).write_text(json.dumps({"parameters": params, "modes": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
