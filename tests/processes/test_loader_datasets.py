"""Loader workers take any data set a DataLoader takes (issue 49): thousands of separate tensors, dict records,
numpy arrays (tests/separate_samples_task.py), with 0, 1 and 2 workers, the same batches whatever their number,
and a run stopped mid-way resumes bit for bit. A data set's few big tensors are still shared, not copied."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, ROOT, assert_same_training, clean_env, latest_state, summary
from tests.procs import finish, signal_at_step
from train import config
from train.parallel.data import loaders
from train.task import default_collate

TASK = f"task.name={ROOT / 'tests' / 'separate_samples_task.py'}:SeparateSamples"
# 5000 samples (10,000 tensors), 16 a step over 2 ranks: 312 steps an epoch. Tiny steps: the loader workers'
# starts (each receives the 10,000 tensors) are most of a run's time.
RUN = ["--config", "configs/default.yaml", TASK, "train.steps=10", "train.global_batch_size=16",
       "train.micro_batch_size=8", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
       "optim.warmup_steps=2", "log.wandb.mode=disabled", "log.report=false", "data.num_workers=2"]


def launch(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [PY, "-m", "train.launch", "--nproc-per-node=2", "--", *RUN, f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def test_ten_thousand_separate_tensors_train_with_two_workers_per_rank_and_resume_bitwise(tmp_path):
    """Each of the 2 ranks starts 2 training workers, each of which receives the
    10,000 tensors. A SIGTERM mid-run, then the same command: the losses and weights of the uninterrupted run."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    rc, out, err = finish(launch(ref))
    assert rc == 0, err[-3000:]
    assert summary(ref)["steps"] == 10

    proc = launch(run, "task.step_delay_s=0.2")  # paced (no number changes): steps 4 to 9 take a second at least
    paused_at = signal_at_step(proc, run, 4, ranks=2)
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    stopped = latest_state(run)["step"]
    assert 4 <= paused_at <= stopped <= paused_at + 1 < 10, (paused_at, stopped)
    rc, out, err = finish(launch(run))
    assert rc == 0, err[-3000:]
    assert_same_training(ref, run)  # the loss of every step, weights and optimizer state, bit for bit


@pytest.mark.parametrize("storage", ["tensors", "records", "numpy"])
def test_a_data_set_of_separate_samples_gives_the_same_batches_with_0_1_and_2_workers(storage):
    """The loaders a rank makes (train.parallel.data.loaders), 6000 samples: the first batches of the training
    stream and the whole evaluation, with 1 and 2 workers, equal those read in the training process."""
    overrides = [TASK, f"task.storage={storage}", "task.train_samples=6000", "task.eval_samples=40",
                 "train.micro_batch_size=8", "data.persistent_workers=false"]
    seen = {}
    for workers in (0, 1, 2):
        cfg = config.load("configs/default.yaml", [*overrides, f"data.num_workers={workers}"])
        task = cfg.task_class(cfg.task, cfg.seed)
        train_set, eval_set = task.datasets()
        stream, evaluation = loaders(cfg, train_set, eval_set, rank=0, world_size=1, cuda=False,
                                     collate=default_collate)
        batches = iter(stream)
        seen[workers] = [next(batches) for _ in range(5)], list(evaluation)
        del batches, stream, evaluation
    for workers in (1, 2):
        for a, b in zip(seen[0], seen[workers], strict=True):
            assert len(a) == len(b)
            for (xa, ya), (xb, yb) in zip(a, b, strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb), f"{workers} worker(s) read other batches"


class Indexed(torch.utils.data.Dataset):
    def __init__(self, *parts):
        self.parts = parts

    def __len__(self) -> int:
        return len(self.parts[-1])

    def __getitem__(self, i: int):
        return self.parts[0][i % len(self.parts[0])], self.parts[-1][i]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_big_tensors_are_still_shared_and_thousands_of_small_ones_hold_one_descriptor():
    """A data set of one big tensor and 5000 small ones: the big one goes into shared memory once, as before
    (the workers map it: no copy), the small ones are packed into one block: the training process holds a few
    descriptors for the data set, not one per tensor (its open-file limit)."""
    big = torch.randn(4096, 256)  # 4 MiB
    small = [torch.full((3,), float(i)) for i in range(5000)]
    cfg = config.load("configs/default.yaml", ["train.micro_batch_size=4", "data.num_workers=1"])
    before = _open_fds()
    _, evaluation = loaders(cfg, Indexed(big, small), Indexed(big, small), rank=0, world_size=1, cuda=False)
    batch = next(iter(evaluation))
    assert torch.equal(batch[0], big[:4]) and torch.equal(batch[1], torch.stack(small[:4]))
    assert big.is_shared(), "the big tensor was copied to the worker, not shared"
    assert not small[0].is_shared()
    assert _open_fds() - before < 20, (before, _open_fds())
