"""tests/small_task.py's ResNet with its head (fc) in a group of its own and some parameters frozen: how a task says
how its parameters train (Task.param_groups, requires_grad=False), for tests/processes/test_param_groups.py."""

import fnmatch
from dataclasses import dataclass

import torch.nn as nn

from tests.small_task import SmallImages


class GroupedImages(SmallImages):
    @dataclass
    class Config(SmallImages.Config):
        head_lr_scale: float = 3.0  # the head's rate: the schedule's times this; 0: no head group
        head_weight_decay: float = 0.0  # the head's matrix's weight decay
        freeze: str = "conv1.weight"  # names or fnmatch patterns, comma-separated: frozen in model()

    relaunch = SmallImages.relaunch | {"head_lr_scale": "training", "head_weight_decay": "training",
                                       "freeze": "training"}

    def model(self) -> nn.Module:
        model = super().model()
        patterns = [p for p in self.cfg.freeze.split(",") if p]
        for name, param in model.named_parameters():
            if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                param.requires_grad_(False)
        return model

    def param_groups(self, model: nn.Module) -> list[dict]:
        if not self.cfg.head_lr_scale:
            return []
        return [{"name": "head", "params": ["fc.*"], "lr_scale": self.cfg.head_lr_scale,
                 "weight_decay": self.cfg.head_weight_decay}]
