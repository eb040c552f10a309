"""Optimizer and learning-rate schedule.

The schedule is a pure function of the step (linear warm-up, then cosine decay), so resuming needs
nothing but the step counter.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from train.config import OptimConfig


def build(cfg: OptimConfig, model: nn.Module, loss_scaling: bool = False) -> torch.optim.Optimizer:
    """AdamW or SGD over `model`'s parameters. `loss_scaling`: fp16's GradScaler will skip the steps whose
    gradients overflow."""
    # Weight decay on weight matrices and kernels only, not on biases and norm scales.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # optim.fused: one kernel for all parameters' update (GPUs); otherwise torch's default, foreach kernels on
    # a GPU and one parameter at a time on the CPU.
    # Not SGD with momentum under loss scaling: torch's fused SGD (2.11 to 2.15 at least) advances its momentum on a
    # step the GradScaler skips (an overflow, routine in fp16's first steps), and the weights turn NaN a step later;
    # fused AdamW leaves its state alone on such a step. (config.validate refuses optim.fused=true there.)
    unsafe = cfg.name == "sgd" and cfg.momentum > 0 and loss_scaling
    fused = cfg.fused if cfg.fused != "auto" else (
        not unsafe and all(p.device.type == "cuda" for p in [*decay, *no_decay]))
    kernels = {"fused": True} if fused else {}
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                               **kernels)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kernels)


@contextlib.contextmanager
def own_settings(optimizer: torch.optim.Optimizer):
    """Around the load of a saved state dict: its param_groups would bring back the saved run's hyper-parameters
    (weight decay, betas, momentum) and kernel choice (optim.fused switched, or another GPU); this launch's are
    kept, so a relaunch with a changed optim.* value applies it. Each parameter's `step` counter goes where the
    kernels keep it: on the parameter's device for fused ones, on the host for the others (where a counter on a
    GPU would cost a read of the device per parameter and step)."""
    kept = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    yield
    for group, settings in zip(optimizer.param_groups, kept, strict=True):
        group.update(settings)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(step := state.get("step")):
                state["step"] = step.to(device=p.device if on_device else "cpu", dtype=torch.float32)


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
