"""Configuration: every shipped file loads, overrides are typed, bad input exits 2 in one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PY, ROOT, clean_env
from train import config
from train.config import ConfigError
from train.tasks.image import RESNETS


@pytest.mark.parametrize("path", sorted([*(ROOT / "configs").glob("*.yaml"), *(ROOT / "examples").glob("*.yaml")]),
                         ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path):
    cfg = config.load(str(path), [])
    assert cfg.train.steps > 0 and cfg.task_name.split(":")[-1] in type(cfg.task).__qualname__
    if cfg.task_name == "train.tasks.image:ImageClassification":
        assert cfg.task.model in RESNETS
    # The resolved config (what config.yaml and every checkpoint hold) loads back to the same config.
    again = config.from_dict(config.to_dict(cfg))
    assert config.to_dict(again) == config.to_dict(cfg) and again.task_class is cfg.task_class


def test_overrides_are_typed():
    cfg = config.load("configs/default.yaml", ["optim.lr=1e-3", "train.steps=5", "train.precision=bf16",
                                               "checkpoint.async=true", "run.name=123", "dist.timeout_s=30"])
    assert cfg.optim.lr == 0.001 and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 5 and isinstance(cfg.train.steps, int)
    assert cfg.train.precision == "bf16"
    assert cfg.checkpoint.async_ is True
    assert cfg.run.name == "123" and cfg.run_dir == Path("runs/123")
    assert cfg.dist.timeout_s == 30.0 and isinstance(cfg.dist.timeout_s, float)


def test_override_of_a_text_key_keeps_the_text_as_typed():
    """YAML 1.1 reads 007 as 7, on and no as booleans, 2024-01-01 as a date: a key of type str (or of a choice of
    strings) takes the text instead. Keys of other types still read it as YAML."""
    cfg = config.load("configs/default.yaml", ["run.name=007", "log.wandb.group=on", "log.wandb.tags=[a,b]",
                                               "log.wandb.entity=2024-01-01", "checkpoint.async=on",
                                               "optim.fused=true"])
    assert cfg.run.name == "007" and cfg.run_dir == Path("runs/007")
    assert cfg.log.wandb.group == "on" and cfg.log.wandb.tags == "[a,b]" and cfg.log.wandb.entity == "2024-01-01"
    assert cfg.checkpoint.async_ is True and cfg.optim.fused is True


def test_precedence_defaults_then_yaml_then_cli(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("train:\n  steps: 7\n  log_every: 3\noptim:\n  lr: 0.5\n")
    cfg = config.load(str(f), ["train.steps=9"])
    assert cfg.train.steps == 9  # CLI beats YAML
    assert cfg.train.log_every == 3 and cfg.optim.lr == 0.5  # YAML beats defaults
    assert cfg.train.micro_batch_size == config.TrainConfig().micro_batch_size  # defaults fill the rest


def test_config_round_trips_through_dict():
    cfg = config.load("configs/default.yaml", ["checkpoint.async=true"])
    assert config.from_dict(config.to_dict(cfg)) == cfg


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


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        config.load(str(tmp_path / "nope.yaml"), [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1,\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        config.load(str(bad), [])
    nested = tmp_path / "nested.yaml"
    nested.write_text("train: 3\n")
    with pytest.raises(ConfigError, match="train: expected a mapping"):
        config.load(str(nested), [])


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


def test_config_file_the_user_may_not_read(tmp_path, monkeypatch):
    """As root (the tests) every file is readable: a PermissionError stands in for a mode-600 file of another user."""
    f = tmp_path / "secret.yaml"
    f.write_text("train:\n  steps: 3\n")
    original = Path.read_text

    def read_text(self, *args, **kwargs):
        if self == f:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(ConfigError, match=f"cannot read config file {f}: permission denied for uid .*: make it "
                                          r"readable \(chmod a\+r\)"):
        config.load(str(f), [])


def test_duplicate_key_in_config_file_is_refused(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("optim:\n  lr: 0.1\ntrain:\n  steps: 3\noptim:\n  lr: 0.5\n")
    with pytest.raises(ConfigError, match=r"dup.yaml line 5: invalid YAML \(key 'optim' given twice, first on line 1"):
        config.load(str(f), [])
    f.write_text("optim:\n  lr: 0.1\n  momentum: 0.8\n  lr: 0.5\n")
    with pytest.raises(ConfigError, match=r"line 4: invalid YAML \(key 'lr' given twice, first on line 2"):
        config.load(str(f), [])


def test_slurm_step_environment_is_detected():
    from train.parallel import distributed

    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
           "SLURM_JOB_ID": "1234", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "n1"}
    d = distributed.detect(env)
    assert (d.rank, d.local_rank, d.world_size, d.local_world_size, d.launcher) == (3, 1, 4, 2, "slurm")
    assert d.nodes == 2 and d.master_addr == "n1" and d.master_port == 20000 + 1234
    # A batch script without a step is not a launch: a single process.
    assert distributed.detect({"SLURM_JOB_ID": "1234", "SLURM_PROCID": "0"}).launcher == "single"
