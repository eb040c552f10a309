"""GPUs as schedulers hand them out: the device each rank uses, and allocated GPUs that do not work.

No GPU here: what a CPU machine can show (the environment variables a scheduler sets, a real run)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import clean_env, run_train


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows a machine where CUDA does not work")
@pytest.mark.parametrize("allocation", ["CUDA_VISIBLE_DEVICES=0", "SLURM_GPUS_ON_NODE=1",
                                        "NVIDIA_VISIBLE_DEVICES=GPU-1"])
def test_allocated_gpus_that_cuda_cannot_use_fail_fast_in_one_line(tmp_path, allocation):
    name, value = allocation.split("=")
    proc = run_train(tmp_path, expect=2, env=clean_env(**{name: value}))
    lines = proc.stderr.strip().splitlines()
    start = f"error: GPUs were allocated ({allocation}) but CUDA is not usable"
    assert len(lines) == 1 and lines[0].startswith(start), proc.stderr
    assert "needs NVIDIA driver >= 580" in lines[0] and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("nvidia", ["void", "all"])  # all: the image's default, which asks, grants nothing
def test_no_allocation_trains_on_cpu(tmp_path, nvidia):
    run_train(tmp_path, "train.steps=2", env=clean_env(CUDA_VISIBLE_DEVICES="", NVIDIA_VISIBLE_DEVICES=nvidia,
                                                       SLURM_GPUS_ON_NODE="0"))
