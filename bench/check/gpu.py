"""One prepared check of a GPU machine, in minutes: `make gpu-check OUT=dir` (`SMOKE=1`: the same stages at toy sizes
on the CPU, seconds each, so the script is known to work before a GPU is there). An acceptance check, not a
benchmark: it says whether the template works and keeps its speed on that machine.

    python -m bench gpu-check OUT_DIR [--smoke] [--budget-s 300] [--only STAGE,...] [--tests K]

Stages, in order of value; each writes OUT_DIR/gpu_check.json again as soon as it ends, so a run cut short keeps what
it measured (a stage that fails records its error and the next one runs). The three that check results, not speed
(tests, stop_relaunch, hf), run at the same time first, each process with its share of the cores; then the timed
ones, one at a time. Beside the result stages, the timed stages that compile run a few steps first (their
warm-ups, untimed): torch.compile's cache on disk then holds their kernels, and the timed stage compiles in seconds,
not minutes (a compiled ResNet-18 through `python -m train` on this 2-core CPU: 35.5 s cold, 6.2 s warm). The
smoke times nothing: all its stages and warm-ups run at once (53 s on 2 idle cores):
  tests         the gpu-marked tests (pytest -m gpu)
  gpt           GPT-2 124M, 16 x 1024 tokens, bf16, compile: `python -m train` against the bare loop of the same model,
                loss and hyper-parameters (bench/baselines/gpt.py) in the same run; tokens/s, MFU, peak memory
  stop_relaunch a run stopped by SIGTERM and relaunched equals one that never stopped, bit for bit, on the device,
                under DDP and FSDP, with an asynchronous save at every step (several in a row)
  hf            the Hugging Face task: a tiny Llama made here (transformers), FSDP, bf16, task.init_from; a stop and a
                relaunch with the losses of a run that never stopped; exported and reloaded by transformers
  fsdp_vs_ddp   bench/suite/gpu.py --lm on one GPU, 16 x 1024, compile: FSDP's tokens/s against DDP's (also FSDP with
                the model compiled alone, its loss eager), each with a trace of 3 steps: host, streams, FSDP2's hooks
  resnet50      ResNet-50, 224 px, bf16, channels_last through `python -m train`, without and with compile
  imagefolder   an ImageFolder of JPEGs made at start, through `python -m train` with the machine's cores: data wait
                and images/s against the GPU's (the resnet50 stage's)
  recovery      the one rank SIGKILLed mid-run under the launcher, compiled, checkpoint.memory_every=2: each phase from
                the kill to the first step after torchrun's restart (bench/suite/recovery.py), and the steps lost
  memory        the peak memory of each run above
Nothing is installed: it runs on the machine's own torch (2.11 or newer); a stage whose package is missing (pytest,
transformers) says so and is skipped. `python -m bench all --gpu-json OUT_DIR/gpu_check.json` (`--gpu-only`: only
that table) puts the figures in BENCHMARKS.md. gpu_check.json's `seconds` is the whole check's time so far (the
goal: 300 s on one H100 or H200).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from bench.common import PY, ROOT, log_time, trace_summary

LAUNCH = [PY, "-m", "train.launch", "--nproc-per-node=1", "--"]  # torchrun, one rank; a SIGTERM is a stop (75)
QUIET = ["log.wandb.mode=disabled", "log.report=false", "log.progress_bar=never"]


class Check:
    """The figures of every stage so far, written to OUT_DIR/gpu_check.json after each."""

    def __init__(self, out: Path, smoke: bool, budget_s: float):
        self.out, self.smoke, self.started = out, smoke, time.monotonic()
        self.deadline = self.started + budget_s
        self.tests: str | None = None  # pytest -k for the tests stage (default: every gpu test)
        self.lock = threading.RLock()
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "gpu_check.json"
        self.figures: dict = {"machine": machine(), "smoke": smoke, "seconds": 0.0, "stages": {}, "warm": {}}
        self.write()

    def write(self) -> None:
        with self.lock:  # stages that run together (AT_ONCE) write from their threads
            self.figures["seconds"] = round(time.monotonic() - self.started, 1)
            self.figures["runs"] = dict(RUNS)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.figures, indent=2) + "\n")
            os.replace(tmp, self.path)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def stage(self, name: str, fn) -> None:
        t = time.monotonic()
        if self.left_s() <= 0:
            result = {"skipped": "out of time (--budget-s)"}
        else:
            print(f"== {name}", flush=True)
            try:
                result = fn(self, self.out / name)
            except Skip as e:
                result = {"skipped": str(e)}
            except Exception as e:  # recorded; the next stage runs
                result = {"error": f"{type(e).__name__}: {e}"[-2000:], "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.monotonic() - t, 1)
        with self.lock:
            self.figures["stages"][name] = result
            self.write()
        print(f"   {name}: {json.dumps({k: v for k, v in result.items() if k != 'traceback'})[:600]}", flush=True)


    def warm(self, name: str, fn) -> None:
        """Stage `name`'s warm-up (WARM), its time and any error in gpu_check.json's `warm`: one that fails costs
        the stage its head start, nothing else (the stage compiles, and fails or not, on its own)."""
        t = time.monotonic()
        if self.left_s() <= 0:
            return
        try:
            fn(self, self.out / "warm" / name)
            result = {}
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}"[-1000:]}
        result["seconds"] = round(time.monotonic() - t, 1)
        with self.lock:
            self.figures["warm"][name] = result
            self.write()
        print(f"   warm-up of {name}: {json.dumps(result)[:300]}", flush=True)


class Skip(Exception):
    """A stage that cannot run here (a package missing, no second GPU): said in the JSON."""


def machine() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cpus": os.cpu_count(), "host": platform.node(), "commit": commit.stdout.strip() or None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                               text=True)
            info["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    else:
        info["gpu"] = "none (CPU)"
    return info


SHARED_THREADS: str | None = None  # while stages run together: each process's share of the cores (OMP_NUM_THREADS)


def env(**extra: str) -> dict:
    if SHARED_THREADS and "OMP_NUM_THREADS" not in os.environ:
        # (processes that run together, each with torch's threads on every core, spin on one another's cores: the
        # smoke's stop_relaunch took 42 s with them, 24 s with one each, on 2 cores)
        extra = {"OMP_NUM_THREADS": SHARED_THREADS} | extra
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # (train.deterministic sets cuBLAS's fixed workspace itself: the speed stages run with cuBLAS's default)
    return out | {"PYTHONUNBUFFERED": "1"} | extra


def run(cmd: list[str], timeout: float, expect: int = 0, **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=max(timeout, 10))
    if proc.returncode != expect:
        raise RuntimeError(f"exit {proc.returncode} (expected {expect}): {' '.join(cmd[1:8])} ...\n"
                           f"{proc.stderr[-1500:]}")
    return proc


RUNS: dict[str, dict] = {}  # each python -m train run's timeline (gpu_check.json's `runs`): where a stage's time goes


def train(run_dir: Path, config: str, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """python -m train to the end; its timeline in RUNS."""
    start = time.time()
    try:
        return run([PY, "-m", "train", "--config", config, f"run.dir={run_dir}", *QUIET, *overrides], timeout)
    finally:
        RUNS["/".join(run_dir.parts[-2:])] = timeline(run_dir / "logs" / "rank0.log", start, time.time())


def timeline(log: Path, start: float, end: float) -> dict:
    """Seconds of a run from its start (wall clock) and rank 0's log: to its first line (Python, torch and the
    config), to its first step line (the build, the data, compilation and the first log window's steps), between
    its first and last step lines, and after the last (the final save and evaluation, the teardown)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    first = next((t for t in map(log_time, lines) if t), None)
    steps = [t for line in lines if " INFO step " in line and (t := log_time(line))]
    fig = {"wall_s": round(end - start, 1)}
    if first:
        fig["to_first_line_s"] = round(first - start, 1)
    if steps:
        fig |= {"to_first_step_line_s": round(steps[0] - start, 1), "steps_s": round(steps[-1] - steps[0], 1),
                "after_last_step_s": round(end - steps[-1], 1)}
    return fig


def windows(run_dir: Path, skip: int = 1) -> list[dict]:
    """The training lines of metrics.jsonl after the first `skip` (compilation, warm-up)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r][skip:]


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------- stages

def stage_tests(check: Check, out: Path) -> dict:
    try:
        import pytest  # noqa: F401
    except ImportError:
        raise Skip("pytest is not installed here") from None
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())
    out.mkdir(parents=True, exist_ok=True)
    report = out / "junit.xml"
    pick = ["-k", check.tests] if check.tests else []
    proc = subprocess.run([PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                           *pick, *files], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=max(check.left_s(), 30))
    import xml.etree.ElementTree as ET

    cases = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            verdict = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    verdict = child.tag + (f": {child.get('message', '')[:200]}" if child.tag != "skipped"
                                           else f" ({child.get('message', '')[:100]})")
            cases[case.get("name")] = {"verdict": verdict, "seconds": float(case.get("time", 0))}
    return {"exit": proc.returncode, "tests": cases, "tail": proc.stdout[-800:] if proc.returncode else ""}


def stage_gpt(check: Check, out: Path) -> dict:
    """The trainer against a bare loop of the same model and optimizer, each in a process of its own; the
    trainer's windows of steps 21-60 (the first hold the compilation), then a torch.profiler trace of steps
    63-65 (outside those windows), summed up by trace_summary: where the time goes."""
    smoke = check.smoke
    steps, every = (10, 2) if smoke else (70, 10)
    common = _gpt_overrides(smoke, steps, every)
    last = steps - every  # the windows up to here; the trace falls in the last one, after its warm-up steps
    warmup, active = (1, 1) if smoke else (2, 3)
    trace = ["profile.enabled=true", f"profile.wait={last}", f"profile.warmup={warmup}", f"profile.active={active}"]
    train(out / "trainer", "configs/gpt.yaml", *common, *trace, timeout=check.left_s())
    rows = [r for r in windows(out / "trainer", skip=2 if not smoke else 1) if r["step"] <= last]
    fig = bare_gpt(out / "bare", common, check.left_s())
    trainer = median(rows, "tokens_per_s")
    result = {"trainer_tokens_per_s": trainer, "trainer_mfu": median(rows, "mfu"),
              "trainer_peak_gib": max((r.get("peak_mem_gib", 0) for r in rows), default=None),
              "trainer_data_wait_share": median(rows, "data_wait_share"),
              "bare_tokens_per_s": fig["tokens_per_s"], "bare_mfu": fig.get("mfu"),
              "bare_peak_gib": fig.get("peak_gib"),
              "windows": [round(r["tokens_per_s"]) for r in rows if "tokens_per_s" in r],
              "bare_windows": fig.get("windows")}
    if trainer and fig["tokens_per_s"]:
        result["trainer_over_bare"] = trainer / fig["tokens_per_s"]
    traces = sorted((out / "trainer" / "profile").glob("rank0.*.pt.trace.json"))
    if traces:
        result["trainer_trace"] = trace_summary(traces[-1], steps=active)
    return result


def _gpt_overrides(smoke: bool, steps: int, every: int) -> list[str]:
    size = ["task.model=nano", "task.seq_len=32", "train.global_batch_size=2", "train.micro_batch_size=2",
            "train.precision=fp32"] if smoke else \
        ["task.model=gpt2", "task.seq_len=1024", "task.vocab_size=50304", "task.train_tokens=4000000",
         "train.global_batch_size=16", "train.micro_batch_size=16", "train.precision=bf16", "train.compile=true"]
    return [*size, f"train.steps={steps}", f"train.log_every={every}", "train.eval_every=0", "checkpoint.every=0",
            "task.eval_tokens=65536" if not smoke else "task.eval_tokens=4096"]


def bare_gpt(out: Path, overrides: list[str], timeout: float) -> dict:
    """bench/baselines/gpt.py in a process of its own: the trainer's model, loss and hyper-parameters in a bare
    loop, random tokens already on the device (no loader, no logging but rank 0's loss read at each log step, no
    stop agreement). Read as stage_gpt reads the trainer: the median of the windows of train.log_every steps after
    two (the compilation), each ending in a wait for the GPU (the loss read)."""
    from bench.baselines import gpt

    run([PY, "-m", "bench.baselines.gpt", str(out), *overrides], timeout)
    fig = json.loads((out / "times.json").read_text())
    every = next(int(o.split("=")[1]) for o in overrides if o.startswith("train.log_every="))
    tokens_s = gpt.tokens_per_s(fig, every, skip=2)
    result = {"tokens_per_s": tokens_s, "windows": [round(fig["tokens_per_step"] / w)
                                                    for w in gpt.windows(fig["times"], every, skip=2)]}
    if "peak_gib" in fig:
        from train.observe.metrics import peak_flops

        result["peak_gib"] = fig["peak_gib"]
        if peak := peak_flops(fig["device"], fig["precision"], True):
            result["mfu"] = tokens_s * fig["flops_per_token"] / peak
    return result


def warm_gpt(check: Check, out: Path) -> None:
    """Two steps of stage_gpt's trainer run (and its evaluation): the graphs that the bare loop and fsdp_vs_ddp's
    model-alone variant compile too."""
    train(out, "configs/gpt.yaml", *_gpt_overrides(check.smoke, 2, 1), timeout=check.left_s())


def _stopped_and_relaunched(check: Check, run_dir: Path, cmd: list[str], stop_after: int) -> int:
    """Launch, SIGTERM once metrics.jsonl logs `stop_after`, expect 75; relaunch to the end. The stop's step."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + check.left_s()
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and any(json.loads(x).get("step", 0) >= stop_after and "loss" in json.loads(x)
                                    for x in metrics.read_text().splitlines()):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=max(check.left_s(), 60))
    if proc.returncode != 75:
        raise RuntimeError(f"the stopped run exited {proc.returncode}, not 75:\n{err[-1500:]}")
    stopped = json.loads((run_dir / "STOPPED").read_text())["step"]
    run(cmd, check.left_s())
    return stopped


def _compare(a: Path, b: Path) -> dict:
    """Whether two runs end with bitwise equal checkpoints (model and optimizer) and equal loss lines."""
    import torch

    from train.checkpoint.dcp_io import read_state

    def last(d: Path) -> dict:
        c = d / "checkpoints"
        return read_state(c / (c / "latest").read_text().strip())

    def losses(d: Path) -> list:
        return [(r["step"], r["loss"]) for r in windows(d, skip=0)]

    sa, sb = last(a), last(b)
    differ = [k for part in ("model", "optimizer") for k, v in _flat(sa[part]).items()
              if torch.is_tensor(v) and not torch.equal(v, _flat(sb[part])[k])]
    return {"step": sb["step"], "tensors_differ": differ[:5], "losses_equal": losses(a) == losses(b),
            "equal": not differ and losses(a) == losses(b) and sa["step"] == sb["step"]}


def _flat(d, prefix="") -> dict:
    if isinstance(d, dict):
        return {k2: v2 for k, v in d.items() for k2, v2 in _flat(v, f"{prefix}{k}.").items()}
    return {prefix.rstrip("."): d}


def stage_stop_relaunch(check: Check, out: Path) -> dict:
    """DDP and FSDP on one device (torchrun, one rank): the tiny GPT, deterministic kernels, an asynchronous save
    at every step; stopped at step 4 of 12 and relaunched, against a run that never stopped."""
    smoke = check.smoke
    opts = ["task.model=nano" if smoke else "task.model=tiny", "train.steps=12", "train.log_every=1",
            "checkpoint.every=1", "checkpoint.async=true", "checkpoint.keep=3", "train.deterministic=true",
            "data.num_workers=0", "train.precision=fp32" if smoke else "train.precision=bf16"]
    def strategy(name: str) -> dict:
        ref, seg = out / name / "ref", out / name / "stopped"
        head = [*LAUNCH, "--config", "configs/gpt.yaml", *QUIET, *opts, f"dist.strategy={name}"]
        stopped = together(lambda: run([*head, f"run.dir={ref}"], check.left_s()),
                           lambda: _stopped_and_relaunched(check, seg, [*head, f"run.dir={seg}"], 4))[1]
        saves = len([line for line in (seg / "logs" / "rank0.log").read_text().splitlines() if " INFO saved " in line])
        return {"stopped_at": stopped, "saves": saves, **_compare(ref, seg)}

    ddp, fsdp = together(lambda: strategy("ddp"), lambda: strategy("fsdp"))
    return {"ddp": ddp, "fsdp": fsdp, "equal": ddp["equal"] and fsdp["equal"]}


def together(*calls):
    """Run `calls` at once (threads: each waits on a process of its own); their results in order, or the first
    error. For the stages that check equality, not speed: the GPU and the machine's cores have room for them."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(len(calls), 1)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result() for f in futures]


def stage_hf(check: Check, out: Path) -> dict:
    """The Hugging Face task as a user fine-tunes: a tiny Llama folder with its tokenizer, shards prepared with it,
    FSDP, bf16 (fp32 in the smoke), from the folder's weights; stopped and relaunched against a run that never
    stopped; exported, and loaded by transformers with the trained model's logits."""
    try:
        import transformers  # noqa: F401

        from tests import hf_models
    except ImportError as e:
        raise Skip(f"{e.name or e} is not installed here (requirements-hf.txt)") from None
    import random

    import torch

    from train import export, prepare

    out.mkdir(parents=True, exist_ok=True)
    folder = hf_models.tiny_llama(out / "model")
    words = hf_models.TEXT.split()
    rng = random.Random(0)
    (out / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(6000)))
    if prepare.main([str(out / "corpus.txt"), str(out / "shards"), "--tokenizer", str(folder)]) != 0:
        raise RuntimeError("python -m train.prepare failed")
    opts = ["--config", "configs/hf.yaml", *QUIET, f"task.path={folder}", f"task.data={out / 'shards'}",
            "task.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1",
            "train.eval_every=4", "train.steps=8", "optim.lr=1e-3", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
            "checkpoint.every=2", "checkpoint.keep=5", "data.num_workers=0", "train.deterministic=true",
            "train.precision=fp32" if check.smoke else "train.precision=bf16", "dist.strategy=fsdp"]
    head = LAUNCH
    ref, seg = out / "ref", out / "stopped"
    proc, stopped = together(lambda: run([*head, *opts, f"run.dir={ref}"], check.left_s()),
                             lambda: _stopped_and_relaunched(check, seg, [*head, *opts, f"run.dir={seg}"], 3))
    started = "the first step starts from the weights" in proc.stdout + proc.stderr
    same = _compare(ref, seg)
    if export.main([str(ref), "--format", "hf"]) != 0:
        raise RuntimeError("python -m train.export failed")
    exported = ref / "export" / "step_00000008-hf"
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    theirs = hf_models.logits_of(exported, tokens)
    before = hf_models.logits_of(folder, tokens)
    return {"init_from_folder": started, "stopped_at": stopped, "losses_equal": same["losses_equal"],
            "equal": same["equal"], "export_loads": bool(torch.isfinite(theirs).all()),
            "export_moved_from_folder": not torch.allclose(theirs, before, atol=1e-3)}


# DDP and FSDP at the 16 x 1024, and FSDP with the model compiled alone, its loss eager (as until 7b771c3:
# is compiling the loss with it what halved FSDP's speed?). bench/suite/gpu.py has more (fsdp_keep, fsdp_b32, ...): each
# variant costs the check its compilation and its steps.
LM_VARIANTS = ("ddp", "fsdp", "fsdp_model")


def _lm(check: Check, out: Path, steps: int, trace: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "bench.suite.gpu", "--lm",
           "--json", str(out / "lm.json"), "--variants", ",".join(LM_VARIANTS),
           *([] if trace else ["--no-trace"]), *(["--smoke"] if check.smoke else ["--compile", "--steps", str(steps)])]
    run(cmd, check.left_s())
    return json.loads((out / "lm.json").read_text())


def stage_fsdp_vs_ddp(check: Check, out: Path) -> dict:
    return _lm(check, out, 20)


def warm_fsdp_vs_ddp(check: Check, out: Path) -> None:
    """bench/suite/gpu.py --lm with one timed step and no trace: each variant's compilation. None in the smoke, which
    compiles nothing and whose command (--smoke: one step) would be the stage's own."""
    if not check.smoke:
        _lm(check, out, 1, trace=False)


def _image_train(check: Check, run_dir: Path, *overrides: str) -> None:
    smoke = check.smoke
    size = ["task.model=resnet18", "task.image_size=16", "train.global_batch_size=4", "train.micro_batch_size=4",
            "train.steps=4", "train.log_every=1", "train.precision=fp32"] if smoke else \
        ["task.model=resnet50", "task.image_size=224", "task.num_classes=1000", "train.global_batch_size=256",
         "train.micro_batch_size=256", "train.steps=40", "train.log_every=10", "train.precision=bf16"]
    train(run_dir, "configs/default.yaml", *size, "train.channels_last=true", "train.eval_every=0",
          "checkpoint.every=0", "task.eval_samples=64" if smoke else "task.eval_samples=256",
          "task.train_samples=64" if smoke else "task.train_samples=2560", *overrides, timeout=check.left_s())


def _image_run(check: Check, run_dir: Path, *overrides: str) -> dict:
    _image_train(check, run_dir, *overrides)
    rows = windows(run_dir, skip=1 if check.smoke else 2)
    return {"images_per_s": median(rows, "samples_per_s"), "data_wait_share": median(rows, "data_wait_share"),
            "peak_gib": max((r.get("peak_mem_gib", 0) for r in rows), default=None)}


def stage_resnet50(check: Check, out: Path) -> dict:
    workers = f"data.num_workers={max(1, (os.cpu_count() or 2) - 1)}"
    # (the smoke's "compile" run is eager too: compiling on a CPU takes a minute, and the smoke checks the script)
    return {"eager": _image_run(check, out / "eager", workers),
            "compile": _image_run(check, out / "compile", workers, f"train.compile={not check.smoke}".lower())}


def warm_resnet50(check: Check, out: Path) -> None:
    """Two steps of the compiled run (and its evaluation), two loader workers: the cores are shared meanwhile."""
    _image_train(check, out, "data.num_workers=2", f"train.compile={not check.smoke}".lower(), "train.steps=2")


def stage_imagefolder(check: Check, out: Path) -> dict:
    """JPEGs of 256 px (32 px in the smoke), decoded, cropped and flipped by the loader workers: one per core."""
    import numpy as np
    from PIL import Image

    per_class, classes, size = (4, 2, 32) if check.smoke else (200, 10, 256)
    root = out / "images"
    rng = np.random.default_rng(0)
    t = time.monotonic()
    for split, n in (("train", per_class), ("val", max(2, per_class // 8))):
        for c in range(classes):
            (root / split / f"class{c}").mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(
                    root / split / f"class{c}" / f"{i}.jpg", quality=90)
    made = time.monotonic() - t
    workers = max(1, (os.cpu_count() or 2) - 1)
    fig = _image_run(check, out / "run", "task.data=imagefolder", f"task.path={root}", f"data.num_workers={workers}",
                     *(["train.steps=30"] if not check.smoke else []))
    gpu = (check.figures["stages"].get("resnet50", {}).get("eager") or {}).get("images_per_s")
    return {"jpegs": per_class * classes, "made_s": round(made, 1), "workers": workers, **fig,
            **({"over_synthetic": fig["images_per_s"] / gpu} if gpu and fig["images_per_s"] else {})}


def stage_recovery(check: Check, out: Path) -> dict:
    """The one rank SIGKILLed mid-run under the launcher and restarted by torchrun, compiled (train.compile: its
    restart finds the kernels of the first start in torch.compile's cache) and copying its state to host memory every
    2 steps: each phase from the kill to the first step after the restart, and the steps lost
    (bench/suite/recovery.py). The smoke: eager, on the CPU."""
    from bench.suite import recovery

    extra = [*QUIET, f"train.compile={not check.smoke}".lower()]
    return recovery.once(out / "run", 1, "resnet18", check.smoke, extra, victim=0)


def stage_memory(check: Check, out: Path) -> dict:
    peaks = {}
    for name, stage in check.figures["stages"].items():
        for key, v in _flat(stage).items():
            if key.endswith(("peak_gib", "peak_gib_per_gpu")) and isinstance(v, (int, float)):
                peaks[f"{name}.{key}"] = v
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        peaks["device_total_gib"] = total / 2**30
    return peaks


AT_ONCE = {"tests", "stop_relaunch", "hf"}  # results, not speed: run together, before the timed stages
AT_ONCE_PROCESSES = 10  # the most they run at a time: pytest, 2 x 2 runs of stop_relaunch, 2 runs of hf, 3 warm-ups
# The timed stages' warm-ups, run beside the result stages, all at once (no two compile the same graphs).
WARM = {"gpt": warm_gpt, "fsdp_vs_ddp": warm_fsdp_vs_ddp, "resnet50": warm_resnet50}
STAGES = [("tests", stage_tests), ("gpt", stage_gpt), ("stop_relaunch", stage_stop_relaunch), ("hf", stage_hf),
          ("fsdp_vs_ddp", stage_fsdp_vs_ddp), ("resnet50", stage_resnet50), ("imagefolder", stage_imagefolder),
          ("recovery", stage_recovery), ("memory", stage_memory)]


def run_stages(check: Check, chosen: list, warm: dict | None = None) -> None:
    """The chosen stages ((name, function), in order of value). On a GPU the result stages (AT_ONCE) run together,
    each process with its share of the cores, and beside them the chosen timed stages' warm-ups (`warm`, WARM by
    default); then the timed ones one at a time, with the machine to themselves. The smoke times nothing: every
    stage and warm-up at once, but imagefolder after resnet50 (whose figure it reads) and memory last (it reads them
    all). gpu_check.json lists the stages in order of value."""
    global SHARED_THREADS
    warm = WARM if warm is None else warm
    checks = [s for s in chosen if s[0] in AT_ONCE]
    timed = [s for s in chosen if s[0] not in AT_ONCE and s[0] != "memory"]
    last = [s for s in chosen if s[0] == "memory"]
    names = {n for n, _ in timed}
    warmups = [lambda n=n, fn=fn: check.warm(n, fn) for n, fn in warm.items()
               if n in names] if checks else []  # (only beside result stages)

    def one_at_a_time(stages):
        for name, fn in stages:
            check.stage(name, fn)

    SHARED_THREADS = str(max(1, (os.cpu_count() or 1) // AT_ONCE_PROCESSES))
    try:
        if check.smoke:
            images = [s for s in timed if s[0] in ("resnet50", "imagefolder")]
            together(*[lambda s=s: check.stage(*s) for s in checks], *warmups,
                     lambda: one_at_a_time([s for s in timed if s not in images]), lambda: one_at_a_time(images))
        else:
            together(*[lambda s=s: check.stage(*s) for s in checks], *warmups)
            SHARED_THREADS = None
            one_at_a_time(timed)
        one_at_a_time(last)
    finally:
        SHARED_THREADS = None
    check.figures["stages"] = {n: check.figures["stages"][n] for n, _ in chosen}
    check.write()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the folder for gpu_check.json and each stage's runs")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: a check of this script")
    p.add_argument("--budget-s", type=float, default=300, help="stages that would start after this are skipped")
    p.add_argument("--only", help="comma-separated stages to run (default: all, in order)")
    p.add_argument("--tests", metavar="K", help="the tests stage runs the gpu tests that pytest -k K selects")
    args = p.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA GPU here: run it on a GPU machine, or with --smoke (SMOKE=1) for a CPU check of the "
              "script", file=sys.stderr)
        return 2
    only = set(args.only.split(",")) if args.only else None
    if only and (unknown := only - {n for n, _ in STAGES}):
        print(f"error: --only: no stage {', '.join(sorted(unknown))} (stages: {', '.join(n for n, _ in STAGES)})",
              file=sys.stderr)
        return 2
    check = Check(args.out, args.smoke, args.budget_s)
    check.tests = args.tests
    chosen = [(name, fn) for name, fn in STAGES if only is None or name in only]
    run_stages(check, chosen)
    print(f"wrote {check.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
