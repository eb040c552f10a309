"""Evaluation: when it runs (every train.eval_every steps, at the end of the run, and the one a stop pre-empted,
after the resume) and the run itself, over the whole evaluation set with every rank taking a shard."""

from __future__ import annotations

import torch
from torch import nn

from train.config import Config, ConfigError
from train.parallel import distributed, wrapping
from train.parallel.data import to_device
from train.stops.signals import StopRequest
from train.task import Task


class Evaluation:
    def __init__(self, cfg: Config, task: Task, loader: torch.utils.data.DataLoader, device: torch.device,
                 stop: StopRequest):
        self.cfg, self.task, self.loader, self.device, self.stop = cfg, task, loader, device, stop

    def due(self, step: int) -> bool:
        """Whether step `step` is followed by a periodic evaluation (the end of the run always has one)."""
        every = self.cfg.train.eval_every
        return bool(every and step % every == 0)

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float] | None:
        """The task's metrics over the whole evaluation set: each rank takes a shard, sums are all-reduced.

        Returns None when a stop was agreed first: the ranks agree between batches, so a stop never waits
        for a long evaluation (shards differ by a batch at most; every rank takes the same number of turns)."""
        cfg, task = self.cfg, self.task
        # Every rank evaluates with rank 0's buffers (BatchNorm statistics), the ones a checkpoint holds (DDP
        # would broadcast them at the next forward anyway): the result does not depend on the world size.
        distributed.sync_buffers(model)
        turns = int(distributed.all_reduce_max(len(self.loader), self.device))
        batches = iter(self.loader)
        model.eval()
        sums: dict[str, torch.Tensor] = {}
        last = None
        try:
            for _ in range(turns):
                if self.stop.agreed(self.device):
                    return None
                if (batch := next(batches, None)) is None:
                    if wrapping.sharded(model):  # every rank's forward all-gathers: run one, not counted
                        with wrapping.autocast(cfg, self.device):
                            task.eval_step(model, last)
                    continue
                last = to_device(batch, self.device, cfg.train.channels_last)
                with wrapping.autocast(cfg, self.device):
                    out = task.eval_step(model, last)
                for k, v in out.items():
                    v = v.detach().double() if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
                    sums[k] = sums.get(k, 0) + v.to(self.device)
        finally:
            model.train()
            wrapping.reshard(model)  # FSDP: the root's gathered parameters (embeddings, heads) are freed, not kept
        # Every rank has a batch (loaders() checks it), so every rank has the same keys in the same order.
        keys = list(sums)
        totals = dict(zip(keys, distributed.all_reduce_sum([sums[k].item() for k in keys], self.device), strict=True))
        count = totals.pop("count", None)
        if not count:
            raise ConfigError(f"task {cfg.task_name}: eval_step() must return a \"count\" > 0 with its sums")
        means = task.summarize({k: v / count for k, v in totals.items()})
        return {f"eval_{k}": float(v) for k, v in means.items()}
