"""An old checkpoint's class count is read from its weights."""
from __future__ import annotations

import torch

from train.checkpoint import convert


def test_the_class_count_of_an_old_checkpoint_is_read_from_its_weights():
    """Before the task interface, cifar10 and imagefolder runs counted their classes: data.num_classes (the
    built-in data's) was not the model's."""
    old = {"data": {"name": "imagefolder", "path": "/data/pets", "num_classes": 10},
           "model": {"name": "resnet18", "sync_bn": True}, "train": {"steps": 9}}
    new = convert._today_config(old, {"fc.weight": torch.zeros(37, 512)})
    assert new == {"task": {"name": convert.OLD_TASK, "data": "imagefolder", "path": "/data/pets",
                            "num_classes": 37, "model": "resnet18"}, "dist": {"sync_bn": True},
                   "train": {"steps": 9}}
