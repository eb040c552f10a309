"""The bare loop of the ResNet: the baseline `python -m train` on images is measured against (bench/suite/overhead.py).

    torchrun --nproc-per-node 2 -m bench.baselines.resnet OUT_DIR [--same-math] key=value ...

The key=value overrides are `python -m train --config configs/default.yaml`'s (task.data=imagefolder
task.path=DIR for the tutorial loop): the loop reads its sizes and hyper-parameters from the same config
(train.config.load). One loop, two ways to set it up:
- the tutorial's (the speed baseline): torchvision's ImageFolder and transforms, torch's DistributedSampler, a plain
  torchvision ResNet-18 (with the 3x3 stem for small images, as the template builds it), SGD with momentum and a
  cosine schedule. Nothing of the template runs.
- --same-math: the template's data set, per-sample seeding and sampler (train.parallel.data), model, optimizer and
  learning-rate schedule (train.optim), in fp32: the same math as `python -m train`, whose final weights it must
  equal bit for bit (the template adds no numerical difference).
Either way DDP with the template's default settings (bucket_cap_mb=25, gradient_as_bucket_view=True); no logging,
checkpoints or evaluation. Rank 0 writes OUT_DIR/times.json (the wall clock after each step) and, with --same-math,
OUT_DIR/model.pt (the final weights).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from bench.common import end_baseline


def tutorial(cfg, world: int, rank: int):
    """(the sampler, a loader, the model, the optimizer, lr at a step, the input's last transform) as the
    PyTorch tutorial writes them."""
    import torch.nn as nn
    import torchvision
    from torch.utils.data import DistributedSampler
    from torchvision.transforms import v2

    size, o = cfg.task.image_size, cfg.optim
    transform = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(),
                            v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_set = torchvision.datasets.ImageFolder(str(Path(cfg.task.path) / "train"), transform=transform)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    net = torchvision.models.resnet18(num_classes=len(train_set.classes))
    net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    opt = torch.optim.SGD(net.parameters(), lr=o.lr, momentum=0.9, weight_decay=5e-4)
    steps = cfg.train.steps
    return train_set, sampler, net, opt, lambda s: o.lr * 0.5 * (1 + math.cos(math.pi * s / steps)), lambda x: x


def same_math(cfg, world: int, rank: int):
    """The same, as `python -m train` builds them."""
    from train import optim
    from train.parallel import data

    assert len(cfg.micro_batches(world)) == 1 and cfg.train.precision == "fp32", "the bare loop does the simple case"
    task = cfg.task_class(cfg.task, cfg.seed)
    train_set = data.SeededSamples(task.datasets()[0], cfg.seed)  # the trainer's per-sample seeding
    sampler = data.ShardSampler(train_set, world, rank, cfg.seed)
    net = task.model()
    return (train_set, sampler, net, optim.build(cfg.optim, net),
            lambda s: optim.lr_at(s, cfg.train.steps, cfg.optim), task.pixels)  # the built-in images: uint8 pixels


def main() -> None:
    from train import config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--same-math", action="store_true", help="the template's data, model and optimizer")
    p.add_argument("overrides", nargs="*", help="configs/default.yaml's key=value overrides, as python -m train's")
    args = p.parse_intermixed_args()
    cfg = config.load("configs/default.yaml", args.overrides)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)
    train_set, sampler, net, opt, lr_at, prepare = (same_math if args.same_math else tutorial)(cfg, world, rank)
    workers = cfg.data.num_workers
    loader = DataLoader(train_set, batch_size=cfg.micro_batches(world)[0], sampler=sampler, drop_last=True,
                        num_workers=workers, persistent_workers=workers > 0)
    d = cfg.dist  # the template's defaults: bucket_cap_mb=25, gradient_as_bucket_view=True
    ddp = DDP(net, bucket_cap_mb=d.bucket_cap_mb, gradient_as_bucket_view=d.gradient_as_bucket_view,
              static_graph=d.static_graph, find_unused_parameters=d.find_unused_parameters)

    step, epoch, times = 0, 0, []
    while step < cfg.train.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            loss = F.cross_entropy(ddp(prepare(x)), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            times.append(time.time())
            if step == cfg.train.steps:
                break
        epoch += 1
    if rank == 0 and args.same_math:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(net.state_dict(), args.out / "model.pt")
    end_baseline(rank, args.out, {"times": times})


if __name__ == "__main__":
    main()
