"""TrainState: what a checkpoint saves and a resume restores. The trainer hands it to the Checkpointer, which
knows nothing else of the trainer (as torchtitan's CheckpointManager takes its `states`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from train.parallel.data import TrainStream


@dataclass
class TrainState:
    model: nn.Module  # the model itself, never its DDP wrapper (under FSDP: sharded in place)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    data: TrainStream  # the training data's position: its epoch and the samples read in it
    device: torch.device
    step: int = 0  # optimizer steps done
    # An evaluation was due at `step` but a stop came first: it runs after the resume.
    eval_pending: bool = False
    # This rank's loss sum since the last log step and the steps in it: a resumed run logs what an uninterrupted
    # one does. A float32 tensor on the device, added to without a host wait.
    window_loss: torch.Tensor | None = None
    window_steps: int = 0
