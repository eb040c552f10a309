"""The language model through the trainer, on real ranks: bf16 with accumulation, a stop and a bitwise resume
mid-epoch. (The windows a world-size change reads are the sampler's, the same for every task:
tests/processes/test_checkpoint_format.py. A malformed shard is one line naming it: tests/processes/test_lm.py; such an
error found by
the workers is exit 2 once, not retried, as test_launcher.py's usage errors are.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from tests.conftest import PY, ROOT, assert_same_training, clean_env, latest_state, metrics, summary
from tests.procs import finish, stop_at

# configs/gpt.yaml shrunk: windows of 32 tokens, 64 of them (4 steps of 16 an epoch), 2 micro-steps of 4 a rank
# on 2 ranks (accumulation), bf16 autocast.
LM = ["--config", "configs/gpt.yaml", "task.seq_len=32", f"task.train_tokens={64 * 32 + 1}", "task.eval_tokens=1025",
      "data.num_workers=0", "train.global_batch_size=16", "train.micro_batch_size=4", "train.precision=bf16",
      "train.log_every=5", "train.eval_every=0", "checkpoint.every=0", "optim.warmup_steps=2",
      "log.wandb.mode=disabled", "log.report=false"]


def lm_cmd(run_dir: Path, *overrides: str, nproc: int = 2, launcher: bool = False) -> list[str]:
    if launcher:
        return [PY, "-m", "train.launch", f"--nproc-per-node={nproc}", "--", *LM, f"run.dir={run_dir}", *overrides]
    if nproc == 1:  # one rank: the trainer alone (torchrun's own process would import torch for nothing)
        return [PY, "-m", "train", *LM, f"run.dir={run_dir}", *overrides]
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "train", *LM,
            f"run.dir={run_dir}", *overrides]


def run_lm(run_dir: Path, *overrides: str, nproc: int = 2, env: dict | None = None, expect: int = 0):
    proc = subprocess.run(lm_cmd(run_dir, *overrides, nproc=nproc), cwd=ROOT, env=env or clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def assert_no_loss_under_the_entropy_rate(run_dir: Path) -> None:
    """The built-in corpus is a Markov chain: no model predicts it with a loss under its entropy rate (~1.19 nats
    a token), but one that sees its targets (the windows' tokens shifted wrongly, a causal mask that lets a
    position see the next) goes down to 0. A logged loss is a mean over 512 tokens or more: its sampling noise
    is a few hundredths of a nat, well within the margin."""
    from train import config
    from train.tasks.gpt import builtin_entropy

    rate = builtin_entropy(config.load(str(run_dir / "config.yaml"), []).seed).rate
    losses = {m["step"]: m["loss"] for m in metrics(run_dir) if "loss" in m}
    evals = [m["eval_loss"] for m in metrics(run_dir) if "eval_loss" in m] + [summary(run_dir)["eval_loss"]]
    assert min(losses.values()) > rate - 0.15, f"a loss under the entropy rate {rate:.3f}: {losses}"
    assert min(evals) > rate - 0.15, f"an evaluation loss under the entropy rate {rate:.3f}: {evals}"


def test_bf16_accumulation_stop_mid_epoch_and_bitwise_resume(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    steps = ["train.steps=40", "task.model=tiny", f"task.train_tokens={800 * 32 + 1}"]  # 50 steps an epoch
    rc, _, err = finish(subprocess.Popen(lm_cmd(ref, *steps, launcher=True), cwd=ROOT, env=clean_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True))
    assert rc == 0, err[-3000:]
    assert_no_loss_under_the_entropy_rate(ref)
    s = summary(ref)
    assert s["precision"] == "bf16" and s["world_size"] == 2 and s["ranks_in_sync"], s
    assert {"eval_loss", "eval_perplexity"} <= s.keys()
    assert abs(np.exp(s["eval_loss"]) / s["eval_perplexity"] - 1) < 1e-9
    train = [m for m in metrics(ref) if "loss" in m]
    assert train[-1]["tokens_per_s"] == train[-1]["samples_per_s"] * 32  # the task's unit: windows of 32 tokens

    proc = subprocess.Popen(lm_cmd(run, *steps, launcher=True), cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    stop_at(proc, run, 10)
    stopped = latest_state(run)
    assert 10 <= stopped["step"] < 40 and stopped["data"]["epoch"] == 0, stopped  # mid-epoch, wherever it lands
    rc, _, err = finish(subprocess.Popen(lm_cmd(run, *steps, launcher=True), cwd=ROOT, env=clean_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True))
    assert rc == 0, err[-3000:]
    assert_same_training(ref, run)
    assert summary(run)["eval_loss"] == s["eval_loss"]
