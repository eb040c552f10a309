"""Checkpoint cost, 2 ranks (DDP or FSDP, gloo), measured side by side in one run (alternating order, medians).

    python -m bench.suite.checkpoint [--model resnet50] [--strategy ddp|fsdp] [--repeats 7] [--dir /tmp/x]
                               [--async-type thread|process]

Runs itself under torchrun (2 processes). Rank 0 prints the figures; the time of one of our operations is
rank 0's, from a barrier before it to its return (every rank has written by then).
1. save: Checkpointer.save (every rank writes its share through DCP, CRC-32s, manifest, rename, `latest`)
   against one process's bare torch.save + fsync of the whole state (model + optimizer) (goal at most
   1.0x), and against the disk's own write of the same bytes (`dd conv=fsync`, goal at most 1.5x; dd's
   spread is printed). The contenders run in a different order each repeat, after an os.sync().
2. load: Checkpointer.resume (every rank checks its share of the CRCs, DCP reads into model and optimizer)
   against one process's torch.load(mmap=True) of the whole state into model and optimizer.
3. async (checkpoint.async, DCP's async_save): how long training is blocked (the save's call, plus the wait
   of the next optimizer step for DCP's host copy) against a synchronous save (goal at most 5%), and the step
   time while the write runs against without (goal at most 1.2x).
The baselines write and read the same model and optimizer, unwrapped, in one process (rank 0).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from bench.common import ROOT, torchrun, write_json
from train import config, optim
from train.checkpoint import checkpointer, dcp_io
from train.checkpoint.resume import agree
from train.checkpoint.state import TrainState
from train.parallel import wrapping
from train.parallel.distributed import exit_process


class _Quiet:
    def info(self, msg):
        pass

    warning = info


def make_state(name: str, strategy: str = "ddp"):
    """What a Checkpointer saves of a run (TrainState: the model, wrapped as dist.strategy says by
    train/parallel/wrapping.py, its optimizer, the trainer's counters), and the wrapped model that trains."""
    cfg = config.load(None, [f"task.model={name}", "task.num_classes=1000", "task.image_size=224",
                             "checkpoint.keep=3", "dist.timeout_s=600", f"dist.strategy={strategy}"])
    task = cfg.task_class(cfg.task, cfg.seed)
    net = task.model()
    wrapped = wrapping.wrap(cfg, task, net, torch.device("cpu"))
    opt = optim.build(cfg.optim, net)
    position = {"epoch": 0, "samples_in_epoch": 0, "world_size": 2}
    stream = SimpleNamespace(state_dict=lambda: dict(position), load_state_dict=position.update, epoch=0,
                             samples_in_epoch=0)
    state = TrainState(model=net, optimizer=opt, scaler=torch.amp.GradScaler("cpu", enabled=False), data=stream,
                       device=torch.device("cpu"), window_loss=torch.zeros(()))
    return cfg, state, wrapped


def whole_state(cfg, x: torch.Tensor):
    """The same model and optimizer in one process, unwrapped, after one step: the baselines' bytes."""
    net = cfg.task_class(cfg.task, cfg.seed).model()
    opt = optim.build(cfg.optim, net)
    net(x).sum().backward()
    opt.step()
    return net, opt


def timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp", help="dist.strategy of the 2 ranks")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--async-type", choices=("thread", "process"), default=dcp_io.ASYNC_TYPE.value,
                   help="DCP's async_checkpointer_type for checkpoint.async (default: the one train/ uses)")
    p.add_argument("--smoke", action="store_true", help="seconds: ResNet-18, one repeat")
    p.add_argument("--json")
    args = p.parse_args()
    if "RANK" not in os.environ:  # start the 2 ranks
        sys.exit(subprocess.run(torchrun(2, "-m", "bench.suite.checkpoint", *sys.argv[1:]), cwd=ROOT).returncode)
    if args.smoke:
        args.model, args.repeats = "resnet18", 1
    dcp_io.ASYNC_TYPE = dcp_io.dcp.state_dict_saver.AsyncCheckpointerType(args.async_type)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = [args.dir or (tempfile.mkdtemp(prefix="bench-ckpt-") if rank == 0 else None)]
    dist.broadcast_object_list(root)
    root = Path(root[0])
    root.mkdir(parents=True, exist_ok=True)
    cfg, parts, wrapped = make_state(args.model, args.strategy)
    gc.freeze()  # as train/trainer.py does once the parts are built
    x = torch.randn(4, 3, 64, 64)

    def train_step():
        wrapped(x).sum().backward()
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)

    train_step()  # momentum buffers exist, as in a real checkpoint
    cfg.run.dir = str(root / "run")
    sync = checkpointer.Checkpointer(cfg, rank, 2, _Quiet())
    cfg_async = config.from_dict(config.to_dict(cfg) | {"checkpoint": config.to_dict(cfg.checkpoint) | {"async": True}})
    cfg_async.run.dir = str(root / "run_async")
    asyn = checkpointer.Checkpointer(cfg_async, rank, 2, _Quiet())
    plain, plain_opt = whole_state(cfg, x) if rank == 0 else (None, None)
    state = {"model": plain.state_dict(), "optimizer": plain_opt.state_dict()} if rank == 0 else None
    bare = root / "bare.pt"

    def on_rank_0(fn):
        return lambda: fn() if rank == 0 else None

    def save_fsync():
        with open(bare, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def dd_fsync():
        subprocess.run(["dd", f"if={bare}", f"of={root / 'dd.bin'}", "bs=4M", "conv=fsync"], check=True,
                       capture_output=True)

    def load_mmap():
        loaded = torch.load(bare, map_location="cpu", weights_only=True, mmap=True)
        plain.load_state_dict(loaded["model"])
        plain_opt.load_state_dict(loaded["optimizer"])

    def resume(ckpt):  # the figure is only worth something if the checkpoint did load
        if not ckpt.resume(parts, agree(ckpt.cfg, rank, 2)) or ckpt.resumed_from is None or parts.step != i + 1:
            raise SystemExit(f"bench: the resume did not load step {i + 1}")

    def still_writing() -> bool:  # every rank steps as long as any rank's write runs: DDP steps together
        flag = torch.tensor([float(asyn._pending is not None and not asyn._pending.done())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    t = {k: [] for k in ("fsync", "ours", "dd", "load_mmap", "load_ours", "block_sync", "block_async")}
    step_alone, step_during = [], []
    on_rank_0(save_fsync)()  # dd copies these bytes
    for i in range(args.repeats):
        parts.step = i + 1
        saves = [("fsync", on_rank_0(save_fsync)), ("ours", lambda: sync.save(parts, blocking=True)),
                 ("dd", on_rank_0(dd_fsync))]
        k = i % len(saves)
        for name, fn in saves[k:] + saves[:k]:  # each contender first in turn
            os.sync()  # no contender pays for another's dirty pages
            t[name].append(timed(fn))
        loads = [("load_mmap", on_rank_0(load_mmap)), ("load_ours", lambda: resume(sync))]
        for name, fn in loads if i % 2 == 0 else loads[::-1]:
            t[name].append(timed(fn))
        parts.step = i + 1
        os.sync()
        t["block_sync"].append(timed(lambda: sync.save(parts)))
        os.sync()
        for _ in range(3):
            still_writing()
            step_alone.append(timed(train_step))
        asyn.staging_wait_s = 0.0
        t["block_async"].append(timed(lambda: asyn.save(parts)))
        while still_writing():  # training goes on while it writes
            step_during.append(timed(train_step))
        asyn.wait()
        t["block_async"][-1] += asyn.staging_wait_s  # and the next optimizer step's wait for the host copy
    med = statistics.median
    if rank == 0:
        size = bare.stat().st_size / 2**20
        rows = [
            ("save (ours vs torch.save + fsync)", med(t["ours"]), med(t["fsync"]), 1.0),
            ("save (ours vs dd conv=fsync, the disk)", med(t["ours"]), med(t["dd"]), 1.5),
            ("load (ours vs torch.load mmap=True)", med(t["load_ours"]), med(t["load_mmap"]), None),
            ("training blocked (async vs sync save)", med(t["block_async"]), med(t["block_sync"]), 0.05),
            ("step time while an async save writes", med(step_during) if step_during else float("nan"),
             med(step_alone), 1.2),
        ]
        print(f"model {args.model}, {args.strategy}, 2 ranks (gloo), state {size:.0f} MiB, {args.repeats} repeats in "
              f"alternating order, medians, in {root}; async: {args.async_type}, {len(step_during)} training steps "
              f"overlapped a background write")
        print(f"{'figure':40s} {'ours s':>8s} {'base s':>8s} {'ratio':>7s} {'goal':>7s}")
        for name, ours, base, goal in rows:
            ratio = ours / base
            verdict = "" if goal is None else ("ok" if ratio <= goal else "MISSED")
            print(f"{name:40s} {ours:8.3f} {base:8.3f} {ratio:7.2f} {'' if goal is None else '<= ' + str(goal):>7s} "
                  f"{verdict}")
        print(f"dd conv=fsync of the same bytes: min {min(t['dd']):.3f} s, median {med(t['dd']):.3f} s, max "
              f"{max(t['dd']):.3f} s")
        write_json(args.json, {"model": args.model, "strategy": args.strategy, "checkpoint_mib": size,
                               "async_type": args.async_type,
                               "save_s": med(t["ours"]), "save_ratio_fsync": med(t["ours"]) / med(t["fsync"]),
                               "dd_fsync_s": med(t["dd"]), "dd_fsync_min_s": min(t["dd"]),
                               "dd_fsync_max_s": max(t["dd"]),
                               "dd_fsync_spread": " / ".join(f"{v:.3f}" for v in (min(t["dd"]), med(t["dd"]),
                                                                                   max(t["dd"]))),
                               "save_ratio_dd": med(t["ours"]) / med(t["dd"]),
                               "load_s": med(t["load_ours"]),
                               "load_ratio_mmap": med(t["load_ours"]) / med(t["load_mmap"]),
                               "async_blocking_ratio": med(t["block_async"]) / med(t["block_sync"]),
                               "step_slowdown_during_async_save": (med(step_during) / med(step_alone)
                                                                   if step_during else None)})
    dist.barrier()
    if rank == 0 and not args.dir:
        shutil.rmtree(root)  # a few checkpoints of this size per run: never left behind in /tmp
    dist.destroy_process_group()
    exit_process(0)  # not through Python's finalization, which DDP's gloo threads can abort (see there)


if __name__ == "__main__":
    main()
