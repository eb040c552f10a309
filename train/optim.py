"""Optimizer and learning-rate schedule.

The schedule is a pure function of the step (linear warm-up, then cosine decay), so resuming needs
nothing but the step counter.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from train.config import OptimConfig


def build(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    # Weight decay on weight matrices and kernels only, not on biases and norm scales.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
