"""The built-in image task (its data, augmentation, batch norm, evaluation and stages) with its ResNet at a
quarter of the width: 0.7M parameters where ResNet-18 has 11M. The model most tests train (conftest.TINY).

What the tests prove (stops, resumes, restarts, hangs, launchers) is the trainer's and holds for any task; a
ResNet-18 step costs ~0.16 s of CPU on 2 ranks (mostly its parameters: gradients, all-reduce, optimizer, saves),
this one's a few milliseconds. The tests about the built-in model itself (tests/processes/test_golden.py,
test_training.py, the README's run) use `train.tasks.image` (conftest.RESNET).

`task.step_delay_s` sleeps that long in each micro-step: a run whose steps must last while a test acts on it
(a signal after step N, a kill mid-run) gets the wall time without using the CPU the other tests need;
`task.eval_delay_s` does the same for each evaluation batch (a stop during a long evaluation).

`task.start_gate` and `task.step_gate` hold a run at one point until a test lets it go, whatever the machine's
speed: a path; each rank creates `<path>.<rank>` on reaching it (its worker start-up, in datasets(); its micro-steps,
in loss()) and waits there until `<path>` exists, or a stop signal reached it (`gate_reached` below).
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from train.config import ConfigError
from train.stops import signals
from train.tasks.image import ImageClassification

WIDTHS = (16, 32, 64, 128)  # torchvision's are 64, 128, 256, 512
BLOCKS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}  # task.model: torchvision's BasicBlocks per stage


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock, the same modules under the same names: written out here because
    importing torchvision costs each process about a second of CPU (it imports torch._dynamo), and the suite
    starts hundreds of processes that train this model."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                 norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class SmallResNet(nn.Module):
    """torchvision's ResNet (CIFAR stem, layer1..layer4 of BasicBlocks, pooling, fc) at a quarter of the width:
    the same parameter names, so that a checkpoint of another task.model misses the same tensors."""

    def __init__(self, blocks: tuple[int, ...], num_classes: int, norm_layer=None):
        super().__init__()
        norm = norm_layer or nn.BatchNorm2d
        self.conv1 = nn.Conv2d(3, WIDTHS[0], kernel_size=3, stride=1, padding=1, bias=False)  # the CIFAR stem
        self.bn1 = norm(WIDTHS[0])
        self.relu = nn.ReLU(inplace=True)
        stages, width = [], WIDTHS[0]
        for i, (out, n) in enumerate(zip(WIDTHS, blocks, strict=True)):
            stride = 1 if i == 0 else 2
            down = None
            if stride != 1 or width != out:
                down = nn.Sequential(nn.Conv2d(width, out, kernel_size=1, stride=stride, bias=False), norm(out))
            stage = [BasicBlock(width, out, stride, down, norm_layer=norm)]
            stage += [BasicBlock(out, out, norm_layer=norm) for _ in range(n - 1)]
            stages.append(nn.Sequential(*stage))
            width = out
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


class SmallImages(ImageClassification):
    @dataclass
    class Config(ImageClassification.Config):
        step_delay_s: float = 0.0  # a sleep in each micro-step (see the module's docstring)
        eval_delay_s: float = 0.0  # a sleep in each evaluation batch
        start_gate: str = ""  # a path: datasets() waits until it exists (see the module's docstring)
        step_gate: str = ""  # the same in each micro-step

    # the tests' pacing and gates: no change of what is trained
    relaunch = ImageClassification.relaunch | {"step_delay_s": "applied", "eval_delay_s": "applied",
                                               "start_gate": "applied", "step_gate": "applied"}

    def check(self) -> None:
        super().check()
        if self.cfg.model not in BLOCKS:
            raise ConfigError(f"task.model: {self.cfg.model} is not one of {', '.join(BLOCKS)} (tests/small_task.py)")

    def model(self) -> nn.Module:
        norm = None
        if self.cfg.norm == "group":
            def norm(channels: int) -> nn.Module:
                return nn.GroupNorm(min(32, channels), channels)
        return SmallResNet(BLOCKS[self.cfg.model], getattr(self, "num_classes", self.cfg.num_classes), norm)

    def datasets(self):
        _wait_at(self.cfg.start_gate)
        return super().datasets()

    def loss(self, model: nn.Module, batch):
        _wait_at(self.cfg.step_gate)
        if self.cfg.step_delay_s:
            time.sleep(self.cfg.step_delay_s)
        return super().loss(model, batch)

    def eval_step(self, model: nn.Module, batch) -> dict:
        if self.cfg.eval_delay_s:
            time.sleep(self.cfg.eval_delay_s)
        return super().eval_step(model, batch)


def _wait_at(gate: str) -> None:
    """Say that this rank has reached `gate`, then wait until a test opens it or a stop signal reaches this rank
    (once the trainer's handler takes them: from STARTED on; before it, the signal ends the process here)."""
    if not gate or Path(gate).exists():
        return
    Path(f"{gate}.{os.environ.get('RANK', '0')}").touch()
    while not Path(gate).exists() and not signals.received():
        time.sleep(0.05)


def gate_reached(gate: Path, ranks: int) -> bool:
    """Whether every one of `ranks` ranks waits at `gate` (for tests.procs.wait_for)."""
    return all(Path(f"{gate}.{rank}").exists() for rank in range(ranks))
