"""The language model through the trainer, on real ranks: bf16 with accumulation, a stop and a bitwise resume
mid-epoch, the windows read across world-size changes, and a malformed shard as one line."""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np

from tests.conftest import PY, ROOT, after_import, assert_same_training, clean_env, latest_state, metrics, summary
from tests.procs import finish, logged_steps, wait_for
from tests.test_promises import RECORD_READS

# configs/gpt.yaml shrunk: windows of 32 tokens, 64 of them (4 steps of 16 an epoch), 2 micro-steps of 4 a rank
# on 2 ranks (accumulation), bf16 autocast.
LM = ["--config", "configs/gpt.yaml", "task.seq_len=32", f"task.train_tokens={64 * 32 + 1}", "task.eval_tokens=1025",
      "data.num_workers=0", "train.global_batch_size=16", "train.micro_batch_size=4", "train.precision=bf16",
      "train.log_every=5", "train.eval_every=0", "checkpoint.every=0", "optim.warmup_steps=2",
      "log.wandb.mode=disabled", "log.report=false"]


def lm_cmd(run_dir: Path, *overrides: str, nproc: int = 2, launcher: bool = False) -> list[str]:
    if launcher:
        return [PY, "-m", "train.launch", f"--nproc-per-node={nproc}", "--", *LM, f"run.dir={run_dir}", *overrides]
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "train", *LM,
            f"run.dir={run_dir}", *overrides]


def run_lm(run_dir: Path, *overrides: str, nproc: int = 2, env: dict | None = None, expect: int = 0):
    proc = subprocess.run(lm_cmd(run_dir, *overrides, nproc=nproc), cwd=ROOT, env=env or clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_bf16_accumulation_stop_mid_epoch_and_bitwise_resume(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    steps = ["train.steps=150", "task.model=tiny"]
    rc, _, err = finish(subprocess.Popen(lm_cmd(ref, *steps, launcher=True), cwd=ROOT, env=clean_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True))
    assert rc == 0, err[-3000:]
    s = summary(ref)
    assert s["precision"] == "bf16" and s["world_size"] == 2 and s["ranks_in_sync"], s
    assert {"eval_loss", "eval_perplexity"} <= s.keys()
    assert abs(np.exp(s["eval_loss"]) / s["eval_perplexity"] - 1) < 1e-9
    train = [m for m in metrics(ref) if "loss" in m]
    assert train[-1]["tokens_per_s"] == train[-1]["samples_per_s"] * 32  # the task's unit: windows of 32 tokens

    proc = subprocess.Popen(lm_cmd(run, *steps, launcher=True), cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: proc.poll() is not None or any(st >= 30 for st in logged_steps(run)), 180, "step 30")
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 75, err[-3000:]
    stopped = latest_state(run)
    assert 30 <= stopped["step"] < 150 and stopped["data"]["samples_in_epoch"] % 64, stopped["data"]  # mid-epoch
    rc, _, err = finish(subprocess.Popen(lm_cmd(run, *steps, launcher=True), cwd=ROOT, env=clean_env(),
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True))
    assert rc == 0, err[-3000:]
    assert_same_training(ref, run)
    assert summary(run)["eval_loss"] == s["eval_loss"]


def _reads(folder: Path) -> dict[int, list[int]]:
    by_epoch: dict[int, list[int]] = {}
    for path in folder.iterdir():
        for line in path.read_text().splitlines():
            _, epoch, index = map(int, line.split())
            by_epoch.setdefault(epoch, []).append(index)
    return by_epoch


def test_a_world_size_change_reads_exactly_the_windows_of_an_uninterrupted_run(tmp_path):
    """2 -> 1 -> 2 ranks across epoch boundaries (4 steps an epoch): the windows read in each epoch are
    those of one uninterrupted 2-rank run, none twice."""
    env = after_import(tmp_path, "train.data", RECORD_READS)
    ref_reads, seg_reads = tmp_path / "ref-reads", tmp_path / "seg-reads"
    ref_reads.mkdir()
    seg_reads.mkdir()
    log = ["train.log_every=1"]
    run_lm(tmp_path / "ref", "train.steps=14", *log, env=env | {"READS_DIR": str(ref_reads)})
    for world, steps in ((2, 3), (1, 9), (2, 14)):
        run_lm(tmp_path / "seg", f"train.steps={steps}", *log, nproc=world, env=env | {"READS_DIR": str(seg_reads)})
    ref, seg = _reads(ref_reads), _reads(seg_reads)
    assert sorted(ref) == sorted(seg) == [0, 1, 2, 3], (sorted(ref), sorted(seg))
    for epoch in ref:
        assert not [i for i, n in Counter(seg[epoch]).items() if n > 1], f"epoch {epoch}: a window read twice"
        assert sorted(seg[epoch]) == sorted(ref[epoch]), f"epoch {epoch}: other windows than the uninterrupted run"
    assert len(ref[3]) == 2 * 16  # 14 steps: 3 whole epochs and 2 steps of the fourth
    ref_loss = {m["step"]: m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m}
    seg_loss = {m["step"]: m["loss"] for m in metrics(tmp_path / "seg") if "loss" in m}
    assert ref_loss.keys() == seg_loss.keys() == set(range(1, 15))
    # Bitwise while the world size is the uninterrupted run's; after a change only the same windows (a step
    # of 4 micro-batches on 1 rank rounds differently in bf16, and AdamW carries it on).
    assert [seg_loss[s] for s in (1, 2, 3)] == [ref_loss[s] for s in (1, 2, 3)]


def test_a_malformed_shard_is_one_line_naming_it(tmp_path):
    data = tmp_path / "shards"
    data.mkdir()
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, 4096]
    for split in ("train", "val"):
        tokens = np.arange(4096, dtype=np.uint16) % 256
        (data / f"corpus_{split}_000000.bin").write_bytes(header.tobytes() + tokens.tobytes())
    bad = data / "corpus_val_000000.bin"
    bad.write_bytes(bad.read_bytes()[:-100])  # truncated: fewer tokens than its header says
    run_dir = tmp_path / "run"
    proc = subprocess.run(lm_cmd(run_dir, f"task.data={data}", "train.steps=2", launcher=True), cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]  # the launcher's own
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]  # a usage error: once, not retried
    assert str(bad) in lines[0] and "truncated" in lines[0] and "not retried" in lines[0], lines[0]
    assert not (run_dir / "checkpoints").exists()
