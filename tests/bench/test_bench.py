"""Every benchmark runs (a seconds-long smoke, as `make bench` would at full size) and BENCHMARKS.md
gets a row per figure. Timings are printed, never asserted."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PY, ROOT, clean_env


def test_benchmarks_smoke_writes_the_results_page(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run([PY, "-m", "bench", "all", "--smoke", "--out", str(out)], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = out.read_text()
    for figure in ("overhead: python -m train / the user's DDP loop", "goal met by more than the spread",
                   "final weights bitwise equal to the same math",
                   "overhead, language model: python -m train / a nanoGPT", "same 2 cores: 2 processes / 1 process",
                   "data wait share of a step, ImageFolder",
                   "checkpoint save, 2 ranks / one process's torch.save + fsync",
                   "checkpoint save, 2 ranks / the disk's write", "dd conv=fsync of those bytes",
                   "checkpoint load, 2 ranks / one process's torch.load(mmap=True)", "async save: training blocked",
                   "recovery after SIGKILL of a worker: total", "peak RSS per rank / M, built on the meta device",
                   "GPU: ResNet-50 224px"):
        row = next(line for line in page.splitlines() if figure in line)
        assert "not measured" not in row, row
    # the smoke trains both loops from the same seed: the template adds no numerical difference
    assert "| overhead: final weights bitwise equal to the same math in a bare loop | yes |" in page
    assert (tmp_path / "BENCHMARKS.png").stat().st_size > 1000
    # no GPU here: the GPU table is the newest make gpu-check kept in docs/dev/gpu/, and the head says so
    kept = sorted((ROOT / "docs" / "dev" / "gpu").glob("*.json"))[-1].relative_to(ROOT)
    head = next(line for line in page.splitlines() if line.startswith("- GPU figures:"))
    assert "the GPU table below, `make gpu-check` on " in head and str(kept) in head and "added in" in head, head
    assert f"## GPU (`make gpu-check`, from {kept})" in page
    assert "not measured" not in head
    print(page)


def test_fsdp_host_smoke_times_each_phase_of_a_step():
    """bench/studies/fsdp_host.py (run by hand: FSDP2's host time a step, docs/dev/benchmark-studies.md) still runs, and
    times each phase of a step for the model alone and under FSDP (figures printed, not asserted)."""
    proc = subprocess.run([PY, "-m", "bench.studies.fsdp_host", "--smoke", "--layers", "2"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    for variant in ("model", "fsdp"):
        assert set(fig[variant]) == {"forward_backward", "clip", "optimizer", "zero_grad", "total"}, fig
        assert fig[variant]["forward_backward"] > 0 and fig[variant]["optimizer"] > 0, fig
    assert "fsdp_extra_ms_per_unit" in fig


def test_prepare_memory_smoke_reports_the_peak_memory_a_token(tmp_path):
    """bench/studies/prepare_memory.py (run by hand: docs/language-models.md quotes it) still runs on a 1 MB corpus, and
    says how many tokens it made and its peak memory above the imports."""
    pytest.importorskip("tokenizers", reason="pip install -r requirements-hf.txt")
    proc = subprocess.run([PY, "-m", "bench.studies.prepare_memory", "--mb", "1", "--vocab", "500", "--json",
                           str(tmp_path / "f.json")], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["tokens"] > 200_000 and figures["peak_rss_mib"] > figures["imports_rss_mib"] > 0, figures


def test_lora_memory_smoke_measures_a_frozen_backbone_fine_tune(tmp_path):
    """bench/studies/lora_memory.py (run by hand: docs/pretrained.md cites it) still runs: its frozen-backbone fine-tune
    (the one mode no other test trains; LoRA's run is tests/processes/test_hf_task.py's) on 2 CPU ranks, a Llama of 2
    layers of 64 wide, 2 steps (one launch, 15-30 s here): what it trains and each rank's peak (printed, not
    asserted)."""
    pytest.importorskip("peft", reason="pip install -r requirements-hf.txt")
    proc = subprocess.run([PY, "-m", "bench.studies.lora_memory", "--modes", "frozen", "--layers", "2", "--hidden",
                           "64", "--seq-len", "32", "--steps", "2", "--json", str(tmp_path / "f.json")],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "f.json").read_text())
    frozen = figures["modes"]["frozen"]
    assert 0 < frozen["trained"] < figures["parameters"] and min(frozen["rank_step_mib"]) > 0, figures
    print(proc.stdout)


def test_make_gpu_check_smoke_runs_every_stage_and_writes_its_figures(tmp_path):
    """`make gpu-check SMOKE=1`: every stage of the GPU machine's check at toy sizes on the CPU, so that the script is
    known to work before a GPU is there: each stage's figures in gpu_check.json, no stage failed, the stops and
    relaunches equal the runs that never stopped, and `python -m bench all` (bench/report.py) makes the GPU table from
    it."""
    out = tmp_path / "check"
    proc = subprocess.run(["make", "gpu-check", "SMOKE=1", f"OUT={out}", f"GPU_PY={PY}"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check = json.loads((out / "gpu_check.json").read_text())
    stages = check["stages"]
    assert list(stages) == ["tests", "gpt", "stop_relaunch", "hf", "fsdp_vs_ddp", "resnet50", "imagefolder",
                            "recovery", "memory"]
    failed = {k: v.get("error") or v.get("skipped") for k, v in stages.items() if "error" in v or "skipped" in v}
    assert not failed, failed
    assert stages["tests"]["tests"] and stages["tests"]["exit"] == 0
    assert stages["gpt"]["trainer_tokens_per_s"] > 0 and stages["gpt"]["bare_tokens_per_s"] > 0
    assert stages["stop_relaunch"]["ddp"]["equal"] and stages["stop_relaunch"]["fsdp"]["equal"]
    assert stages["stop_relaunch"]["ddp"]["saves"] >= 3  # an asynchronous save at every step, several in a row
    assert stages["hf"]["equal"] and stages["hf"]["export_loads"] and stages["hf"]["init_from_folder"]
    lm = stages["fsdp_vs_ddp"]
    assert lm["lm_fsdp_over_ddp_speed"] > 0 and lm["lm_fsdp_model_over_ddp_speed"] > 0, lm
    # its trace says how long the host spends in FSDP2's hooks a step (is the host what keeps the GPU waiting?)
    hooks = lm["lm_fsdp_trace"]["host_labels"]
    assert hooks["FSDP::pre_forward"]["calls_per_step"] >= 3 and hooks["FSDP::pre_forward"]["ms_per_step"] > 0, hooks
    assert stages["resnet50"]["compile"]["images_per_s"] > 0 and stages["imagefolder"]["images_per_s"] > 0
    # the one rank killed and restarted from host memory: each phase timed, at most memory_every=2 steps lost
    recovery = stages["recovery"]
    assert recovery["start-up"] > 0 and recovery["first step"] > 0 and 0 <= recovery["steps lost"] <= 2, recovery
    assert check["machine"]["torch"] and check["machine"]["commit"]  # BENCHMARKS.md names what it measured
    # each python -m train run's timeline: where a stage's seconds go (start, first step line, steps, the end)
    run = check["runs"]["gpt/trainer"]
    assert run["to_first_step_line_s"] > 0 and run["wall_s"] >= run["to_first_step_line_s"] + run["steps_s"], run
    # the warm-ups (on a GPU: the compiling stages' first steps, beside the result stages) ran their commands
    assert set(check["warm"]) == {"gpt", "fsdp_vs_ddp", "resnet50"}, check["warm"]
    assert not [k for k, v in check["warm"].items() if "error" in v], check["warm"]
    assert (out / "warm" / "gpt" / "metrics.jsonl").exists() and (out / "warm" / "resnet50" / "summary.json").exists()
    from bench import report

    table = "\n".join(report.gpu_check_lines(check, "gpu_check.json"))
    assert "| stopped and relaunched = never stopped, bitwise, DDP, async save every step | yes | yes | yes |" in table
    assert "torch " + check["machine"]["torch"] in table
    assert f"| the whole check (`make gpu-check`), s | {check['seconds']:.0f} | <= 300 |" in table, table
    cut = check | {"stages": stages | {"memory": {"skipped": "out of time (--budget-s)", "seconds": 0}}}
    assert "| <= 300 | **no** (memory not measured) |" in "\n".join(report.gpu_check_lines(cut, "x.json"))
    assert check["seconds"] >= max(v["seconds"] for v in stages.values())
