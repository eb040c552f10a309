"""Configuration: every shipped file loads, overrides are typed, bad input exits 2 in one line."""
from __future__ import annotations

import subprocess

import pytest

from tests.conftest import PY, ROOT, clean_env


@pytest.mark.parametrize("overrides, message", [
    (["optim.lrr=0.1"], "unknown config key 'optim.lrr' (did you mean 'optim.lr'"),
    (["trian.steps=3"], "did you mean 'train.steps'"),
    (["train.steps=abc"], "train.steps: expected int, got str"),
    (["train.steps=1.5"], "train.steps: expected int, got float"),
    (["optim.lr=-0.1"], "optim.lr must be > 0"),
    (["optim.lr=inf"], "optim.lr must be a finite number, got inf"),
    (["optim.lr=.inf"], "optim.lr must be a finite number, got inf"),
    (["optim.lr=nan"], "optim.lr must be a finite number, got nan"),
    (["dist.timeout_s=1e999"], "dist.timeout_s must be a finite number, got 1e999"),
    (["log.wandb.mode=off"], "log.wandb.mode: 'off' is not one of offline, online, disabled (did you mean 'offline'?)"),
    (["log.progress_bar=no"], "log.progress_bar: 'no' is not one of auto, always, never"),
    (["train.precision=fp8"], "train.precision: 'fp8' is not one of fp32, bf16, fp16"),
    (["optim.fused=1"], "optim.fused: 1 is not one of auto, true, false"),
    (["optim.fused=yes please"], "optim.fused: 'yes please' is not one of auto, true, false"),
    (["optim.fused=true", "train.precision=fp16"], "torch's fused SGD updates its momentum on the steps fp16's loss "
                                                    "scaling skips"),
    (["task.model=resnet19"], "did you mean 'resnet18'"),
    (["train.micro_batch_size=0"], "train.micro_batch_size must be > 0"),
    (["checkpoint.keep=1"], "checkpoint.keep must be >= 2"),
    (["checkpoint.threads=0"], "checkpoint.threads must be >= 1"),
    (["task.data=cifar10"], "task.path is required"),
    (["train.steps"], "is not of the form key.sub=value"),
])
def test_bad_value_exits_2_with_one_line_and_writes_nothing(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    proc = subprocess.run([PY, "-m", "train", f"run.dir={run_dir}", *overrides], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_batch_must_divide_over_the_world_size(tmp_path):
    """A torchrun environment of 3 ranks with a global batch of 64 is refused before any I/O, naming the world
    sizes and batch sizes that work."""
    env = clean_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    proc = subprocess.run([PY, "-m", "train", f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "train.global_batch_size=64 does not split evenly over 3 ranks" in proc.stderr
    assert "run 2 or 4 ranks, or set train.global_batch_size=63 or 66" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_partial_launch_environment_is_named(tmp_path):
    env = clean_env(RANK="1", WORLD_SIZE="2")
    proc = subprocess.run([PY, "-m", "train", f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "incomplete torchrun environment" in proc.stderr and "LOCAL_RANK" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("entry", [["train", "--check"], ["train.launch", "--dry-run", "--"], ["train.doctor"]],
                         ids=lambda e: e[0])
def test_unreadable_config_file_exits_2_with_one_line(tmp_path, entry):
    """A file that is not UTF-8 text (a binary given by mistake) and a folder: one line naming the cause, exit 2.
    (A file the user may not read takes the same path; the tests run as root, who may read anything.)"""
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
    for path, message in [(binary, f"error: cannot read config file {binary}: not UTF-8 text (byte 0x80 at offset 8)"),
                          (tmp_path, f"error: config file {tmp_path} is a folder, not a file")]:
        proc = subprocess.run([PY, "-m", *entry, "--config", str(path)], cwd=ROOT, env=clean_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
