"""How fast a run goes: step timing on every rank, summarised over all ranks at log steps; MFU; profiling.

Each rank times, over a window of steps between two log steps:
  wall     the window's wall time, minus evaluations and checkpoint saves (`paused()`);
  data     time spent in next(batches), waiting for the loader;
  compute  forward and backward: its own work, plus DDP's collectives (the buffer broadcast in forward,
           the gradient all-reduce in backward), plus the time spent in them waiting for slower
           ranks (CUDA events on GPUs, where the host runs ahead of the device).
DDP makes every rank wait for the slowest at each step, so wall times are equal and say nothing about
who is slow. A rank's wait for its peers is estimated as its `compute` minus the smallest `compute`
of any rank (the slowest rank hardly waits; the work itself is the same on every rank), and its own
time as the wall time minus that wait: the rate each rank could sustain alone, and the slowest rank
against the fastest. This finds ranks held back by their data loading or their host; a GPU that is
itself slower than its peers is not told apart from waiting. One all-gather of four numbers per log
step, none in between.

Throughput counts a task's units (tokens) that are not padding where the task says how many a batch holds
(Task.units: packed windows' padding left out); the padding share is logged beside it. MFU counts the FLOPs of those
units: the task's FLOPs a sample over its units a sample, times the real units (a language model: nanoGPT's count a
token, attention as over a full causal window whether a document mask skips part of it or not).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Dense peak TFLOP/s per GPU (no sparsity) from the vendors' data sheets: (bf16/fp16, tf32, fp32).
# Matched as substrings of torch.cuda.get_device_name(), first match wins (more specific first).
PEAK_TFLOPS: list[tuple[str, tuple[float | None, float | None, float]]] = [
    ("GB200", (2500.0, 1250.0, 80.0)),
    ("B200", (2250.0, 1100.0, 75.0)),
    ("GH200", (989.4, 494.7, 66.9)),
    ("H200", (989.4, 494.7, 66.9)),
    ("H100 NVL", (835.0, 417.5, 60.0)),
    ("H100 PCIe", (756.5, 378.0, 51.2)),
    ("H100", (989.4, 494.7, 66.9)),  # SXM
    ("H800", (989.4, 494.7, 66.9)),
    ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.0, 91.6)),
    ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10G", (70.0, 35.0, 31.2)),
    ("A10", (125.0, 62.5, 31.2)),
    ("RTX 6000 Ada", (364.2, 182.1, 91.1)),
    ("RTX A6000", (154.8, 77.4, 38.7)),
    ("V100", (125.0, None, 15.7)),  # fp16 only, no bf16 or tf32
    ("T4", (65.0, None, 8.1)),
]


def peak_flops(device_name: str, precision: str, tf32: bool) -> float | None:
    """The device's dense peak FLOP/s for the precision the matmuls run in; None if unknown."""
    for key, (half, tf, fp32) in PEAK_TFLOPS:
        if key in device_name:
            if precision in ("bf16", "fp16"):
                tflops = half if precision == "fp16" or tf is not None else None  # no bf16 before Ampere
            else:
                tflops = tf if tf32 and tf is not None else fp32
            return tflops * 1e12 if tflops else None
    return None


def flops_per_sample(task, model: torch.nn.Module, batch) -> float:
    """Forward + backward FLOPs of one training sample: the task's own count, or torch's FlopCounterMode
    over one step of its loss on `batch` (two samples of its data) run on a copy of the model (under FSDP:
    a new one on the meta device), so that the real model, its gradients and the random state are untouched."""
    if (flops := task.flops_per_sample(model)) is not None:
        return float(flops)
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    from train.parallel.wrapping import sharded
    from train.task import first_tensor

    if sharded(model):  # a copy would gather and reduce-scatter on its own: the whole model, on no memory
        batch = _to_meta(batch)
    first = first_tensor(batch)
    with torch.random.fork_rng(devices=[first.device] if first.device.type == "cuda" else []):
        if sharded(model):
            with torch.device("meta"):
                twin = task.model()
        else:
            twin = copy.deepcopy(model)
        with FlopCounterMode(display=False) as counter:
            task.loss(twin, batch).backward()
    return counter.get_total_flops() / int(first.shape[0])


def _to_meta(batch):
    if torch.is_tensor(batch):
        return batch.to("meta")
    if isinstance(batch, dict):
        return {k: _to_meta(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_meta(v) for v in batch)
    return batch


class StepMeter:
    """Step timing on one rank; `window()` is collective: every rank calls it at the same steps."""

    def __init__(self, device: torch.device, world_size: int, samples_per_rank_step: int,
                 flops_per_sample: float | None = None, peak_flops: float | None = None,
                 profiler: Profiler | None = None, unit: str = "samples", units_per_sample: int = 1):
        self.device, self.world_size, self.samples_per_rank_step = device, world_size, samples_per_rank_step
        self.unit, self.units_per_sample = unit, units_per_sample
        self.flops_per_sample, self.peak_flops, self.profiler = flops_per_sample, peak_flops, profiler
        self.cuda = device.type == "cuda"
        self._reset()

    @classmethod
    def build(cls, cfg, rank: int, world_size: int, device: torch.device, task, model: torch.nn.Module,
              eval_loader, log, step: int) -> StepMeter:
        """The meter of a run from `step` on: FLOPs and peak only on GPUs (MFU is omitted on CPU), counted on two
        evaluation samples; the profiler if asked."""
        flops = peak = None
        if device.type == "cuda":
            peak = peak_flops(torch.cuda.get_device_name(device), cfg.train.precision, cfg.train.tf32)
            try:
                from train.parallel.data import to_device

                sample = eval_loader.collate_fn([eval_loader.dataset[k] for k in [(0, 0), (1, 0)]])
                flops = flops_per_sample(task, model, to_device(sample, device, cfg.train.channels_last))
            except Exception as e:  # an estimate is not worth a failed run
                log.warning(f"FLOPs not counted ({type(e).__name__}: {e}); no MFU")
        prof = Profiler(cfg, rank, step) if cfg.profile.enabled else None
        samples = sum(cfg.micro_batches(world_size))
        return cls(device, world_size, samples, flops, peak, prof, task.unit, task.units_per_sample())

    def start(self) -> None:
        """All ranks start timing together (collective): rank 0's start-up work (W&B) is not a wait."""
        dist.all_reduce(torch.zeros(1, device=self.device))
        self._reset()

    def _reset(self) -> None:
        self.steps, self.data_s, self.compute_s, self.paused_s = 0, 0.0, 0.0, 0.0
        self.real_units, self.all_units, self.counted = 0, 0, False  # Task.units: units that are not padding
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def waiting_for_data(self):
        t = time.perf_counter()
        yield
        self.data_s += time.perf_counter() - t

    @contextlib.contextmanager
    def computing(self):
        """Around a micro-step's forward and backward."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t = time.perf_counter()
            yield
            self.compute_s += time.perf_counter() - t

    @contextlib.contextmanager
    def paused(self):
        """Evaluation and checkpointing: not training time."""
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the training work queued so far counts, not the pause
        t = time.perf_counter()
        yield
        self.paused_s += time.perf_counter() - t

    def units(self, real, samples: int) -> None:
        """A micro-batch of `samples` holds `real` units that are not padding (Task.units; None: all of them)."""
        whole = samples * self.units_per_sample
        self.real_units += whole if real is None else int(real)
        self.all_units += whole
        self.counted = self.counted or real is not None

    def step_done(self) -> None:
        self.steps += 1
        if self.profiler is not None:
            self.profiler.prof.step()

    def window(self) -> dict:
        """Throughput of the steps since the last call, over all ranks (collective; rank 0 reports it)."""
        wall = time.perf_counter() - self.t0 - self.paused_s
        compute = self.compute_s + sum(s.elapsed_time(e) for s, e in self._events) / 1e3  # all done by now
        mem = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else 0.0
        mine = torch.tensor([wall, self.data_s, compute, mem, self.real_units, self.all_units, self.counted],
                            dtype=torch.float64,
                            device=self.device if self.world_size > 1 else "cpu")
        every = [mine]  # one process: its row stays on the host, with no trip to the GPU and back while it idles
        if self.world_size > 1:
            every = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(every, mine)
        wall, data, compute, mem, real, whole, counted = torch.stack(every).cpu().T  # one row per rank
        steps = max(self.steps, 1)
        # Each rank's own time: the job's wall time (rank 0's clock) minus its wait for slower ranks; at
        # least its data wait and the least compute of any rank.
        own = torch.maximum(wall[0] - (compute - compute.min()), data + compute.min()).clamp(min=1e-9)
        slowest = int(own.argmax())
        out = {
            "samples_per_s": steps * self.samples_per_rank_step * self.world_size / wall[0].item(),
            "step_time_s": wall[0].item() / steps,
            **({f"{self.unit}_per_s": steps * self.samples_per_rank_step * self.world_size * self.units_per_sample
                / wall[0].item()} if self.unit != "samples" else {}),
            "samples_per_s_rank": (steps * self.samples_per_rank_step / own).tolist(),
            "data_wait_share": (data / wall).mean().item(),
            "straggler_ratio": (own.max() / own.min()).item(),
            "slowest_rank": slowest,
            "slowest_data_wait_share": (data[slowest] / wall[slowest]).item(),
        }
        if counted.any() and self.unit != "samples":  # the task said its padding: the real units count
            out[f"{self.unit}_per_s"] = real.sum().item() / wall[0].item()
            out["padding_share"] = 1 - real.sum().item() / max(whole.sum().item(), 1.0)
        if self.cuda:
            out["peak_mem_gib"] = mem.max().item()
            if self.flops_per_sample:
                achieved = self.flops_per_sample * out["samples_per_s"] / self.world_size
                if counted.any():  # the FLOPs of the units that are not padding
                    achieved = self.flops_per_sample / self.units_per_sample * real.sum().item() / wall[0].item() \
                        / self.world_size
                out["tflops_per_gpu"] = achieved / 1e12
                if self.peak_flops:
                    out["mfu"] = achieved / self.peak_flops
        self._reset()
        return out

    def close(self) -> str | None:
        """Stop the profiler, if any (a trace still being recorded is written now); says what it wrote."""
        if self.profiler is not None:
            prof, self.profiler = self.profiler, None
            return prof.stop()
        return None


class Profiler:
    """torch.profiler over steps wait+warmup+1 .. wait+warmup+active of this process, written as
    <run_dir>/profile/rank<N>.<time>.pt.trace.json (every rank): TensorBoard's profiler plugin, or
    ui.perfetto.dev. The trace numbers the steps of this process from 0 (ProfilerStep#N)."""

    def __init__(self, cfg, rank: int, step: int):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        p = cfg.profile
        self.dir, self.rank = cfg.run_dir / "profile", rank
        self.first = step + p.wait + p.warmup + 1  # the training steps recorded, as metrics.jsonl counts them
        self.last = min(self.first + p.active - 1, cfg.train.steps)
        self.offset = step + 1
        self.before = self._traces()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=activities, schedule=schedule(wait=p.wait, warmup=p.warmup, active=p.active,
                                                                    repeat=1),
                            on_trace_ready=tensorboard_trace_handler(str(self.dir), worker_name=f"rank{rank}"),
                            record_shapes=True, profile_memory=p.memory)
        self.prof.start()

    def _traces(self) -> set[Path]:
        return set(self.dir.glob(f"rank{self.rank}.*.pt.trace.json"))

    def stop(self) -> str:
        self.prof.stop()
        if not self._traces() - self.before:
            return f"profiler: the run ended before step {self.first}, no trace (lower profile.wait)"
        return (f"profiler: steps {self.first}-{self.last} (ProfilerStep#{self.first - self.offset}-"
                f"#{self.last - self.offset} in the trace) in {self.dir}: TensorBoard's profiler plugin or "
                f"ui.perfetto.dev")
