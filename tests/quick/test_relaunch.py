"""The relaunch rules (train/relaunch.py): one rule a key, every key of the built-in tasks ruled, and the check a
launch makes against a run's record before anything is queued."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from tests.conftest import TINY
from train import config, relaunch
from train.config import ConfigError
from train.reference import TASKS
from train.task_loader import load_class


def _cfg(tmp_path, *overrides: str) -> config.Config:
    return config.load("configs/default.yaml", [*TINY, f"run.dir={tmp_path / 'run'}", *overrides])


def _record(tmp_path, cfg: config.Config, finished_at: int | None = None, step: int = 6) -> None:
    """A run directory as a launch leaves it: config.yaml, a complete checkpoint of `step`, summary.json if it
    finished."""
    run = cfg.run_dir
    (run / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    (run / "checkpoints" / f"step_{step:08d}" / "manifest.json").write_text("{}")
    (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict(cfg)))
    if finished_at is not None:
        (run / "summary.json").write_text(json.dumps({"steps": finished_at}))


@pytest.mark.parametrize("spec", [*TASKS, "examples/regression.py:Regression"])
def test_every_key_of_the_built_in_tasks_and_the_example_has_its_rule(spec):
    cls = load_class(spec)
    keys = {f.name for f in dataclasses.fields(cls.Config)}
    assert set(cls.relaunch) == keys, (keys - set(cls.relaunch), set(cls.relaunch) - keys)
    assert set(cls.relaunch.values()) <= set(relaunch.RULES)


def test_each_change_takes_its_keys_rule(tmp_path):
    before = _cfg(tmp_path)
    after = _cfg(tmp_path, "data.num_workers=1", "optim.lr=0.05", "task.train_samples=128", "task.num_classes=4",
                 "seed=7", "run.name=other")
    found = {c.key: c.rule for c in relaunch.changes(config.to_dict(before), after)}
    assert found == {"data.num_workers": "applied", "optim.lr": "training", "task.train_samples": "data",
                     "task.num_classes": "refused", "seed": "refused"}  # run.* names the run: no change of it


def test_a_key_the_record_lacks_compares_as_its_default(tmp_path):
    cfg = _cfg(tmp_path)
    record = config.to_dict(cfg)
    del record["train"]["grad_clip"], record["task"]["augment"]  # a run of a release without these keys
    assert relaunch.changes(record, cfg) == []
    record["optim"]["weight_decay"] = 0.01
    assert [str(c) for c in relaunch.changes(record, cfg)] == ["optim.weight_decay 0.01 -> 0.0005"]


def test_a_task_key_the_task_does_not_rule_is_refused(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "task.step_delay_s=0.1")
    monkeypatch.setattr(cfg.task_class, "relaunch", {})
    (change,) = relaunch.changes(config.to_dict(_cfg(tmp_path)), cfg)
    assert change.rule == "refused" and "Task.relaunch" in change.why


def test_a_relaunch_that_changes_the_model_is_refused_before_it_is_queued(tmp_path):
    _record(tmp_path, _cfg(tmp_path))
    with pytest.raises(ConfigError) as e:
        relaunch.check_record(_cfg(tmp_path, "task.num_classes=4"))
    run = tmp_path / "run"
    assert str(e.value) == (f"relaunch of {run} with task.num_classes 10 -> 4 refused; start a new run with another "
                            f"run.name, or relaunch with the run's own value (task.num_classes=10)")
    relaunch.check_record(_cfg(tmp_path, "task.num_classes=4", f"run.dir={tmp_path / 'new'}"))  # a new run: fine
    relaunch.check_record(_cfg(tmp_path, "data.num_workers=1", "optim.lr=0.05"))  # applied, from the resumed step


def test_a_finished_run_refuses_a_change_that_needs_training_and_takes_one_that_does_not(tmp_path):
    _record(tmp_path, _cfg(tmp_path), finished_at=6)
    with pytest.raises(ConfigError) as e:
        relaunch.check_record(_cfg(tmp_path, "task.train_samples=128"))
    assert str(e.value) == (f"run {tmp_path / 'run'} is finished at step 6: task.train_samples 256 -> 128 would need "
                            f"training and no step is left; train more steps (train.steps above 6) or start a new "
                            f"run with another run.name")
    relaunch.check_record(_cfg(tmp_path, "task.train_samples=128", "train.steps=8"))  # steps left: the new data
    relaunch.check_record(_cfg(tmp_path, "data.num_workers=1"))  # nothing to train: "already complete"


def test_a_run_without_checkpoints_or_a_fresh_start_is_no_relaunch(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(cfg)))  # started, never saved
    relaunch.check_record(_cfg(tmp_path, "task.num_classes=4"))
