"""A task written as a user writes one: an MLP that learns a smooth function of 8 inputs.

Train it with every launcher exactly as the built-in tasks are (README: "Train your own model"):

    make train-local CONFIG=examples/regression.yaml
    python -m train.launch --nproc-per-node 2 -- --config examples/regression.yaml task.hidden=128

This file is all there is: the trainer gives it DDP, AMP, accumulation, clipping, checkpoints with exact
resume, stops and requeues, elastic world sizes, logging and W&B, and never imports it by name.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from train.config import ConfigError
from train.task import Task


class NoisyInputs(TensorDataset):
    """(x, y) pairs whose inputs get fresh noise at every read: a random augmentation, seeded by the
    trainer per (sample, epoch), so a resumed run reads exactly what an uninterrupted one does."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, noise: float):
        super().__init__(x, y)
        self.noise = noise

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + self.noise * torch.randn_like(x), y


class Regression(Task):
    @dataclass
    class Config:  # task.<key> in YAML and on the command line, checked like every other key
        inputs: int = 8
        hidden: int = 64
        layers: int = 2
        train_samples: int = 4096
        eval_samples: int = 512
        noise: float = 0.05  # input noise added at every read of a training sample
        dropout: float = 0.0

    # What a relaunch of a run may change (docs/tasks.md): the data's keys start the new data from its beginning,
    # the model's are refused (a new run.name), dropout applies from the resumed step.
    relaunch = {"inputs": "refused", "hidden": "refused", "layers": "refused", "train_samples": "data",
                "eval_samples": "applied", "noise": "data", "dropout": "training"}

    def check(self) -> None:
        c = self.cfg
        if c.inputs < 1 or c.hidden < 1 or c.layers < 1:
            raise ConfigError(f"task.inputs, task.hidden and task.layers must be >= 1, got {c.inputs}, "
                              f"{c.hidden}, {c.layers}")
        if not 0 <= c.dropout < 1:
            raise ConfigError(f"task.dropout must be in [0, 1), got {c.dropout}")

    def _split(self, n: int, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 10 + which)  # the same data on every rank
        w = torch.randn(self.cfg.inputs, generator=torch.Generator().manual_seed(self.seed)) / self.cfg.inputs**0.5
        x = torch.randn(n, self.cfg.inputs, generator=g)
        y = torch.sin(x @ w).unsqueeze(1) + 0.5 * x[:, :1] ** 2
        return x, y

    def datasets(self):
        train = NoisyInputs(*self._split(self.cfg.train_samples, 1), self.cfg.noise)
        return train, TensorDataset(*self._split(self.cfg.eval_samples, 2))

    def model(self) -> nn.Module:
        c = self.cfg
        layers, width = [], c.inputs
        for _ in range(c.layers):
            layers += [nn.Linear(width, c.hidden), nn.GELU(), nn.Dropout(c.dropout)]
            width = c.hidden
        return nn.Sequential(*layers, nn.Linear(width, 1))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    def eval_step(self, model: nn.Module, batch) -> dict:
        x, y = batch
        err = model(x).float() - y
        return {"loss": (err**2).sum(), "mae": err.abs().sum(), "count": len(y)}
