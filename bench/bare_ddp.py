"""The same math as `python -m train` in a minimal hand-written DDP loop: are the final weights bitwise equal?

    torchrun --nproc-per-node 2 bench/bare_ddp.py OUT_DIR key=value ...

Same model, data (the project's data set and sampler), batch, optimizer, learning-rate schedule,
precision (fp32) and seed as `python -m train` with the same overrides; nothing else: no logging, no
checkpoints, no evaluation. (The speed baseline is bench/user_ddp.py, which uses nothing of this
project.) Rank 0 writes OUT_DIR/model.pt and OUT_DIR/times.json (the wall clock
after each step).
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from train import config, optim  # noqa: E402
from train.parallel import data  # noqa: E402

out, overrides = Path(sys.argv[1]), sys.argv[2:]
cfg = config.load("configs/default.yaml", overrides)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(cfg.seed)
task = cfg.task_class(cfg.task, cfg.seed)
train_set = data.SeededSamples(task.datasets()[0], cfg.seed)  # the trainer's per-sample seeding
sampler = data.ShardSampler(train_set, world, rank, cfg.seed)
loader = DataLoader(train_set, batch_size=cfg.micro_batches(world)[0], sampler=sampler, drop_last=True,
                    num_workers=cfg.data.num_workers, persistent_workers=cfg.data.num_workers > 0)
net = task.model()
ddp = DDP(net, bucket_cap_mb=cfg.dist.bucket_cap_mb, gradient_as_bucket_view=cfg.dist.gradient_as_bucket_view,
          static_graph=cfg.dist.static_graph, find_unused_parameters=cfg.dist.find_unused_parameters)
opt = optim.build(cfg.optim, net)
assert len(cfg.micro_batches(world)) == 1 and cfg.train.precision == "fp32", "the bare loop does the simple case only"

step, epoch, times = 0, 0, []
while step < cfg.train.steps:
    sampler.set_epoch(epoch)
    for x, y in loader:
        optim.set_lr(opt, optim.lr_at(step, cfg.train.steps, cfg.optim))
        loss = F.cross_entropy(ddp(task.pixels(x)), y)  # the built-in images come as uint8 pixels
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        times.append(time.time())
        if step == cfg.train.steps:
            break
    epoch += 1
if rank == 0:
    out.mkdir(parents=True, exist_ok=True)
    torch.save(net.state_dict(), out / "model.pt")
    (out / "times.json").write_text(json.dumps(times))
dist.destroy_process_group()
# Out without the interpreter's finalization: DDP's gloo threads outlive destroy_process_group, and one
# that frees a tensor while Python finalizes aborts the process ("terminate called without an active
# exception", SIGABRT: CI saw it once here; train/parallel/distributed.py's exit_process says more).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
