"""Configuration: every shipped file loads, overrides are typed, bad input is one line."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
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
