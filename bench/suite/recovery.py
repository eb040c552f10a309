"""Recovery time after a worker is SIGKILLed, from the kill to the first training step after the restart.

    python -m bench.suite.recovery [--repeats 3] [--nproc 2] [--model resnet18] [--set key=value ...]

The run copies its state to host memory every 2 steps (checkpoint.memory_every=2) and to disk every 5; --set
passes another training argument (repeatable: --set checkpoint.memory_every=0 measures the disk alone).

Runs the shared launcher (torchrun, gloo on CPU, --max-restarts=1), kills rank 1 mid-run, and splits
the time until the restarted group's first step into:
    detection   kill -> torchrun's agent notices and starts stopping the group
    restart     -> the new workers exist, or the standbys have taken their round (the rest of the group
                stopped, rendezvous done)
    start-up    -> the checkpoint starts loading (imports, process group, data, model)
    load        checkpoint read, verified and loaded
    first step  -> the first optimizer step after the restart is done (on rank 0 this includes W&B's
                start, offline by default: each repeat runs once with and once without W&B, in
                alternating order, and both are reported)
and the steps lost: the last step logged before the kill less the step resumed from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, SMOKE_QUIET, log_time, write_json

TINY = ["task.image_size=32", "task.train_samples=1024", "task.eval_samples=64", "data.num_workers=0",
        "train.global_batch_size=32", "train.micro_batch_size=16", "train.log_every=1", "train.eval_every=0",
        "train.steps=40", "checkpoint.every=5", "checkpoint.memory_every=2", "dist.timeout_s=30"]


def UNIT(key: str) -> str:  # noqa: N802
    return "" if key == "steps lost" else " s"


def workers(run_dir: Path) -> set[int]:
    """The run's training processes, less the standbys still waiting for a round (train/launch/standby.py)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if f"run.dir={run_dir}".encode() in cmd and b"-m" in cmd and cmd[cmd.index(b"-m") + 1] == b"train" \
                    and (b"TRAIN_STANDBY=" not in (proc / "environ").read_bytes()
                         or (proc / "comm").read_text().startswith("rank ")):
                pids.add(int(proc.name))
        except OSError:
            continue
    return pids


def rank_of(pid: int) -> int | None:
    try:
        env = (Path(f"/proc/{pid}") / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(kv[5:]) for kv in env if kv.startswith(b"RANK=")), None)


def glog_time(line: str) -> float:
    """torchrun's log prefix, e.g. W1122 02:21:51.164000 (local time, no year)."""
    m = re.match(r"[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+)", line)
    month, day, clock = m.groups()
    now = datetime.datetime.now()
    t = datetime.datetime.strptime(f"{now.year}-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S.%f")
    return t.timestamp()


def once(run_dir: Path, nproc: int, model: str, smoke: bool, extra: list[str], victim: int = 1) -> dict[str, float]:
    """One run killed at a step and restarted by torchrun: the phases (seconds) and the steps lost. `victim`: the
    rank killed (bench/check/gpu.py's recovery stage kills the one rank of a GPU)."""
    # the kill comes after a save (checkpoint.every=5) and well before the run's end (7 steps in the smoke)
    sizes = ["task.image_size=16", "task.train_samples=256", "train.global_batch_size=16",
             "train.micro_batch_size=8", "train.steps=14"] if smoke else []
    kill_at = 7 if smoke else 12
    cmd = [sys.executable, "-m", "train.launch", f"--nproc-per-node={nproc}", "--max-restarts=1", "--",
           "--config", "configs/default.yaml", *TINY, *sizes, *extra, f"task.model={model}", f"run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # torchrun's output into a file: a pipe read only at the end fills, and then holds up torchrun's agent
    errors = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=errors, text=True)
    metrics = run_dir / "metrics.jsonl"

    def logged() -> int:
        return max((json.loads(x)["step"] for x in metrics.read_text().splitlines()), default=0) \
            if metrics.exists() else 0

    while logged() < kill_at:
        if proc.poll() is not None:
            errors.seek(0)
            raise SystemExit(f"the run ended early: {errors.read()[-2000:]}")
        time.sleep(0.05)
    old = workers(run_dir)
    pid = next(p for p in old if rank_of(p) == victim)
    at = logged()
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    t_new = None
    while t_new is None:
        if workers(run_dir) - old:
            t_new = time.time()
        time.sleep(0.01)
    proc.wait(timeout=600)
    errors.seek(0)
    err = errors.read()
    if proc.returncode != 0:
        raise SystemExit(f"the run failed: {err[-2000:]}")
    # torchrun saw the failure: it signals the ranks still running ("closing signal"), then names the failed
    # one ("failed (exitcode"); only that line where rank 0 ended first on its own (gloo's connection reset).
    t_detect = min(glog_time(x) for x in err.splitlines()
                   if re.match(r"[IWE]\d{4} ", x) and ("closing signal SIGTERM" in x or "failed (exitcode" in x))
    resumed = next(x for x in (run_dir / "logs" / "rank0.log").read_text().splitlines() if "resumed from" in x)
    t_loaded, load_s = log_time(resumed), float(re.search(r" in ([\d.]+) s$", resumed).group(1))
    step = int(re.search(r"at step (\d+)", resumed).group(1))
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    t_first = next(r["time"] for r in records if r.get("step") == step + 1 and "loss" in r)
    return {"detection": t_detect - t_kill, "restart": t_new - t_detect, "start-up": t_loaded - load_s - t_new,
            "load": load_s, "first step": t_first - t_loaded, "total": t_first - t_kill, "steps lost": at - step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--smoke", action="store_true", help="one repeat")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a training argument, repeatable")
    p.add_argument("--json")
    args = p.parse_args()
    # W&B as configured (offline by default) and W&B off; the smoke skips W&B's start altogether.
    variants = {"": [], "no_wandb": ["log.wandb.mode=disabled"]}
    if args.smoke:
        args.repeats, variants = 1, {"": SMOKE_QUIET}
    runs = {v: [] for v in variants}
    for i in range(args.repeats):
        for variant in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            with tempfile.TemporaryDirectory(prefix="bench-recovery-") as d:
                runs[variant].append(once(Path(d) / "run", args.nproc, args.model, args.smoke,
                                          [*variants[variant], *args.set]))
            print(f"run {i + 1} ({'W&B off' if variant else 'W&B as configured'}): "
                  + ", ".join(f"{k} {v:.2f}{UNIT(k)}" for k, v in runs[variant][-1].items()), flush=True)
    figures = {}
    for variant, rs in runs.items():
        print(f"\nrecovery after SIGKILL of rank 1 of {args.nproc} (gloo, CPU, {args.model}), "
              f"{'W&B off' if variant else 'W&B as configured'}, median of {args.repeats}:")
        for key in rs[0]:
            value = statistics.median(r[key] for r in rs)
            print(f"  {key:11s} {value:6.2f}{UNIT(key)}")
            name = key.replace(' ', '_').replace('-', '_')
            figures[f"recovery_{name}{'_' + variant if variant else ''}{'_s' if UNIT(key) else ''}"] = value
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
