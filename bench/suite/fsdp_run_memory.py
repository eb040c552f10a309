"""Peak host memory (RSS) per rank over a whole FSDP run, phase by phase, against the model's size M.

    python -m bench.suite.fsdp_run_memory [--nproc 4] [--layers 20] [--embd 1024] [--optim sgd] [--json OUT]
    python -m bench.suite.fsdp_run_memory --strategy hsdp --shard-size 2   # HSDP: groups of 2, a replica each

A real run (python -m train.launch, dist.strategy=fsdp, gloo on CPU) of the built-in GPT with a few steps, a
checkpoint save after each, an evaluation after the first and the final one, then the same run with the tiny
model. In every rank a sampler thread (started by a sitecustomize.py on PYTHONPATH: the run itself is not
changed) reads the process's RSS every few milliseconds and names the phase from the main thread's stack:
build, resume, step, save, eval, end (ranks_in_sync, the summary), resetting the peak (VmHWM, through
/proc/self/clear_refs) at each change of phase, so that each phase's peak is exact up to the moment the
sampler sees the change. Printed: each rank's peak above the tiny run's as a fraction of M, and per phase.
A step cannot hold less than its shard of the parameters and of the gradients (SGD without momentum: no
optimizer state) and one block's gathered parameters and its whole gradients: 2 M / world + 2 blocks, printed
as the floor. The goal is at most 0.6 M above tiny on 4 ranks for a model of 250M parameters or more (AdamW
adds 2 M / world for its two states). Measured: 0.61 M at 20 blocks of width 1024 (252M, floor 0.60), 0.59 M
at GPT-2 medium's 24 blocks (--layers 24: 302M, floor 0.58).
Under HSDP (--strategy hsdp) a rank shards over its group of --shard-size ranks, not over the world: the floor is
2 M / shard size + 2 blocks, FSDP's on that many ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT

OUT_VAR = "FSDP_RUN_MEMORY_OUT"  # where the ranks' samplers write (set by main for the run it launches)
# The phase a frame of the main thread's stack means, innermost first: (file, function) -> phase
PHASES = {("trainer.py", "build"): "build", ("checkpointer.py", "resume"): "resume",
          ("trainer.py", "train_step"): "step", ("checkpointer.py", "save"): "save",
          ("checkpointer.py", "save_last"): "save", ("evaluation.py", "run"): "eval",
          ("trainer.py", "ranks_in_sync"): "end", ("trainer.py", "fit"): "fit", ("trainer.py", "run"): "run"}
ORDER = ("start", "build", "resume", "step 1", "save 1", "eval 1", "steps", "saves", "evals", "end")


def _status_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[:5]] = int(line.split()[1])
    return out


def _phase(main_id: int, after_fit: bool) -> str:
    frame = sys._current_frames().get(main_id)
    while frame is not None:
        code = frame.f_code
        name = PHASES.get((os.path.basename(code.co_filename), code.co_name))
        if name == "run":
            return "end" if after_fit else "start"
        if name == "fit":
            return "fit"
        if name is not None:
            return name
        frame = frame.f_back
    return "end" if after_fit else "start"


def sample_in_rank(out_dir: str) -> None:
    """In a rank: a daemon thread that records the peak RSS of each phase, in order, to out_dir/rank<R>.json."""
    main_id, rank = threading.main_thread().ident, os.environ.get("RANK", "0")
    path = Path(out_dir) / f"rank{rank}.json"

    def reset_peak() -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        except OSError:
            pass

    def loop() -> None:
        phases: list[list] = []  # [phase, its peak KiB], consecutive phases of one name merged
        current, after_fit, written = "start", False, 0.0
        while True:
            time.sleep(0.005)
            now = _phase(main_id, after_fit)
            after_fit = after_fit or now in ("fit", "step")
            if now == "fit":  # between steps, saves and evaluations (logging, agreements): the step's
                now = current if current in ("step", "save", "eval") else "step"
            kib = _status_kib()
            changed = now != current or not phases
            if changed:
                if phases:
                    phases[-1][1] = max(phases[-1][1], kib["VmHWM"])
                phases.append([now, kib["VmRSS"]])
                reset_peak()
                current = now
            else:
                phases[-1][1] = max(phases[-1][1], kib["VmHWM"])
            if changed or time.monotonic() - written > 0.2:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"phases": phases}))
                tmp.replace(path)
                written = time.monotonic()

    threading.Thread(target=loop, daemon=True, name="rss-sampler").start()


def labelled(phases: list[list]) -> dict[str, float]:
    """Peak MiB by phase: the first step, save and evaluation on their own, the later ones together."""
    seen: dict[str, int] = {}
    out: dict[str, float] = {}
    for name, kib in phases:
        seen[name] = seen.get(name, 0) + 1
        label = name
        if name in ("step", "save", "eval"):
            label = f"{name} 1" if seen[name] == 1 else f"{name}s"
        out[label] = max(out.get(label, 0.0), kib / 1024)
    return out


def sampling_site(work: Path) -> Path:
    """A folder with the sitecustomize.py that starts the sampler in each rank (where OUT_VAR is set): put it first on
    the launch's PYTHONPATH."""
    site = work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import os\n"
        f"if os.environ.get({OUT_VAR!r}) and os.environ.get('LOCAL_RANK') is not None:\n"
        "    from bench.suite import fsdp_run_memory\n"
        f"    fsdp_run_memory.sample_in_rank(os.environ[{OUT_VAR!r}])\n")
    return site


def run(args: argparse.Namespace, tiny: bool, work: Path) -> tuple[list[dict[str, float]], float]:
    """One launch; each rank's peak MiB by phase, and the model's bytes (MiB)."""
    name = "tiny" if tiny else "big"
    out, run_dir = work / f"rss-{name}", work / f"run-{name}"
    out.mkdir()
    site = sampling_site(work)
    sizes = [] if tiny else [f"task.n_layer={args.layers}", f"task.n_embd={args.embd}", f"task.n_head={args.heads}"]
    steps = args.steps
    cmd = [sys.executable, "-m", "train.launch", f"--nproc-per-node={args.nproc}", "--",
           "--config", "configs/gpt.yaml", f"run.dir={run_dir}", "log.wandb.mode=disabled", "log.report=false",
           "task.model=tiny", *sizes, "task.seq_len=64", "task.train_tokens=20000",
           f"task.eval_tokens={65 * 2 * args.nproc}", f"dist.strategy={args.strategy}",
           *([f"dist.shard_size={args.shard_size}"] if args.strategy == "hsdp" else []), f"optim.name={args.optim}",
           *(["optim.momentum=0"] if args.optim == "sgd" else []), "data.num_workers=0",
           f"train.steps={steps}", f"train.global_batch_size={args.nproc}", "train.micro_batch_size=1",
           "train.log_every=1", f"train.eval_every={args.eval_every}", "checkpoint.every=1", "checkpoint.keep=2",
           "resume=never", *args.overrides]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env |= {OUT_VAR: str(out), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])}
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the {name} run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    print(f"  {name} run: {time.time() - t:.0f} s", flush=True)
    ranks = [labelled(json.loads((out / f"rank{r}.json").read_text())["phases"]) for r in range(args.nproc)]
    model_mib = 0.0
    for line in (run_dir / "logs" / "rank0.log").read_text().splitlines():
        if "model: " in line and " parameters, " in line:  # "model: 251,xxx,xxx parameters, ..."
            model_mib = int(line.split("model: ")[1].split(" parameters")[0].replace(",", "")) * 4 / 2**20
    return ranks, model_mib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--optim", default="sgd", choices=("sgd", "adamw"), help="sgd: momentum 0, no optimizer state")
    p.add_argument("--strategy", default="fsdp", choices=("fsdp", "hsdp"))
    p.add_argument("--shard-size", type=int, default=2, help="hsdp: the ranks of a group (dist.shard_size)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=1, help="an evaluation after each such step (and at the end)")
    p.add_argument("--smoke", action="store_true", help="seconds: 2 ranks, a 4-layer model of 256 wide")
    p.add_argument("--json")
    args, args.overrides = p.parse_known_args()
    if args.smoke:
        args.nproc, args.layers, args.embd, args.heads = 2, 4, 256, 4
    with tempfile.TemporaryDirectory(prefix="fsdp-run-memory-") as d:
        big, model_mib = run(args, False, Path(d))
        tiny, _ = run(args, True, Path(d))
    labels = [x for x in ORDER if any(x in r for r in big)]
    m = model_mib
    shards = args.shard_size if args.strategy == "hsdp" else args.nproc
    layout = f"FSDP, {args.nproc} ranks" + (f" in groups of {shards}" if args.strategy == "hsdp" else "")
    layout = layout.replace("FSDP", args.strategy.upper())
    print(f"{layout}, {args.optim}: model M = {m:.0f} MiB "
          f"({m * 2**20 / 4 / 1e6:.0f}M parameters, fp32)")
    print(f"{'phase':8s} " + " ".join(f"{'rank ' + str(r):>17s}" for r in range(args.nproc))
          + "   (peak RSS MiB, above tiny's same phase in M)")
    worst: dict[str, float] = {}
    for label in labels:
        cells = []
        for b, t in zip(big, tiny, strict=True):
            above = (b.get(label, 0.0) - t.get(label, t.get("end", 0.0))) / m
            if label in b:
                worst[label] = max(worst.get(label, float("-inf")), above)
            cells.append(f"{b[label]:8.0f} ({above:+.2f} M)" if label in b else "-")  # too short to be seen
        print(f"{label:8s} " + " ".join(f"{c:>17s}" for c in cells))
    peaks = [(max(b.values()) - max(t.values())) / m for b, t in zip(big, tiny, strict=True)]
    culprit = max(worst, key=worst.get)
    # What no FSDP step can do without: its shard, its gradients' shard, and one block's gathered parameters and
    # whole gradients (a block of the GPT: 12 d^2 + 13 d parameters).
    d = args.embd
    floor = 2 / shards + 2 * (12 * d * d + 13 * d) * 4 / 2**20 / m
    print("peak above the tiny run's, per rank: " + ", ".join(f"{x:.2f}" for x in peaks)
          + f" M (worst {max(peaks):.2f} M{', goal <= 0.6 M with sgd' if args.strategy == 'fsdp' else ''}); "
          f"the highest phase: {culprit}")
    if not args.smoke:  # (a model of 12 MiB is within the tiny run's own noise)
        print(f"a step's floor: the shards of the parameters and gradients (2 M / {shards}) and one block's "
              f"parameters and gradients: {floor:.2f} M")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "run_memory_model_mib": m, "run_memory_peak_over_m": max(peaks), "run_memory_floor_over_m": floor,
            "run_memory_phase_over_m": worst,
            **{f"run_memory_{k}_over_m": max(v for p, v in worst.items() if p.startswith(k))
               for k in ("save", "eval", "end") if any(p.startswith(k) for p in worst)},
            "run_memory_ranks_mib": big, "run_memory_tiny_ranks_mib": tiny}, indent=2) + "\n")


if __name__ == "__main__":
    main()
