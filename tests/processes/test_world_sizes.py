"""Every shipped config at the world sizes users have, and every training command the docs show at the world
size it implies: a step's global batch splits evenly over the ranks (global / world size each), refused in
one line exactly where it does not. The launcher's dry run, composed in this process as the launcher does."""
from __future__ import annotations

import subprocess

from tests.conftest import GROUPNORM, PY, ROOT, assert_trained_alike, clean_env, latest_state, run_train
from train import config


def test_a_refused_world_is_one_line_exit_2_before_torchrun():
    proc = subprocess.run([PY, "-m", "train.launch", "--nproc-per-node=3", "--dry-run", "--", "--config",
                           "configs/default.yaml"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: train.global_batch_size=64 does not split evenly over 3 ranks (each rank takes an equal share of every "
        "step): run 2 or 4 ranks, or set train.global_batch_size=63 or 66 (a multiple of 3)"), proc.stderr


def test_a_share_that_micro_batches_do_not_divide_trains_as_the_whole_batch(tmp_path):
    """15 samples a step over 3 ranks: 5 each, in micro-batches of at most 3 (3 then 2), each micro-batch's
    loss weighted by its samples. The weights end as one process's with the whole batch of 15 in one pass
    (GroupNorm: no batch statistics), up to the rounding of another split. Weighted by micro-batch instead
    (1/2 each), the 2-sample micro-batches would count 1.5x: the weights move elsewhere."""
    assert config.load("configs/default.yaml", ["train.global_batch_size=15", "train.micro_batch_size=3"],
                       task=False).micro_batches(3) == [3, 2]
    whole, split = tmp_path / "whole", tmp_path / "split"
    batch = ["train.global_batch_size=15", "optim.warmup_steps=0"]
    run_train(whole, *GROUPNORM, *batch, "train.micro_batch_size=15")
    proc = run_train(split, *GROUPNORM, *batch, "train.micro_batch_size=3", nproc=3)
    assert "2 micro-batches of 3 and 2 samples per rank a step" in proc.stdout + proc.stderr
    assert_trained_alike(latest_state(whole)["model"], latest_state(split)["model"])
