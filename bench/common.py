"""Helpers shared by the benchmarks, baselines, studies and the GPU check: run the project's entry points and read
what a run leaves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# Smoke runs: W&B start-up and the end-of-run report are not what any benchmark measures.
SMOKE_QUIET = ["log.wandb.mode=disabled", "log.report=false"]


def env(**extra: str) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra)
    return out


def torchrun(nproc: int, *args: str) -> list[str]:
    """A command that runs `args` (a script, or "-m", a module) on `nproc` local ranks (one: a plain process)."""
    if nproc == 1:
        return [PY, *args]
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def run(cmd: list[str], timeout: float = 1800, **extra_env: str) -> subprocess.CompletedProcess:
    import resource
    import time
    t, c = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=ROOT, env=env(**extra_env), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    c2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = c2.ru_utime + c2.ru_stime - c.ru_utime - c.ru_stime
    print(f"    [{time.time() - t:.1f} s, {cpu:.1f} cpu-s] {' '.join(cmd[1:6])}", flush=True)
    return proc


def log_time(line: str) -> float | None:
    """The wall-clock time a line of a rank's log file begins with (train/observe/log.py's format, "2026-11-28
    06:16:53.825"), or None for a line without one (a traceback's)."""
    import datetime

    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def imagefolder(root: Path, per_class: int, classes: int = 10, size: int = 64) -> Path:
    """An ImageFolder (train/ and val/) of random PNG files: what a user's own images look like on disk."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", max(2, per_class // 8))):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def spread(values: list[float]) -> dict:
    """min, median and max of a figure measured once per round."""
    import statistics

    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def write_json(path: str | None, figures: dict) -> None:
    """Each benchmark's figures, for `python -m bench all` (bench/report.py) to put into BENCHMARKS.md."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=2) + "\n")


def end_baseline(rank: int, out: Path, figures: dict) -> None:
    """The end of a bare DDP loop (bench/baselines/): rank 0 writes its figures to out/times.json, then every rank
    leaves without the interpreter's finalization: DDP's gloo threads outlive destroy_process_group, and one
    that frees a tensor while Python finalizes aborts the process ("terminate called without an active
    exception", SIGABRT: CI saw it once here; train/parallel/distributed.py's exit_process says more)."""
    import torch.distributed as dist

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "times.json").write_text(json.dumps(figures))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _busy(kernels: list[dict]) -> float:
    """The union of the kernels' intervals, in the trace's microseconds."""
    busy, end = 0.0, None
    for e in sorted(kernels, key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    return busy


def trace_summary(path: Path, steps: int, top: int = 12) -> dict:
    """What a torch.profiler trace (Chrome JSON) says of its `steps` recorded steps: the wall time a step, the
    GPU's busy share of the span its kernels cover (under 1: the host or a wait starves it) and each stream's, the
    kernels that take the time, the host's time in the spans torch's code labels (record_function: FSDP2's hooks,
    the optimizer's step; a module's own label counted with the others of its kind; labels nest), and the host's
    waits for the device (synchronizing CUDA calls)."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    step_events = [e for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")
                   and e.get("cat") == "user_annotation"]
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    out: dict = {"step_ms": round(sum(e["dur"] for e in step_events) / max(len(step_events), 1) / 1e3, 2)}
    if kernels:
        busy = _busy(kernels)
        first, last = min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels)
        out["gpu_busy_share"] = round(busy / max(last - first, 1e-9), 3)
        out["gpu_ms_per_step"] = round(busy / steps / 1e3, 2)
        # each stream's busy share of that span: the compute stream's under the GPU's while another stream's
        # kernels run (FSDP2's all-gathers and reduce-scatters) is compute waiting on them
        by_stream: dict = {}
        for e in kernels:
            by_stream.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append(e)
        out["streams"] = {str(sid): {"busy_share": round(_busy(ks) / max(last - first, 1e-9), 3),
                                     "ms_per_step": round(_busy(ks) / steps / 1e3, 2)}
                          for sid, ks in sorted(by_stream.items(), key=lambda kv: -_busy(kv[1]))[:4]}
        by_name: dict[str, float] = {}
        for e in kernels:
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
        total = sum(by_name.values())
        out["kernels"] = [{"name": n[:90], "share": round(d / total, 3), "ms_per_step": round(d / steps / 1e3, 2)}
                          for n, d in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]
        out["kernel_launches_per_step"] = len(kernels) // steps
    labels: dict[str, list] = {}  # the host's time in the labels torch's code marks (FSDP2: "FSDP::pre_forward", ...)
    for e in spans:
        if e.get("cat") == "user_annotation" and not str(e.get("name", "")).startswith("ProfilerStep#"):
            n = labels.setdefault(re.sub(r" \(.*\)$", "", e["name"]), [0, 0.0])  # each module's: summed
            n[0], n[1] = n[0] + 1, n[1] + e["dur"]
    out["host_labels"] = {n: {"calls_per_step": c / steps, "ms_per_step": round(d / steps / 1e3, 2)}
                          for n, (c, d) in sorted(labels.items(), key=lambda kv: -kv[1][1])[:max(top, 10)]}
    waits: dict[str, list] = {}
    for e in spans:
        if e.get("cat") == "cuda_runtime" and any(w in e.get("name", "") for w in ("Synchronize", "Memcpy")):
            w = waits.setdefault(e["name"], [0, 0.0])
            w[0], w[1] = w[0] + 1, w[1] + e["dur"]
    out["host_waits"] = {n: {"calls_per_step": c / steps, "ms_per_step": round(d / steps / 1e3, 2)}
                         for n, (c, d) in sorted(waits.items(), key=lambda kv: -kv[1][1])[:6]}
    return out
