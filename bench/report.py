"""Run every benchmark of bench/suite/ and write BENCHMARKS.md: `make bench` (or `--smoke`: seconds each, as CI does).

    python -m bench all [--smoke] [--out BENCHMARKS.md] [--gpu-json FILE [--gpu-only]]

The GPU figures: bench/suite/gpu.py's where a GPU is present (the smoke: on the CPU), or --gpu-json's: the JSON that
`python -m bench.suite.gpu --json` wrote on a GPU machine, or `make gpu-check`'s gpu_check.json (a GPU table of its
own, the GPU, driver, torch and CUDA named). Without a GPU or --gpu-json, the GPU table is the last `make gpu-check`
kept in docs/dev/gpu/ (the newest file by name: they are dated), named with the commit that added it; the page's head
says which.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import PY, ROOT

BENCHES = ["overhead", "lm_overhead", "throughput", "checkpoint", "recovery", "build_memory", "export_memory",
           "fsdp_run_memory", "packing", "gpu"]
# --smoke: throughput's ImageFolder run (2 gloo processes, python -m train, default workers) is overhead's.
SHARED = {"overhead": ("--runs-dir", "overhead"), "throughput": ("--imagefolder-run", "overhead/ours0")}

# (figure, key, goal text, is the goal met?)
ROWS = [
    ("overhead: python -m train / the user's DDP loop, step time, median of rounds (2 gloo procs, CPU)",
     "overhead_ratio", "<= 1.02", None),
    ("  min of rounds", "overhead_ratio_min", "", None),
    ("  max of rounds", "overhead_ratio_max", "", None),
    ("  goal met by more than the spread (1.02 - median > max - min)", "overhead_goal_met", "yes",
     lambda v: v is True),
    ("overhead: final weights bitwise equal to the same math in a bare loop", "bitwise_equal", "yes",
     lambda v: v is True),
    ("overhead, language model: python -m train / a nanoGPT-style DDP loop, step time, median of rounds "
     "(2 gloo procs, CPU)", "lm_overhead_ratio", "<= 1.02", None),
    ("  min of rounds", "lm_overhead_ratio_min", "", None),
    ("  max of rounds", "lm_overhead_ratio_max", "", None),
    ("  goal met by more than the spread (1.02 - median > max - min)", "lm_overhead_goal_met", "yes",
     lambda v: v is True),
    ("same 2 cores: samples/s, 1 process x 2 threads, CPU (not scaling)", "samples_per_s_1proc", "", None),
    ("same 2 cores: samples/s, 2 gloo processes x 1 thread, CPU (not scaling)", "samples_per_s_2proc", "", None),
    ("same 2 cores: 2 processes / 1 process (not scaling: no hardware added)", "scaling_2_over_1", "", None),
    ("data wait share of a step, built-in data, default workers", "data_wait_share_builtin_2proc", "", None),
    ("data wait share of a step, ImageFolder (PNG), default workers", "data_wait_share_imagefolder_2proc", "", None),
    ("checkpoint save, 2 ranks / one process's torch.save + fsync", "save_ratio_fsync", "<= 1.0",
     lambda v: v <= 1.0),
    ("checkpoint save, 2 ranks / the disk's write of the same bytes (dd conv=fsync)", "save_ratio_dd", "<= 1.5",
     lambda v: v <= 1.5),
    ("  dd conv=fsync of those bytes: min / median / max, s", "dd_fsync_spread", "", None),
    ("checkpoint load, 2 ranks / one process's torch.load(mmap=True) (into model + optimizer)", "load_ratio_mmap",
     "", None),
    ("async save: training blocked / synchronous save", "async_blocking_ratio", "<= 0.05", lambda v: v <= 0.05),
    ("async save: step time while it writes / without", "step_slowdown_during_async_save", "<= 1.2",
     lambda v: v <= 1.2),
    ("building a model of M bytes (the GPT, 200M parameters), 2 gloo ranks, FSDP: M, MiB", "build_model_mib", "", None),
    ("  peak RSS per rank / M, built on the meta device", "build_peak_over_m_meta", "<= 0.75",
     lambda v: v <= 0.75),
    ("  peak RSS per rank / M, built whole on the CPU (as before)", "build_peak_over_m_cpu", "", None),
    ("export --format hf of a model of M bytes (the GPT, 200M parameters, trained under FSDP on 2 gloo ranks) to "
     "100 MB files: M, MiB", "export_model_mib", "", None),
    ("  peak RSS above the start / M (after the imports)", "export_peak_over_m", "<= 0.3", lambda v: v <= 0.3),
    ("  the largest file, MiB", "export_largest_file_mib", "", None),
    ("  the imports before the start (transformers' GPT-2 modeling), MiB", "export_imports_mib", "", None),
    ("  from_pretrained gives the trained logits", "export_logits_equal", "yes", lambda v: v is True),
    ("a whole FSDP run (build, 2 steps, saves, evaluations, the end) of the GPT, 252M parameters, 4 gloo ranks, "
     "SGD without momentum: M, MiB", "run_memory_model_mib", "", None),
    ("  peak RSS per rank above the same run with the tiny model / M", "run_memory_peak_over_m", "<= 0.6",
     lambda v: v <= 0.6),
    ("  a step's floor: the shards of parameters and gradients, one block's parameters and gradients / M",
     "run_memory_floor_over_m", "", None),
    ("  during the saves / M", "run_memory_save_over_m", "", None),
    ("  during the evaluations / M", "run_memory_eval_over_m", "", None),
    ("  at the end (ranks_in_sync, the summary) / M", "run_memory_end_over_m", "", None),
    ("packed conversations / a conversation a window, counted tokens a CPU-second of a step (the tiny GPT, windows "
     "of 2048, lengths lognormal, median 300, 5% longer; 1 thread, CPU)", "packing_ratio_cpu", ">= 3",
     lambda v: v >= 3),
    ("  the same, the trainer's counted tokens/s (wall clock; median of rounds)", "packing_ratio", "", None),
    ("  padding share, packed", "packed_padding_share", "<= 0.05", lambda v: v <= 0.05),
    ("  padding share, a conversation a window", "unpacked_padding_share", "", None),
    ("  counted tokens/s, packed", "packed_counted_tokens_per_s", "", None),
    ("pretraining with task.doc_mask / without, tokens/s (the same tokens; SDPA a document, on the CPU)",
     "doc_mask_cost",
     "", None),
    ("recovery after SIGKILL of a worker: total, s", "recovery_total_s", "<= 3", lambda v: v <= 3),
    ("  detection, s", "recovery_detection_s", "", None),
    ("  restart (stop group + rendezvous), s", "recovery_restart_s", "", None),
    ("  start-up (imports, process group, data, model), s", "recovery_start_up_s", "", None),
    ("  checkpoint load, s", "recovery_load_s", "", None),
    ("  first step (incl. W&B's start, offline), s", "recovery_first_step_s", "", None),
    ("  steps lost (checkpoint.memory_every=2)", "recovery_steps_lost", "<= 2", lambda v: v <= 2),
    ("recovery with W&B off: total, s", "recovery_total_no_wandb_s", "", None),
    ("  first step, s", "recovery_first_step_no_wandb_s", "", None),
    ("GPU: ResNet-50 224px bs256 bf16 channels_last, images/s", "resnet50_bf16", "", None),
    ("GPU: the same with torch.compile, images/s", "resnet50_bf16_compile", "", None),
    ("GPU: best ResNet-50 / NVIDIA's A100 80GB AMP (2,470 images/s)", "vs_a100_published", ">= 1.5 (H100)",
     lambda v: v >= 1.5),
    ("GPU: AMP (bf16) speed-up over fp32 (TF32), ResNet-50", "amp_speedup", "", None),
    ("GPU: ResNet-18 CIFAR 32px bs256 bf16, images/s", "resnet18_cifar_bf16", "", None),
    ("GPU: GPT-2 124M, 1024 tokens x 16, bf16, compile, tokens/s", "gpt2_tokens_per_s", "", None),
    ("GPU: GPT-2 124M MFU (6N + attention FLOPs / dense bf16 peak)", "gpt2_mfu", ">= 0.40 (llm.c, H100)",
     lambda v: v >= 0.40),
]

GPU_SUITE_ROWS = [row for row in ROWS if row[0].startswith("GPU: ")]  # bench/suite/gpu.py's

# `make gpu-check`'s JSON (bench/check/gpu.py): (stage, key, figure, goal text, is the goal met?)
GPU_ROWS = [
    ("gpt", "trainer_tokens_per_s", "GPT-2 124M, 16 x 1024, bf16, compile: python -m train, tokens/s", "", None),
    ("gpt", "bare_tokens_per_s", "  a bare loop of the same model and optimizer, tokens/s", "", None),
    ("gpt", "trainer_over_bare", "  python -m train / the bare loop", ">= 0.98", lambda v: v >= 0.98),
    ("gpt", "trainer_mfu", "  MFU through python -m train", ">= 0.40", lambda v: v >= 0.40),
    ("gpt", "trainer_peak_gib", "  peak memory, GiB", "", None),
    ("gpt", "trainer_data_wait_share", "  data wait share", "", None),
    ("gpt", "trainer_trace.gpu_busy_share", "  the GPU's busy share in a torch.profiler trace", "", None),
    ("gpt", "bare_compiled_loss_tokens_per_s", "  the bare loop, its loss compiled with the model, tokens/s", "", None),
    ("stop_relaunch", "ddp.equal", "stopped and relaunched = never stopped, bitwise, DDP, async save every step",
     "yes", lambda v: v is True),
    ("stop_relaunch", "fsdp.equal", "  the same under FSDP", "yes", lambda v: v is True),
    ("hf", "equal", "Hugging Face Llama, FSDP, bf16, from the folder: stopped and relaunched = never stopped", "yes",
     lambda v: v is True),
    ("hf", "export_loads", "  exported and loaded by transformers", "yes", lambda v: v is True),
    ("fsdp_vs_ddp", "lm_ddp_tokens_per_s", "GPT-2 124M on one GPU, 16 x 1024, compile: DDP tokens/s", "", None),
    ("fsdp_vs_ddp", "lm_fsdp_tokens_per_s", "  FSDP tokens/s", "", None),
    ("fsdp_vs_ddp", "lm_fsdp_over_ddp_speed", "  FSDP / DDP", ">= 0.9", lambda v: v >= 0.9),
    ("fsdp_vs_ddp", "lm_fsdp_trace.gpu_busy_share", "  FSDP: the GPU's busy share in a torch.profiler trace", "",
     None),
    ("fsdp_vs_ddp", "lm_fsdp_model_over_ddp_speed", "  FSDP, the model compiled without its loss / DDP", "", None),
    ("resnet50", "eager.images_per_s", "ResNet-50 224 px bf16 channels_last through python -m train, images/s", "",
     None),
    ("resnet50", "compile.images_per_s", "  the same with train.compile, images/s", "", None),
    ("resnet50", "eager.data_wait_share", "  data wait share (built-in data)", "", None),
    ("imagefolder", "images_per_s", "ImageFolder of JPEGs, a loader worker per core: images/s", "", None),
    ("imagefolder", "data_wait_share", "  data wait share", "", None),
    ("imagefolder", "over_synthetic", "  / the built-in data's images/s (the GPU's)", "", None),
    ("recovery", "total", "recovery after SIGKILL of the rank, compiled, memory_every=2: kill to first step, s", "",
     None),
    ("recovery", "detection", "  detection, s", "", None),
    ("recovery", "restart", "  restart, s", "", None),
    ("recovery", "start-up", "  start-up (imports, process group, data, model), s", "", None),
    ("recovery", "load", "  load, s", "", None),
    ("recovery", "first step", "  first step (compiled from the warm cache), s", "", None),
    ("recovery", "steps lost", "  steps lost", "<= 2", lambda v: v <= 2),
]


def gpu_check_lines(check: dict, source: str) -> list[str]:
    """BENCHMARKS.md's GPU table from gpu_check.json: the machine named, a row per figure, each stage's verdict."""
    m, stages = check.get("machine", {}), check.get("stages", {})
    lines = ["", f"## GPU (`make gpu-check`, from {relative(source)})", "",
             f"- GPU: {m.get('gpu')} x {m.get('gpus', 0)}, driver {m.get('driver')}; torch {m.get('torch')}, "
             f"CUDA {m.get('cuda')}, Python {m.get('python')}, {m.get('cpus')} CPUs"
             + (" **Smoke run on the CPU: the figures mean nothing.**" if check.get("smoke") else ""), "",
             "| figure | value | goal | met |", "| --- | --- | --- | --- |"]
    for stage, key, label, goal, test in GPU_ROWS:
        v = stages.get(stage, {})
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        met = "" if v is None or test is None else ("yes" if test(v) else "**no**")
        lines.append(f"| {label} | {'not measured' if v is None else fmt(v)} | {goal} | {met} |")
    if "seconds" in check:  # the whole check (its stages partly overlap), or its time so far where it was cut short
        whole, short = check["seconds"], [n for n, st in stages.items() if "skipped" in st or "error" in st]
        met = f"**no** ({', '.join(short)} not measured)" if short else "yes" if whole <= 300 else "**no**"
        lines.append(f"| the whole check (`make gpu-check`), s | {whole:.0f} | <= 300 | {met} |")
    tests = stages.get("tests", {}).get("tests", {})
    if tests:
        lines += ["", "gpu-marked tests: " + "; ".join(f"{k} {v['verdict']} ({v['seconds']:.0f} s)"
                                                      for k, v in tests.items())]
    said = []
    for name, st in stages.items():
        note = f" (**{st['error'].splitlines()[0][:200]}**)" if "error" in st else ""
        note += f" (skipped: {st['skipped']})" if "skipped" in st else ""
        said.append(f"{name} {st.get('seconds', 0):.0f} s{note}")
    lines += ["", "Stages (seconds each): " + "; ".join(said)]
    if warm := check.get("warm"):
        lines += ["", "Warm-ups beside the result stages (torch.compile's cache; seconds each): " + "; ".join(
            f"{k} {v.get('seconds', 0):.0f} s" + (f" (**{v['error'].splitlines()[0][:200]}**)" if "error" in v else "")
            for k, v in warm.items())]
    return lines


GPU_KEPT = ROOT / "docs" / "dev" / "gpu"  # make gpu-check's JSON files, kept: YYYY-MM-DD-<gpu>[-what].json


def relative(source: str) -> Path:
    """A path under the repository as the repository names it (docs/dev/gpu/...); another as given."""
    path = Path(source).resolve()
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path(source)


def kept_gpu_check() -> Path | None:
    """The newest make gpu-check JSON kept in docs/dev/gpu/ (their names begin with the date), or None."""
    files = sorted(GPU_KEPT.glob("*.json"))
    return files[-1] if files else None


def gpu_source(check: dict, source: str) -> str:
    """Where a gpu_check.json comes from: the GPU, the file, the commit it measured (recorded since this page said
    so) and, for a file in git, the commit that added it and its date."""
    rel = relative(source)
    said = f"`make gpu-check` on {check.get('machine', {}).get('gpu')}, from {rel}"
    if measured := check.get("machine", {}).get("commit"):
        said += f", measured at commit {measured}"
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h %ad", "--date=short", "--", str(rel)],
                           cwd=ROOT, capture_output=True, text=True).stdout.split()
    if len(added) >= 2:
        said += f" (added in {added[-2]} on {added[-1]})"
    return said


def gpu_table_only(out: Path, source: str | None) -> int:
    """BENCHMARKS.md with its GPU table (from make gpu-check's JSON) written again, the rest as it was."""
    if not source:
        print("error: --gpu-only needs --gpu-json FILE (make gpu-check's gpu_check.json)", file=sys.stderr)
        return 2
    check = json.loads(Path(source).read_text())
    lines = out.read_text().splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("## GPU (`make gpu-check`")), None)
    tail = next(i for i, line in enumerate(lines) if line.startswith("![ratios"))
    keep = [f"- GPU figures: the GPU table below, {gpu_source(check, source)}" if line.startswith("- GPU figures:")
            else line for line in lines[:head - 1 if head is not None else tail - 1]]
    out.write_text("\n".join([*keep, *gpu_check_lines(check, source), "", *lines[tail:], ""]))
    print(f"wrote the GPU table of {out}")
    return 0


def fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [(label.split(":")[0] + ": " + key, figures[key], goal) for label, key, goal, _ in ROWS
              if key in figures and isinstance(figures[key], float) and goal.startswith("<=")]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * len(ratios)))
    for i, (_, value, goal) in enumerate(ratios):
        limit = float(goal.split()[1])
        ax.barh(i, value, color="tab:green" if value <= limit else "tab:red")
        ax.plot([limit, limit], [i - 0.4, i + 0.4], color="black")
    ax.set_yticks(range(len(ratios)), [r[0] for r in ratios], fontsize=8)
    ax.set_xlabel("ratio (black bar: goal)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--gpu-json", help="figures from `python -m bench.suite.gpu --json` or `make gpu-check` on a GPU "
                   "machine (default without a GPU: the newest make gpu-check JSON in docs/dev/gpu/)")
    p.add_argument("--gpu-only", action="store_true", help="with --gpu-json FILE from make gpu-check: only "
                   "BENCHMARKS.md's GPU table is written again (the CPU figures are kept; nothing runs)")
    args = p.parse_args()
    if args.gpu_only:
        return gpu_table_only(Path(args.out), args.gpu_json)
    figures: dict = {}
    gpu_check, gpu_json, gpu_notes = None, args.gpu_json, []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-") as d:
        for name in BENCHES:
            if name == "gpu" and gpu_json:
                given = json.loads(Path(gpu_json).read_text())
                if "stages" in given:  # make gpu-check's: a table of its own
                    gpu_check = given
                else:  # python -m bench.suite.gpu --json's figures
                    figures |= given
                    gpu_notes.append(f"bench/suite/gpu.py's, from {gpu_json} ({given.get('device')})")
                continue
            if name == "gpu" and not args.smoke:
                import torch

                if not torch.cuda.is_available():
                    continue
            out = Path(d) / f"{name}.json"
            cmd = [PY, "-m", f"bench.suite.{name}", "--json", str(out), *(["--smoke"] if args.smoke else [])]
            if args.smoke and name in SHARED:  # one launch fewer: the same run at smoke size
                cmd += [SHARED[name][0], str(Path(d) / SHARED[name][1])]
            print(f"+ {' '.join(cmd)}", flush=True)
            t, c = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
            c2 = resource.getrusage(resource.RUSAGE_CHILDREN)
            print(f"  ({time.time() - t:.0f} s, {c2.ru_utime + c2.ru_stime - c.ru_utime - c.ru_stime:.0f} s of CPU)",
                  flush=True)
            figures |= json.loads(out.read_text())
            if name == "gpu":
                gpu_notes.append(f"bench/suite/gpu.py's, measured here ({figures.get('device')})")
    if gpu_check is None and not gpu_json and (kept := kept_gpu_check()):  # no GPU here: the last check kept
        gpu_check, gpu_json = json.loads(kept.read_text()), str(kept)
    if gpu_check is not None:
        gpu_notes.append(f"the GPU table below, {gpu_source(gpu_check, gpu_json)}")
    measured_gpu_rows = any(key in figures for _, key, _, _ in GPU_SUITE_ROWS)
    import torch
    import torchvision

    out = Path(args.out)
    png = out.with_suffix(".png")
    plot(figures, png)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    lines = [
        "# Benchmarks", "",
        f"Written by `python -m bench all{' --smoke' if args.smoke else ''}` (`make bench`) on "
        f"{time.strftime('%Y-%m-%d %H:%M')}." + (" **Smoke run: tiny sizes, the figures mean nothing.**"
                                                 if args.smoke else ""), "",
        f"- machine: {socket.gethostname()}, {platform.platform()}, {os.cpu_count()} CPUs",
        f"- versions: Python {platform.python_version()}, torch {torch.__version__}, "
        f"torchvision {torchvision.__version__}, commit {commit.stdout.strip() or 'unknown'}",
        f"- load average (1, 5, 15 min) before / after: {', '.join(f'{x:.1f}' for x in load_before)} / "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (other jobs slow rounds unevenly)",
        "- GPU figures: " + ("; ".join(gpu_notes) or "not measured: no GPU here, no --gpu-json and no make gpu-check "
                                                   "JSON in docs/dev/gpu/"), "",
        "| figure | value | goal | met |", "| --- | --- | --- | --- |",
    ]
    for label, key, goal, check in ROWS:
        if key not in figures and (label, key, goal, check) in GPU_SUITE_ROWS and not measured_gpu_rows:
            continue  # bench/suite/gpu.py did not run: the GPU's figures are the GPU table's, or none
        if key not in figures:
            lines.append(f"| {label} | not measured | {goal} | |")
            continue
        v = figures[key]
        met = "" if check is None else ("yes" if check(v) else "**no**")
        lines.append(f"| {label} | {fmt(v)} | {goal} | {met} |")
    rounds = [(what, figures[key]) for what, key in (("ResNet-18, python -m train / the user's DDP loop",
                                                         "overhead_ratios"),
                                                        ("GPT, python -m train / the nanoGPT-style loop",
                                                         "lm_overhead_ratios")) if key in figures]
    if rounds:
        lines += ["", "Step-time ratio of each round, in run order (the rounds alternate which loop runs first):", ""]
        lines += [f"- {what}: {', '.join(f'{r:.3f}' for r in values)}" for what, values in rounds]
    if gpu_check is not None:
        lines += gpu_check_lines(gpu_check, gpu_json)
    lines += ["", f"![ratios against their goals]({png.name})", ""]
    out.write_text("\n".join(lines))
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    sys.exit(main())
