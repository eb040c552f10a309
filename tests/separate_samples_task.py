"""examples/regression.py's task with its samples held one by one, as many users hold theirs: a list of (x, y)
tensor pairs (`task.storage=tensors`: two tensors, two storages, a sample), of dict records ({"x": tensor,
"y": tensor}: `records`), or of (x, y) numpy arrays (`numpy`). 5000 training samples are 10,000 separate
tensors, each a storage of its own that a loader worker receives (issue 49: "ValueError: too many fds")."""

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from train.config import ConfigError
from train.task import Task

STORAGES = ("tensors", "records", "numpy")


class Samples(Dataset):
    """The samples as a list; each read adds fresh noise to x (an augmentation the trainer seeds per sample
    and epoch)."""

    def __init__(self, items: list, storage: str, noise: float):
        self.items, self.storage, self.noise = items, storage, noise

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        item = self.items[i]
        x, y = (item["x"], item["y"]) if self.storage == "records" else item
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        return x + self.noise * torch.randn_like(x), y


class SeparateSamples(Task):
    @dataclass
    class Config:
        storage: str = "tensors"  # tensors | records | numpy
        inputs: int = 8
        hidden: int = 16
        train_samples: int = 5000
        eval_samples: int = 300
        noise: float = 0.05
        step_delay_s: float = 0.0  # a sleep in each micro-step: a run a test signals mid-way lasts while it does

    relaunch = {"storage": "data", "inputs": "refused", "hidden": "refused", "train_samples": "data",
                "eval_samples": "applied", "noise": "data", "step_delay_s": "applied"}

    def check(self) -> None:
        if self.cfg.storage not in STORAGES:
            raise ConfigError(f"task.storage: {self.cfg.storage} is not one of {', '.join(STORAGES)}")

    def _split(self, n: int, which: int) -> list:
        g = torch.Generator().manual_seed(self.seed * 10 + which)  # the same data on every rank
        w = torch.randn(self.cfg.inputs, generator=torch.Generator().manual_seed(self.seed)) / self.cfg.inputs**0.5
        x = torch.randn(n, self.cfg.inputs, generator=g)
        y = torch.sin(x @ w).unsqueeze(1) + 0.5 * x[:, :1] ** 2
        pairs = [(a.clone(), b.clone()) for a, b in zip(x, y, strict=True)]  # a storage each, not views of x and y
        if self.cfg.storage == "records":
            return [{"x": a, "y": b} for a, b in pairs]
        if self.cfg.storage == "numpy":
            return [(np.array(a.numpy()), np.array(b.numpy())) for a, b in pairs]
        return pairs

    def datasets(self):
        c = self.cfg
        return (Samples(self._split(c.train_samples, 1), c.storage, c.noise),
                Samples(self._split(c.eval_samples, 2), c.storage, 0.0))

    def model(self) -> nn.Module:
        c = self.cfg
        return nn.Sequential(nn.Linear(c.inputs, c.hidden), nn.GELU(), nn.Linear(c.hidden, 1))

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        if self.cfg.step_delay_s:
            time.sleep(self.cfg.step_delay_s)
        x, y = batch
        return F.mse_loss(model(x).float(), y)

    def eval_step(self, model: nn.Module, batch) -> dict:
        x, y = batch
        err = model(x).float() - y
        return {"loss": (err**2).sum(), "count": len(y)}
