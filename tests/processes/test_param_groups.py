"""How a task's parameters train, on 2 gloo ranks under DDP and FSDP (tests/groups_task.py: its head in a group at
3x the rate, its stem convolution frozen): the frozen parameter keeps its initial values and has no optimizer state,
metrics.jsonl holds the base rate and the head's; a relaunch after the task's groups changed in its code applies
them from the resumed step (a parameter trained again starts afresh), and a finished run refuses them in one line.
The groups' building and their mistakes: tests/quick/test_param_groups.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ROOT, latest_state, metrics, run_train
from train import optim
from train.config import OptimConfig

FROZEN = 'patterns = [p for p in self.cfg.freeze.split(",") if p]'  # the task's code, edited between launches
HEAD = '["fc.*"]'


def _initial(task):
    """The model as the trainer initializes it (torch's RNG seeded with the run's seed, 0)."""
    torch.manual_seed(0)
    cls = task.GroupedImages
    return cls(cls.Config(image_size=16, train_samples=256, eval_samples=64), 0).model()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_frozen_parameter_and_a_head_group_then_a_relaunch_with_other_groups(tmp_path, strategy):
    from tests import groups_task

    task = tmp_path / "my_task.py"  # the user's file, which they edit between launches
    text = (ROOT / "tests" / "groups_task.py").read_text()
    assert FROZEN in text and HEAD in text
    task.write_text(text)
    run = tmp_path / "run"
    args = [f"task.name={task}:GroupedImages", f"dist.strategy={strategy}", "optim.lr=0.02", "train.steps=4"]
    proc = run_train(run, *args, nproc=2)
    assert ("parameter groups: default (59 tensors, lr x1, weight decay 0.0005), head (2 tensors, lr x3, weight "
            "decay 0), frozen (1: conv1.weight)") in proc.stdout, proc.stdout
    logged = [m for m in metrics(run) if "loss" in m]
    schedule = OptimConfig(lr=0.02, warmup_steps=2)
    assert [m["lr"] for m in logged] == [optim.lr_at(step, 4, schedule) for step in range(4)]  # the base rate
    assert [m["lr_head"] for m in logged] == [m["lr"] * 3 for m in logged]
    init, state = _initial(groups_task), latest_state(run)
    assert torch.equal(state["model"]["conv1.weight"], init.conv1.weight)  # frozen: as initialized
    assert not torch.equal(state["model"]["fc.weight"], init.fc.weight)
    moments = state["optimizer"]["state"]
    assert "conv1.weight" not in moments and {"fc.weight", "layer1.0.conv1.weight"} <= set(moments), moments.keys()

    # The task's code changes: fc.bias frozen instead of conv1.weight, the last block joins the head's group
    task.write_text(text.replace(FROZEN, 'patterns = ["fc.bias"]').replace(HEAD, '["fc.*", "layer4.1.*"]'))
    proc = run_train(run, *args, "train.steps=6", nproc=2)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("relaunch with parameters layer4.1.conv1.weight and 5 more group default -> group head, parameter fc.bias "
            "group head -> frozen, parameter conv1.weight frozen -> group default: applied from step 4") in proc.stdout
    checkpoint = run / "checkpoints" / "step_00000004"
    assert (f"optimizer state starts afresh for conv1.weight: frozen in {checkpoint}, which holds none"
            in proc.stdout), proc.stdout
    after = latest_state(run)
    assert after["step"] == 6
    assert torch.equal(after["model"]["fc.bias"], state["model"]["fc.bias"])  # frozen from step 4 on
    assert not torch.equal(after["model"]["conv1.weight"], init.conv1.weight)  # trained again
    moments = after["optimizer"]["state"]
    assert "fc.bias" not in moments and "conv1.weight" in moments, moments.keys()
    if strategy == "fsdp":
        return
    # The groups changed back on the finished run: no step is left to apply them to
    task.write_text(text)
    proc = run_train(run, *args, "train.steps=6", expect=2)
    assert proc.stderr.strip() == (
        f"error: run {run} is finished at step 6: parameter conv1.weight group default -> frozen, parameters "
        f"layer4.1.conv1.weight and 5 more group head -> group default, parameter fc.bias frozen -> group head would "
        f"need training and no step is left; train more steps (train.steps above 6) or start a new run with another "
        f"run.name"), proc.stderr


def test_other_groups_load_where_the_optimizer_holds_no_state(tmp_path):
    """SGD without momentum keeps no state: torch's loader then takes the checkpoint's groups as they are, which no
    longer fit this launch's (a ValueError, and no checkpoint loads); the trainer gives it this launch's."""
    task = tmp_path / "my_task.py"
    text = (ROOT / "tests" / "groups_task.py").read_text()
    task.write_text(text)
    run = tmp_path / "run"
    args = [f"task.name={task}:GroupedImages", "optim.momentum=0"]
    run_train(run, *args, "train.steps=2")
    task.write_text(text.replace(HEAD, '["fc.*", "layer4.*"]'))
    proc = run_train(run, *args, "train.steps=3")
    assert ("relaunch with parameters layer4.0.conv1.weight and 14 more group default -> group head: applied from "
            "step 2") in proc.stdout, proc.stdout
