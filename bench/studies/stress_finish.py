"""Stress the end of a run: many short 2-rank runs, two at a time, each with W&B offline, the end-of-run
report and the profiler on, and count the runs that did not exit 0.

A finished run must exit 0 every time. This is a stress script, not a test: it prints figures.

    python -m bench.studies.stress_finish --runs 40            # 40 runs, 2 at a time
    python -m bench.studies.stress_finish --runs 10 --parallel 1 --keep /tmp/stress   # keep the run folders

Each worker runs with PYTHONFAULTHANDLER=1, so a worker that aborts prints every thread's Python stack;
the last lines of a failed run's output are printed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import PY, ROOT, env

TINY = ["task.image_size=16", "task.train_samples=256", "task.eval_samples=64", "data.num_workers=1",
        "train.global_batch_size=16", "train.micro_batch_size=8", "train.log_every=1", "train.steps=4",
        "optim.warmup_steps=2", "log.wandb.mode=offline", "log.report=true", "profile.enabled=true",
        "profile.wait=1", "profile.warmup=1", "profile.active=1"]


def one(i: int, base: Path) -> tuple[int, float, str]:
    run_dir = base / f"run{i:03d}"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "train",
           "--config", "configs/default.yaml", *TINY, f"run.dir={run_dir}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env(PYTHONFAULTHANDLER="1"), capture_output=True, text=True,
                          timeout=600)
    return proc.returncode, time.perf_counter() - t, proc.stdout[-2000:] + proc.stderr[-6000:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--keep", help="keep the run folders here (default: a temporary folder, removed)")
    args = p.parse_args()
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="stress-finish-"))
    base.mkdir(parents=True, exist_ok=True)
    t0, failed, times = time.perf_counter(), [], []
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            for i, (rc, seconds, out) in enumerate(pool.map(lambda i: one(i, base), range(args.runs))):
                times.append(seconds)
                if rc != 0:
                    failed.append(i)
                    print(f"run {i}: exit {rc}\n{out}\n", flush=True)
                print(f"run {i}: exit {rc} in {seconds:.1f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    clean = args.runs - len(failed)
    print(f"clean exits: {clean}/{args.runs} ({args.parallel} at a time, median {sorted(times)[len(times) // 2]:.1f} "
          f"s per run, {time.perf_counter() - t0:.0f} s in all)")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
