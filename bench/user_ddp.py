"""The DDP loop a user writes from the PyTorch tutorial: the speed baseline `python -m train` is measured against.

    torchrun --nproc-per-node 2 bench/user_ddp.py OUT_DIR IMAGEFOLDER --steps 40 --micro-batch 32 \
        --image-size 32 --workers 1 --lr 0.03

Nothing from this project: torchvision's ImageFolder and transforms, torch's DistributedSampler, a plain
torchvision ResNet-18 (with the usual 3x3 stem for 32 px images, as the template builds it), SGD with
momentum and a cosine schedule, and DDP with the settings the template passes by default
(bucket_cap_mb=25, gradient_as_bucket_view=True). No logging, checkpoints or evaluation. Rank 0 writes
OUT_DIR/times.json: the wall clock after each step.
"""

import argparse
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from _util import end_baseline
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.transforms import v2

p = argparse.ArgumentParser()
p.add_argument("out", type=Path)
p.add_argument("data", type=Path)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--micro-batch", type=int, default=32)
p.add_argument("--image-size", type=int, default=32)
p.add_argument("--workers", type=int, default=1)
p.add_argument("--lr", type=float, default=0.03)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(args.seed)
transform = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(args.image_size, antialias=True),
                        v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True),
                        v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
train_set = torchvision.datasets.ImageFolder(str(args.data / "train"), transform=transform)
sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
loader = DataLoader(train_set, batch_size=args.micro_batch, sampler=sampler, drop_last=True,
                    num_workers=args.workers, persistent_workers=args.workers > 0)
net = torchvision.models.resnet18(num_classes=len(train_set.classes))
net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
net.maxpool = nn.Identity()
ddp = DDP(net, bucket_cap_mb=25, gradient_as_bucket_view=True)
opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))

step, epoch, times = 0, 0, []
while step < args.steps:
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        times.append(time.time())
        if step == args.steps:
            break
    epoch += 1
end_baseline(rank, args.out, times)
