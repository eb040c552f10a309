"""Checkpoint cost, measured side by side in one run (alternating, medians).

    python bench/checkpoint.py [--model resnet50] [--repeats 7] [--dir /tmp/x]

1. save: Checkpointer's write (temp file, CRC, fsync, rename, .json, `latest`) against a bare
   torch.save of the same state (target at most 1.15x), and against torch.save + fsync, the least
   a save that survives a power cut costs.
2. load, into the model and optimizer: read_checkpoint (CRC check + weights_only load) against a
   bare torch.load; target at most 1.15x.
3. blocking: how long training is blocked by an asynchronous save (host copy) against a synchronous
   save of the same state; target at most 20%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _util import write_json  # noqa: E402

from train import checkpoint, config, model, optim  # noqa: E402


class _Quiet:
    def info(self, msg):
        pass

    warning = info


def make_parts(name: str):
    cfg = config.load(None, [f"model.name={name}", "checkpoint.keep=1000"])
    net = model.build(cfg.model, 1000, 224)
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

    save_bare, save_fsynced, save_ours, load_bare, load_ours, block_sync, block_async = ([] for _ in range(7))
    for i in range(args.repeats):
        parts.step = i + 1
        save_bare.append(timed(lambda: torch.save(state, bare)))
        save_fsynced.append(timed(save_fsync))
        save_ours.append(timed(lambda: checkpoint.write_checkpoint(state, sync.dir, parts.step)))
        path = sync.dir / f"step_{parts.step:08d}.pt"
        load_bare.append(timed(lambda: into_model(torch.load(bare, map_location="cpu", weights_only=True))))
        load_ours.append(timed(lambda p=path: into_model(checkpoint.read_checkpoint(p))))
        block_sync.append(timed(lambda: sync.save(parts)))
        block_async.append(timed(lambda: asyn.save(parts)))
        asyn.wait()  # not counted: the write overlaps training in a real run
    size = bare.stat().st_size / 2**20
    med = statistics.median
    rows = [
        ("save (ours vs bare torch.save)", med(save_ours), med(save_bare), 1.15),
        ("save (ours vs torch.save + fsync)", med(save_ours), med(save_fsynced), 1.15),
        ("load (ours vs bare torch.load)", med(load_ours), med(load_bare), 1.15),
        ("training blocked (async vs sync save)", med(block_async), med(block_sync), 0.20),
    ]
    print(f"model {args.model}, checkpoint {size:.0f} MiB, {args.repeats} alternating repeats, medians, in {root}")
    print(f"{'figure':40s} {'ours s':>8s} {'base s':>8s} {'ratio':>7s} {'target':>7s}")
    for name, ours, base, target in rows:
        ratio = ours / base
        print(f"{name:40s} {ours:8.3f} {base:8.3f} {ratio:7.2f} {'<= ' + str(target):>7s} "
              f"{'ok' if ratio <= target else 'MISSED'}")
    dist.destroy_process_group()
    write_json(args.json, {"model": args.model, "checkpoint_mib": size, "save_s": med(save_ours),
                           "save_ratio_bare": med(save_ours) / med(save_bare),
                           "save_ratio_fsync": med(save_ours) / med(save_fsynced),
                           "load_s": med(load_ours), "load_ratio": med(load_ours) / med(load_bare),
                           "async_blocking_ratio": med(block_async) / med(block_sync)})


if __name__ == "__main__":
    main()
