"""FSDP2 (dist.strategy=fsdp) beside DDP, on 2 CPU ranks (gloo): the same training as DDP, accumulation without
a gradient sync, activation checkpointing that changes nothing but memory, a bitwise resume, and the bad
combinations in one line."""
from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import (
    PY,
    ROOT,
    assert_same_state,
    assert_same_training,
    clean_env,
    latest_state,
    metrics,
    run_train,
    summary,
)
from tests.procs import finish, logged_steps, signal_at_step, wait_for
from train.checkpoint import dcp_io

# The language model at its smallest (nano: 2 blocks of width 32), in fp32, windows of 32 tokens, 2 ranks x 2
# micro-steps of 4 (accumulation), clipping that bites (the gradient norm is ~0.3-1 here), dropout (the masks
# must be the same with activation checkpointing). 33 evaluation windows: 17 on rank 0, 16 on rank 1, which
# runs out of batches first (under FSDP it must still join each forward's all-gathers; a hang would end at the
# collective timeout).
LM = ["--config", "configs/gpt.yaml", "task.model=nano", "task.seq_len=32", f"task.train_tokens={64 * 32 + 1}",
      f"task.eval_tokens={33 * 32 + 1}", "task.dropout=0.1", "data.num_workers=0", "train.global_batch_size=16",
      "train.micro_batch_size=4", "train.grad_clip=0.05", "train.log_every=1", "train.eval_every=0",
      "train.steps=20", "checkpoint.every=0", "optim.warmup_steps=2", "log.wandb.mode=disabled",
      "log.report=false", "dist.timeout_s=120"]


TRACED = ["profile.enabled=true", "profile.wait=2", "profile.warmup=0", "profile.active=2"]


def lm_cmd(run_dir: Path, *overrides: str, launcher: bool = False) -> list[str]:
    head = ([PY, "-m", "train.launch", "--nproc-per-node=2", "--"] if launcher else
            [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "train"])
    return [*head, *LM, f"run.dir={run_dir}", *overrides]


def run_lm(run_dir: Path, *overrides: str, expect: int = 0, launcher: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(lm_cmd(run_dir, *overrides, launcher=launcher), cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


AC = ["dist.strategy=fsdp", "train.activation_checkpointing=true"]


def stop_and_resume_ac(run: Path) -> tuple[int, int]:
    """FSDP with activation checkpointing, stopped by SIGTERM to the launcher once step 5 is logged (the ranks
    take it within the step they are in: procs.signal_at_step) and relaunched to its end. Returns (the step
    logged at the signal, the step of the checkpoint the stop saved)."""
    proc = subprocess.Popen(lm_cmd(run, *AC, launcher=True), cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    paused_at = signal_at_step(proc, run, 5, ranks=2)
    rc, _, err = finish(proc)
    assert rc == 75, err[-3000:]
    stopped = latest_state(run)["step"]
    run_lm(run, *AC, launcher=True)
    return paused_at, stopped


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """The same 20 steps under DDP, FSDP, and FSDP with activation checkpointing stopped at step 5 or 6 and
    resumed (stop_and_resume_ac), each made once, on demand."""
    root, made = tmp_path_factory.mktemp("fsdp_runs"), {}

    def get(name: str) -> tuple[Path, str | tuple[int, int]]:
        if name not in made:
            if name == "fsdp_ac_resumed":
                made[name] = (root / name, stop_and_resume_ac(root / name))
            else:
                extra = {"ddp": [], "fsdp": ["dist.strategy=fsdp", *TRACED]}[name]
                made[name] = (root / name, run_lm(root / name, *extra).stdout)
        return made[name]

    return get


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir) if "loss" in m}


def test_fsdp_trains_as_ddp_with_accumulation_and_clipping(lm_runs):
    (ddp, ddp_out), (fsdp, fsdp_out) = lm_runs("ddp"), lm_runs("fsdp")
    a, b = losses(ddp), losses(fsdp)
    assert a.keys() == b.keys() == set(range(1, 21))
    # Not bitwise: the clipping norm is summed in another order (each rank's shard, then an all-reduce of the
    # squares, against one sum over whole gradients), and training carries the difference on. Measured: at
    # most 6.3e-8 relative over the 20 steps (0 without clipping: with 2 ranks the reduce-scatter adds the same
    # two numbers as the all-reduce, and the division by 2 is exact). The bound is 8 times that.
    worst = max(abs(a[s] - b[s]) / a[s] for s in a)
    assert worst < 5e-7, f"FSDP's losses differ from DDP's by {worst:.2e} (relative)"
    assert a[20] < a[1]  # it trains
    sa, sb = summary(ddp), summary(fsdp)
    assert abs(sa["eval_loss"] - sb["eval_loss"]) / sa["eval_loss"] < 5e-7, (sa["eval_loss"], sb["eval_loss"])
    assert sb["ranks_in_sync"] is True and sb["world_size"] == 2
    # What each rank holds: the whole model's count is DDP's; each rank keeps about half of it.
    counts = re.search(r"model: ([\d,]+) parameters, ([\d,]+) of them", fsdp_out).groups()
    whole, here = (int(n.replace(",", "")) for n in counts)
    assert f"model: {whole:,} parameters, {whole:,} of them held by this rank (dist.strategy=ddp)" in ddp_out
    assert abs(here - whole / 2) < 0.02 * whole, (here, whole)
    # Accumulation: the first of the 2 micro-steps only accumulates (set_requires_gradient_sync(False)): one
    # reduce-scatter per FSDP unit (2 blocks and the root) and step, in rank 0's trace of 2 steps.
    (trace,) = (fsdp / "profile").glob("rank0.*.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name") == "c10d::_reduce_scatter_base_" for e in events) == 3 * 2


def test_activation_checkpointing_gives_the_same_losses(lm_runs):
    """Bitwise: the recomputed forward replays the RNG (the same dropout masks) and does the same arithmetic. The
    run with it is the one stopped and resumed (test_stop_and_resume_under_fsdp_is_bitwise): every step's loss
    and the evaluation are still those of the plain, uninterrupted run."""
    (plain, _), (ac, _) = lm_runs("fsdp"), lm_runs("fsdp_ac_resumed")
    assert losses(ac) == losses(plain) and summary(ac)["eval_loss"] == summary(plain)["eval_loss"]


def test_stop_and_resume_under_fsdp_is_bitwise(lm_runs):
    """SIGTERM to the launcher mid-run: the ranks save the gathered model and optimizer state and exit 75; the
    relaunch loads them into the shards and ends where the uninterrupted FSDP run ends, bit for bit (the run
    stopped recomputes its blocks, activation checkpointing: the same arithmetic,
    test_activation_checkpointing_gives_the_same_losses)."""
    ref = lm_runs("fsdp")[0]
    run, (paused_at, stopped) = lm_runs("fsdp_ac_resumed")
    assert 5 <= paused_at <= stopped <= paused_at + 1 < 20, (paused_at, stopped)
    assert_same_training(ref, run)
    assert summary(run)["eval_loss"] == summary(ref)["eval_loss"]


def test_bad_combinations_are_one_line_exit_2(tmp_path, lm_runs):
    proc = subprocess.run([PY, "-m", "train", "--check", f"run.dir={tmp_path / 'x'}", "dist.strategy=fsdp",
                           "dist.static_graph=true"], cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: dist.static_graph is a DDP option: it has no meaning with dist.strategy=fsdp"]
    from train import config
    from train.config import ConfigError

    with pytest.raises(ConfigError, match="task examples/regression.py:Regression names no blocks to recompute"):
        config.load("examples/regression.yaml", ["train.activation_checkpointing=true"])


def test_a_run_changes_strategy_at_each_stop_ddp_to_fsdp_and_back(tmp_path, lm_runs):
    """Stopped under DDP, resumed under FSDP, stopped again and finished under DDP: the checkpoints (DCP, keyed
    by parameter names under either strategy) carry the model, the optimizer and the data position across, so
    the losses are those of the uninterrupted DDP run, within FSDP's own tolerance (the clipping norm's order
    of summation, test_fsdp_trains_as_ddp_with_accumulation_and_clipping), and no sample is seen twice."""
    ref, run = lm_runs("ddp")[0], tmp_path / "run"
    stops = []
    for strategy, until in (("ddp", 5), ("fsdp", 12)):
        proc = subprocess.Popen(lm_cmd(run, f"dist.strategy={strategy}", launcher=True), cwd=ROOT, env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        wait_for(lambda p=proc, u=until: p.poll() is not None or any(st >= u for st in logged_steps(run)), 180,
                 f"step {until}")
        proc.send_signal(signal.SIGTERM)
        rc, _, err = finish(proc)
        assert rc == 75, err[-3000:]
        stops.append(latest_state(run)["step"])
    assert 5 <= stops[0] < stops[1] < 20, stops
    run_lm(run, "dist.strategy=ddp", launcher=True)
    steps = [m["step"] for m in metrics(run) if "loss" in m]
    assert steps == list(range(1, 21)), steps  # every step once: none repeated, none skipped
    a, b = losses(ref), losses(run)
    worst = max(abs(a[s] - b[s]) / a[s] for s in a)
    assert worst < 5e-7, f"the losses differ from the uninterrupted DDP run's by {worst:.2e} (relative)"
    assert all(a[s] == b[s] for s in range(1, stops[0] + 1))  # DDP's own steps before the first stop: bitwise
    assert abs(summary(ref)["eval_loss"] - summary(run)["eval_loss"]) / summary(ref)["eval_loss"] < 5e-7
    log = (run / "logs").glob("*")
    assert not any("world size changed" in f.read_text(errors="replace") for f in log if f.is_file())


def test_a_resnet_under_fsdp_ends_bitwise_where_ddp_does(tmp_path):
    """The tests' quarter-width ResNet (tests/small_task.py: the built-in one's 4 stages as FSDP units, BatchNorm),
    2 ranks x 2 micro-steps, fp32 without clipping: with 2
    ranks the reduce-scatter adds the same two numbers as DDP's all-reduce, so the checkpoints (the gathered
    model, BatchNorm statistics included, under the same names as DDP's, and the optimizer's state) are equal
    bit for bit, those that FSDP saved with checkpoint.async (copied while the next step ran) included."""
    runs = {}
    for strategy, saving in (("ddp", "false"), ("fsdp", "true")):
        runs[strategy] = tmp_path / strategy
        run_train(runs[strategy], "task.image_size=8", "task.eval_samples=16", "train.micro_batch_size=4",
                  "train.steps=2", f"dist.strategy={strategy}", "checkpoint.every=1", f"checkpoint.async={saving}",
                  nproc=2)
    for step in (1, 2):
        a, b = (dcp_io.read_state(runs[s] / "checkpoints" / f"step_{step:08d}") for s in ("ddp", "fsdp"))
        assert_same_state(a, b, f"step {step}: ")
    assert losses(runs["ddp"]) == losses(runs["fsdp"])
    # FSDP does not broadcast rank 0's BatchNorm statistics at each forward as DDP does: evaluation gives every
    # rank rank 0's (those of the checkpoint), so the evaluation is DDP's too.
    assert summary(runs["ddp"])["eval_loss"] == summary(runs["fsdp"])["eval_loss"]


def test_no_rank_holds_the_model_over_a_whole_fsdp_run(tmp_path):
    """python -m bench.suite.fsdp_run_memory on 2 ranks, a GPT of 4 blocks of width 1536 (114M parameters, M = 433
    MiB, a block 0.25 M), SGD without momentum, two steps, a save after each, evaluations, the end: each rank's peak RSS
    above the same run with the tiny model. A rank holds its shard and its gradients' (M / 2 each) and one
    block's parameters and gradients in flight: 1.49-1.51 M here (runs differ by a few MiB, hence a model this
    large). FSDP2's reduce-scatter buffer, kept for a GPU's allocator, made it 1.64-1.66 M; freed blocks kept on
    glibc's heap 5 M; each save's zero gradients for the stateless optimizer (torch's get_state_dict) another
    M / 2 above the shard during the save."""
    out = tmp_path / "memory.json"
    proc = subprocess.run([PY, "-m", "bench.suite.fsdp_run_memory", "--nproc", "2", "--layers", "4", "--embd", "1536",
                           "--heads", "16", "--json", str(out)], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert 420 < fig["run_memory_model_mib"] < 450, proc.stdout
    assert fig["run_memory_peak_over_m"] < 1.57, proc.stdout  # one block in flight, not two
    phases = fig["run_memory_phase_over_m"]
    assert phases["save 1"] < 0.85 and phases["end"] < 0.85, proc.stdout  # the shard (0.5 M) and a little
