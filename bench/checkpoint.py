"""Checkpoint cost, measured side by side in one run (alternating, medians).

    python bench/checkpoint.py [--model resnet50] [--repeats 7] [--dir /tmp/x]

1. save: Checkpointer's write (temp file, CRC, fsync, rename, .json, `latest`) against a bare
   torch.save of the same state (target at most 1.15x), and against torch.save + fsync, the least
   a save that survives a power cut costs. The contenders run in a different order each repeat (a
   bare torch.save leaves dirty pages that the next fsync would pay for). The physical limit: the
   disk's own write of the same bytes with fsync (`dd conv=fsync`), and the save against it.
2. load, into the model and optimizer: read_checkpoint (CRC check + weights_only load) against a
   bare torch.load, and against torch.load(mmap=True) (what ours uses); target at most 1.15x.
3. blocking: how long training is blocked by an asynchronous save (host copy) against a synchronous
   save of the same state; target at most 20%. And what the background write costs training: the
   step time (forward + backward + optimizer step of the same model) while it writes, against
   without.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _util import write_json  # noqa: E402

from train import checkpoint, config, optim  # noqa: E402


class _Quiet:
    def info(self, msg):
        pass

    warning = info


def make_parts(name: str):
    cfg = config.load(None, [f"task.model={name}", "task.num_classes=1000", "task.image_size=224",
                             "checkpoint.keep=1000"])
    net = cfg.task_class(cfg.task, cfg.seed).model()
    opt = optim.build(cfg.optim, net)
    net(torch.randn(2, 3, 64, 64)).sum().backward()
    opt.step()  # momentum buffers exist, as in a real checkpoint
    stream = SimpleNamespace(state_dict=lambda: {"epoch": 0, "samples_in_epoch": 0, "world_size": 1})
    parts = SimpleNamespace(raw=net, optimizer=opt, scaler=torch.amp.GradScaler("cpu", enabled=False),
                            stream=stream, step=0, device=torch.device("cpu"), window_loss=torch.zeros(()),
                            window_steps=0, eval_pending=False)
    return cfg, parts


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="seconds: ResNet-18, one repeat")
    p.add_argument("--json")
    args = p.parse_args()
    if args.smoke:
        args.model, args.repeats = "resnet18", 1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    cfg, parts = make_parts(args.model)
    cfg.run.dir = str(root / "run")
    sync = checkpoint.Checkpointer(cfg, 0, 1, _Quiet())
    cfg_async = config.from_dict(config.to_dict(cfg) | {"checkpoint": config.to_dict(cfg.checkpoint) | {"async": True}})
    cfg_async.run.dir = str(root / "run_async")
    asyn = checkpoint.Checkpointer(cfg_async, 0, 1, _Quiet())
    state = {"model": parts.raw.state_dict(), "optimizer": parts.optimizer.state_dict()}
    bare = root / "bare.pt"

    def save_fsync():
        with open(root / "bare_fsync.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def into_model(loaded):
        parts.raw.load_state_dict(loaded["model"])
        parts.optimizer.load_state_dict(loaded["optimizer"])

    x = torch.randn(4, 3, 64, 64)

    def train_step():
        parts.raw(x).sum().backward()
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)

    def dd_fsync():
        subprocess.run(["dd", f"if={bare}", f"of={root / 'dd.bin'}", "bs=4M", "conv=fsync"], check=True,
                       capture_output=True)

    t = {k: [] for k in ("bare", "fsync", "ours", "dd", "load_bare", "load_mmap", "load_ours", "block_sync",
                         "block_async")}  # seconds per repeat
    step_alone, step_during = [], []
    torch.save(state, bare)  # dd copies these bytes
    for i in range(args.repeats):
        parts.step = i + 1
        saves = [("bare", lambda: torch.save(state, bare)), ("fsync", save_fsync),
                 ("ours", lambda: checkpoint.write_checkpoint(state, sync.dir, parts.step)), ("dd", dd_fsync)]
        k = i % len(saves)
        for name, fn in saves[k:] + saves[:k]:  # each contender first in turn
            os.sync()  # no contender pays for another's dirty pages
            t[name].append(timed(fn))
        path = sync.dir / f"step_{parts.step:08d}.pt"
        loads = [("load_bare", lambda: into_model(torch.load(bare, map_location="cpu", weights_only=True))),
                 ("load_mmap", lambda: into_model(torch.load(bare, map_location="cpu", weights_only=True, mmap=True))),
                 ("load_ours", lambda p=path: into_model(checkpoint.read_checkpoint(p)))]
        for name, fn in loads if i % 2 == 0 else loads[::-1]:
            t[name].append(timed(fn))
        os.sync()
        t["block_sync"].append(timed(lambda: sync.save(parts)))
        os.sync()
        step_alone += [timed(train_step) for _ in range(3)]
        t["block_async"].append(timed(lambda: asyn.save(parts)))
        while asyn._pending is not None and asyn._pending.is_alive():  # training goes on while it writes
            step_during.append(timed(train_step))
        asyn.wait()
    save_bare, save_fsynced, save_ours, load_bare, load_ours = (t[k] for k in ("bare", "fsync", "ours", "load_bare",
                                                                               "load_ours"))
    block_sync, block_async = t["block_sync"], t["block_async"]
    size = bare.stat().st_size / 2**20
    med = statistics.median
    rows = [
        ("save (ours vs bare torch.save)", med(save_ours), med(save_bare), 1.15),
        ("save (ours vs torch.save + fsync)", med(save_ours), med(save_fsynced), 1.15),
        ("save (ours vs dd conv=fsync, the disk)", med(save_ours), med(t["dd"]), None),
        ("load (ours vs bare torch.load)", med(load_ours), med(load_bare), 1.15),
        ("load (ours vs torch.load mmap=True)", med(load_ours), med(t["load_mmap"]), 1.15),
        ("training blocked (async vs sync save)", med(block_async), med(block_sync), 0.20),
        ("step time while an async save writes", med(step_during) if step_during else float("nan"),
         med(step_alone), None),
    ]
    print(f"model {args.model}, checkpoint {size:.0f} MiB, {args.repeats} repeats in alternating order, medians, "
          f"in {root}; {len(step_during)} training steps overlapped a background write")
    print(f"{'figure':40s} {'ours s':>8s} {'base s':>8s} {'ratio':>7s} {'target':>7s}")
    for name, ours, base, target in rows:
        ratio = ours / base
        verdict = "" if target is None else ("ok" if ratio <= target else "MISSED")
        print(f"{name:40s} {ours:8.3f} {base:8.3f} {ratio:7.2f} {'' if target is None else '<= ' + str(target):>7s} "
              f"{verdict}")
    dist.destroy_process_group()
    write_json(args.json, {"model": args.model, "checkpoint_mib": size, "save_s": med(save_ours),
                           "save_ratio_bare": med(save_ours) / med(save_bare),
                           "save_ratio_fsync": med(save_ours) / med(save_fsynced),
                           "dd_fsync_s": med(t["dd"]), "save_ratio_dd": med(save_ours) / med(t["dd"]),
                           "load_s": med(load_ours), "load_ratio": med(load_ours) / med(load_bare),
                           "load_ratio_mmap": med(load_ours) / med(t["load_mmap"]),
                           "async_blocking_ratio": med(block_async) / med(block_sync),
                           "step_slowdown_during_async_save": (med(step_during) / med(step_alone)
                                                               if step_during else None)})


if __name__ == "__main__":
    main()
