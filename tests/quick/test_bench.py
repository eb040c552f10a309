"""gpu-check's schedule and the GPU trace reader, without running a benchmark."""
from __future__ import annotations

import json
import os

import pytest


@pytest.mark.parametrize("smoke", [False, True], ids=["gpu", "smoke"])
def test_gpu_check_runs_the_result_stages_together_and_the_timed_ones_alone(tmp_path, monkeypatch, smoke):
    """bench/check/gpu.py's schedule, with stages that only record when they run: on a GPU the result stages run
    together (each must meet the others at a barrier), their processes with a share of the cores, and beside them
    the compiling stages' warm-ups (each meeting them too), all ended before the timed ones start one at a time
    with every core; the smoke runs them all at once but imagefolder after resnet50 and memory last.
    gpu_check.json lists the stages in order of value either way. (A GPU run's schedule is otherwise first
    exercised on the GPU, whose minutes are few.)"""
    import threading

    from bench.check import gpu as gpu_check

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(gpu_check, "machine", lambda: {})  # what ran it (git, nvidia-smi: processes) is not asked here
    names = [n for n, _ in gpu_check.STAGES]
    results = [n for n in names if n in gpu_check.AT_ONCE]
    first_at_once = results + (["gpt", "resnet50"] if smoke else [])
    warm_heads = list(gpu_check.WARM)  # the warm-ups meet them too
    barrier = threading.Barrier(len(first_at_once) + len(warm_heads), timeout=60)
    lock, events, running, most = threading.Lock(), [], [0], [0]
    images_started = threading.Event()

    def stage(name):
        def fn(check, out):
            with lock:
                events.append(("start", name))
                running[0] += 1
                most[0] = max(most[0], running[0])
            threads = gpu_check.env().get("OMP_NUM_THREADS")
            if name in first_at_once:
                barrier.wait()  # broken (an error) unless they all run at once
            if name == "imagefolder":
                images_started.set()
            if name == "resnet50":  # an imagefolder that ran beside it would start meanwhile
                images_started.wait(timeout=2)
            with lock:
                events.append(("end", name))
                running[0] -= 1
            return {"threads": threads}
        return fn

    def warm(name):
        def fn(check, out):
            with lock:
                events.append(("start", "warm " + name))
            if name in warm_heads:
                barrier.wait()
            with lock:
                events.append(("end", "warm " + name))
        return fn

    check = gpu_check.Check(tmp_path / "check", smoke, 600)
    gpu_check.run_stages(check, [(n, stage(n)) for n in names], {n: warm(n) for n in gpu_check.WARM})
    written = json.loads((tmp_path / "check" / "gpu_check.json").read_text())
    stages = written["stages"]
    assert list(stages) == names
    order = {e: i for i, e in enumerate(events)}
    assert set(written["warm"]) == set(gpu_check.WARM) and "seconds" in written, written
    assert not [n for n, v in stages.items() if "error" in v], stages
    shared = str(max(1, (os.cpu_count() or 1) // gpu_check.AT_ONCE_PROCESSES))
    assert all(stages[n]["threads"] == shared for n in results)
    assert order[("start", "memory")] > max(order[("end", n)] for n in names if n != "memory")
    if smoke:
        assert order[("start", "imagefolder")] > order[("end", "resnet50")]
        assert most[0] >= len(first_at_once)
    else:
        timed = [n for n in names if n not in results]
        ahead = results + ["warm " + n for n in gpu_check.WARM]
        assert min(order[("start", n)] for n in timed) > max(order[("end", n)] for n in ahead)
        assert [e[1] for e in events if e[1] in timed] == [n for n in timed for _ in (0, 1)]  # one at a time, in order
        assert all(stages[n]["threads"] is None for n in timed)  # torch's default: every core
    assert gpu_check.SHARED_THREADS is None


@pytest.mark.parametrize("waits_on", ["stream", "host"])
def test_a_gpu_trace_tells_a_gpu_waiting_on_another_stream_from_one_the_host_starves(tmp_path, waits_on):
    """bench/common.py's trace_summary, which reads the GPU runs' traces (gpu-check, bench/suite/gpu.py --lm), on a
    Chrome trace written here as torch.profiler writes one on a GPU: two steps of 10 ms, the compute stream (7) busy
    0-4 ms and 6-10 ms of each. Between, either an all-gather runs on stream 20 (the GPU is busy: compute waits on
    it) or nothing does (the GPU idles: the host was late). FSDP2's hooks, labelled per unit, are summed by kind."""
    from bench.common import trace_summary

    def span(cat, name, ts_ms, dur_ms, **extra):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts_ms * 1000, "dur": dur_ms * 1000, **extra}

    events = []
    for step, t in enumerate((0, 10)):
        events += [span("user_annotation", f"ProfilerStep#{step}", t, 10),
                   span("user_annotation", "FSDP::pre_forward (transformer.h.0)", t, 1),
                   span("user_annotation", "FSDP::pre_forward (transformer.h.1)", t + 5, 0.5),
                   span("kernel", "gemm", t, 4, args={"stream": 7}),
                   span("kernel", "gemm", t + 6, 4, args={"stream": 7})]
        if waits_on == "stream":
            events.append(span("kernel", "ncclDevKernel_AllGather", t + 4, 2, args={"stream": 20}))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    fig = trace_summary(path, steps=2)
    assert fig["step_ms"] == 10
    assert fig["streams"]["7"] == {"busy_share": 0.8, "ms_per_step": 8.0}, fig
    if waits_on == "stream":
        assert fig["gpu_busy_share"] == 1.0 and fig["streams"]["20"]["busy_share"] == 0.2, fig
    else:
        assert fig["gpu_busy_share"] == 0.8 and list(fig["streams"]) == ["7"], fig
    assert fig["host_labels"]["FSDP::pre_forward"] == {"calls_per_step": 2.0, "ms_per_step": 1.5}, fig
