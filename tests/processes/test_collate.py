"""A task's own batching (Task.collate): token sequences of different lengths (tests/varlen_task.py), padded and
masked by the task's collate for training and evaluation, stopped by SIGTERM to the launcher and resumed bit
for bit under DDP and FSDP; without a collate, one line naming the key that differs in size, exit 2, whether
the default collate failed in a loader worker or in the training process."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT, assert_same_training, clean_env, latest_state, metrics, summary
from tests.procs import finish, signal_at_step

# 256 sequences of 2..12 tokens cropped at random at every read, 16 steps an epoch (2 ranks x 2 micro-steps of 4),
# dropout; 41 evaluation sequences: 21 on rank 0, 20 on rank 1 (a last batch of 1 on one rank only). A learning
# rate of 0.3 learns the task in 40 steps (measured: eval accuracy 0.98 at the end, 0.93 at step 16; 0.1 needed
# about 80 steps to pass 0.8).
VARLEN = ["task.name=tests/varlen_task.py:PaddedSequences", "task.eval_samples=41", "train.steps=40",
          "train.global_batch_size=16", "train.micro_batch_size=4", "train.log_every=1", "train.eval_every=12",
          "checkpoint.every=0", "optim.warmup_steps=2", "optim.lr=0.3", "log.wandb.mode=disabled",
          "log.report=false"]


def launch(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [PY, "-m", "train.launch", "--nproc-per-node=2", "--", *VARLEN, f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def evaluations(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "time"} for m in metrics(run_dir) if "eval_loss" in m]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The run both strategies' stopped and resumed runs must end as: DDP in the training process, 40 steps. The
    data do not depend on the loader workers (each sample is seeded by its epoch and index), and FSDP on 2 ranks
    without clipping adds what DDP does (tests/processes/test_fsdp.py): one run serves both."""
    ref = tmp_path_factory.mktemp("collate") / "ref"
    rc, out, err = finish(launch(ref, "dist.strategy=ddp", "data.num_workers=0"))
    assert rc == 0, err[-3000:]
    return ref


@pytest.mark.parametrize("strategy, workers", [("ddp", 1), ("fsdp", 0)])
def test_a_task_of_its_own_collate_stops_and_resumes_bitwise(tmp_path, uninterrupted, strategy, workers):
    """DDP with a loader worker per rank (the task's collate runs there, the task pickled to it), FSDP in the
    training process (its rank with fewer evaluation batches repeats its last one for the all-gathers)."""
    ref, run = uninterrupted, tmp_path / "run"
    extra = [f"dist.strategy={strategy}", f"data.num_workers={workers}"]
    s = summary(ref)
    assert s["steps"] == 40 and s["ranks_in_sync"] and s["eval_accuracy"] > 0.8, s  # it learns from padded batches
    assert [e["step"] for e in evaluations(ref)] == [12, 24, 36, 40]

    proc = launch(run, *extra)
    paused_at = signal_at_step(proc, run, 14, ranks=2)  # SIGTERM to the launcher, past the first evaluation
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    stopped = latest_state(run)["step"]
    assert 14 <= paused_at <= stopped <= paused_at + 1 < 40, (paused_at, stopped)
    rc, out, err = finish(launch(run, *extra))
    assert rc == 0, err[-3000:]

    assert_same_training(ref, run)  # weights, optimizer state and the loss of every step, bit for bit
    assert evaluations(run) == evaluations(ref)


@pytest.mark.parametrize("workers", [0, 1])
def test_items_the_default_collate_cannot_stack_are_one_line_naming_the_key(tmp_path, workers):
    """The task without its collate: the default collate fails in the training process (num_workers=0) or in a
    loader worker, whose exception torch re-raises in the training process wrapped in the worker's traceback."""
    proc = launch(tmp_path / "run", "task.name=tests/varlen_task.py:Sequences", f"data.num_workers={workers}")
    rc, out, err = finish(proc, timeout=180)
    says = "task tests/varlen_task.py:Sequences: the items of a batch differ in size at key 'tokens' (shape ("
    advice = "define collate(self, items) in the task to pad, pack or mask them"
    last = err.strip().splitlines()[-1]
    assert rc == 2, err[-3000:]
    assert last.startswith(f"error: {says}") and advice in last and last.endswith("(found by the workers; not retried)")
    # Said once, in one line, the launcher's (each rank's own is in its log file); nothing else is said of it.
    said = [line for line in (out + err).splitlines() if says in line]
    assert said == [last], err[-3000:]
    assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
