"""Peak host memory (RSS) per rank while the trainer builds a model, against the model's size M.

    python -m bench.suite.build_memory [--nproc 2] [--layers 16] [--embd 1024] [--strategy fsdp] [--json OUT]
    python -m bench.suite.build_memory ... --only cpu      # only the model built whole on every rank's CPU first
    python -m bench.suite.build_memory ... --init-from DIR # then load a HF GPT-2 folder of those sizes (task.init_from)

Each rank runs trainer.build (the model, its sharding and its initial values: train/parallel/wrapping.py)
on the built-in GPT (vocabulary 256, so that nearly all of M is in the blocks), then reports its peak
RSS (VmHWM) above what it held before the build. Built on the meta device and sharded by FSDP2, a rank
should hold about M / world plus a constant (one whole tensor at a time while it is initialized); built
on the CPU (the model constructed whole, as before the meta device), every rank holds M. Both by default.
--save FILE writes the model's whole initial weights (rank 0), for comparing builds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from bench.common import PY, ROOT, env, write_json


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rank_main(args: argparse.Namespace, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from train import config, trainer
    from train.checkpoint import resume
    from train.parallel import distributed

    cfg = config.load(args.config, overrides)
    denv = distributed.detect()
    config.validate(cfg, denv.world_size, denv.local_world_size)
    device = distributed.setup(denv, cfg.dist.backend, cfg.dist.timeout_s)
    if args.cpu_build:  # the model constructed whole on the CPU, as tasks did before the meta device
        from train.tasks.gpt import LanguageModel
        from train.tasks.gpt_model import GPT

        LanguageModel.model = lambda self: GPT(self.gpt_config())
    trainer.configure_torch(cfg)
    before = status_kib("VmRSS")
    built = trainer.build(cfg, denv, device, resume.agree(cfg, denv.rank, denv.world_size))
    peak = status_kib("VmHWM")
    row = {"rank": denv.rank, "rss_before_mib": before / 1024, "peak_mib": peak / 1024,
           "increase_mib": (peak - before) / 1024}
    if source := built.task.init_from():  # then its weights, as the trainer loads them before the first step
        from train.checkpoint import pretrained

        pretrained.load(built.state.model, built.task, source, built.log)
        row["load_increase_mib"] = (status_kib("VmHWM") - before) / 1024
    model_bytes = sum(p.numel() * p.element_size() for p in built.state.model.parameters())  # DTensors: whole shapes
    rows = [None] * denv.world_size
    dist.all_gather_object(rows, row)
    if args.save:
        full = get_model_state_dict(built.state.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if denv.rank == 0:
            torch.save(full, args.save)
    if denv.rank == 0:
        out = {"model_mib": model_bytes / 2**20, "world": denv.world_size, "ranks": rows}
        Path(args.out).write_text(json.dumps(out))
    built.log.close(0)
    distributed.teardown()
    distributed.exit_process(0)  # not the interpreter's exit: gloo's threads may outlive the group (SIGABRT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--strategy", default="fsdp", choices=("ddp", "fsdp"))
    p.add_argument("--only", choices=("meta", "cpu"), help="one build (default: both)")
    p.add_argument("--cpu-build", action="store_true", help=argparse.SUPPRESS)  # a rank of the cpu build
    p.add_argument("--save", help="rank 0 writes the model's whole initial weights here (torch.save)")
    p.add_argument("--init-from", help="then load these weights (task.init_from: a HF GPT-2 folder of the same "
                                        "sizes, or a run's checkpoint), and report the peak after the load too")
    p.add_argument("--config", default="configs/gpt.yaml")
    p.add_argument("--smoke", action="store_true", help="seconds: a small model")
    p.add_argument("--json")
    p.add_argument("--rank-out", help=argparse.SUPPRESS)  # set for the ranks by main()
    args, overrides = p.parse_known_args()
    if args.rank_out:
        args.out = args.rank_out
        rank_main(args, overrides)
        return
    if args.smoke:  # seconds: a small model, built on meta only
        args.layers, args.embd, args.only = 2, 64, args.only or "meta"
    with tempfile.TemporaryDirectory(prefix="build-memory-") as d:
        results = {}
        for name, cpu in (("meta", False), ("cpu", True)):
            if args.only not in (None, name):
                continue
            out = Path(d) / f"{name}.json"
            cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   "-m", "bench.suite.build_memory",
                   "--rank-out", str(out), *(["--cpu-build"] if cpu else []),
                   *(["--save", args.save] if args.save else []),
                   "--config", args.config, f"run.dir={d}/run-{name}", "log.wandb.mode=disabled", "log.report=false",
                   "task.data=builtin", "task.train_tokens=20000", "task.eval_tokens=5000", "task.seq_len=64",
                   *([] if args.init_from else  # a HF folder's config.json gives the sizes
                     ["task.vocab_size=256", f"task.n_layer={args.layers}", f"task.n_embd={args.embd}",
                      "task.n_head=8"]),
                   f"dist.strategy={args.strategy}", "data.num_workers=0", "resume=never",
                   f"train.global_batch_size={args.nproc}", "train.micro_batch_size=1",
                   *([f"task.init_from={args.init_from}"] if args.init_from else []), *overrides]
            subprocess.run(cmd, cwd=ROOT, env=env(), check=True)
            results[name] = json.loads(out.read_text())
            r = results[name]
            worst = max(x["increase_mib"] for x in r["ranks"])
            print(f"{name} build, {args.strategy}, {r['world']} ranks: model M = {r['model_mib']:.0f} MiB; "
                  f"peak RSS above the start, per rank: " + ", ".join(f"{x['increase_mib']:.0f}" for x in r["ranks"])
                  + f" MiB (worst {worst / r['model_mib']:.2f} M)", flush=True)
            if "load_increase_mib" in r["ranks"][0]:
                worst = max(x["load_increase_mib"] for x in r["ranks"])
                print(f"  then its weights from {args.init_from}: peak RSS above the start, per rank: "
                      + ", ".join(f"{x['load_increase_mib']:.0f}" for x in r["ranks"])
                      + f" MiB (worst {worst / r['model_mib']:.2f} M)", flush=True)
    if args.json:
        figures = {"build_model_mib": next(iter(results.values()))["model_mib"]}
        for name, r in results.items():
            figures[f"build_peak_over_m_{name}"] = max(x["increase_mib"] for x in r["ranks"]) / r["model_mib"]
            figures[f"build_peak_mib_{name}"] = max(x["increase_mib"] for x in r["ranks"])
        write_json(args.json, figures)


if __name__ == "__main__":
    main()
