"""trainer.train_step with a task that counts its targets (Task.count), in this process (one rank, no process
group): the step's gradient is the one of its summed loss over its count whatever the micro-batch split, the loss
it returns is that mean, and a step that counts nothing moves no weight and says so once. The same over 1, 2 and 4
gloo ranks: tests/processes/test_count_loss.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from train import trainer
from train.task import Task
from train.tasks import shards

IGNORE = shards.IGNORE


class Tokens(Task):
    """A bigram model: x (B, T) tokens, y (B, T) targets, IGNORE where a target does not count."""

    def loss(self, model, batch):
        x, y = batch
        return shards.lm_loss(model(x), y, summed=True)

    def count(self, batch):
        return shards.lm_count(batch[1])


class Meter:
    def waiting_for_data(self):
        return contextlib.nullcontext()

    def computing(self):
        return contextlib.nullcontext()

    def units(self, real, samples):
        pass


class Log:
    is_main = True

    def __init__(self):
        self.warnings: list[str] = []

    def warning(self, msg):
        self.warnings.append(msg)


def batch_of(seed: int, counted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """4 windows of 8 tokens whose counted targets are 1, 3, 8 and 0 (or none at all)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 16, (4, 8), generator=g)
    y = torch.randint(0, 16, (4, 8), generator=g)
    for row, n in enumerate((1, 3, 8, 0)):
        y[row, n:] = IGNORE
    return x, y if counted else torch.full_like(y, IGNORE)


def training(log: Log, weights: dict, optimizer=torch.optim.SGD):
    torch.manual_seed(0)
    model = nn.Embedding(16, 16)
    model.load_state_dict(weights)
    cfg = SimpleNamespace(train=SimpleNamespace(steps=10, grad_clip=0.0, channels_last=False), task_name="tokens",
                          optim=SimpleNamespace(warmup_steps=0, lr=0.5, min_lr_ratio=1.0))
    task = Tokens(None, 0)
    state = SimpleNamespace(model=model, optimizer=optimizer(model.parameters(), lr=0.5), step=0,
                            scaler=torch.amp.GradScaler("cpu", enabled=False))
    return SimpleNamespace(cfg=cfg, task=task, device=torch.device("cpu"), world_size=1, wrapped=model, state=state,
                           step_loss=lambda b: task.loss(model, b), log=log, said_no_count=False)


def step(t, micro: int, batch) -> torch.Tensor | None:
    x, y = batch
    parts = iter([(x[i:i + micro], y[i:i + micro]) for i in range(0, len(x), micro)])
    return trainer.train_step(t, parts, [micro] * (len(x) // micro), Meter())


def test_the_step_is_its_summed_loss_over_its_count_whatever_the_micro_batch_split():
    weights = nn.Embedding(16, 16).state_dict()
    batch = batch_of(1)
    x, y = batch
    expected = F.cross_entropy(F.embedding(x, weights["weight"]).reshape(-1, 16), y.reshape(-1),
                               ignore_index=IGNORE)  # the mean over the 12 counted targets
    after = {}
    for micro in (4, 2, 1):
        t = training(Log(), weights)
        loss = step(t, micro, batch)
        assert loss is not None and torch.allclose(loss, expected, rtol=1e-6), (micro, loss, expected)
        after[micro] = t.state.model.weight.detach().clone()
    assert torch.allclose(after[2], after[4], rtol=1e-6, atol=1e-7) and torch.allclose(after[1], after[4], rtol=1e-6,
                                                                                      atol=1e-7)
    assert not torch.equal(after[4], weights["weight"])


def test_a_step_that_counts_no_target_moves_no_weight_and_is_said_once():
    weights = nn.Embedding(16, 16).state_dict()
    log = Log()
    t, micro = training(log, weights, optimizer=torch.optim.AdamW), 2
    assert step(t, micro, batch_of(1, counted=False)) is None
    assert step(t, micro, batch_of(2, counted=False)) is None
    assert torch.equal(t.state.model.weight.detach(), weights["weight"]) and not t.state.optimizer.state
    assert t.state.step == 2 and len(log.warnings) == 1 and "no target counts in the loss" in log.warnings[0]
    assert step(t, micro, batch_of(3)) is not None and t.state.optimizer.state  # a step that counts moves on
