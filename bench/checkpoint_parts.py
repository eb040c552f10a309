"""Where a checkpoint save's time goes: 2 ranks (DDP, gloo), side by side in one run (alternating order,
medians), each row adding one thing to the one before.

    python bench/checkpoint_parts.py [--model resnet50] [--repeats 7]

Runs itself under torchrun (2 processes). Wall: rank 0's, from a barrier to every rank done (an os.sync()
first, so that no row pays for another's dirty pages). CPU: rank 0's process (all its threads) over the same.
1. one process: torch.save of the whole state + fsync (bench/checkpoint.py's baseline)
2. each rank: torch.save of its half + fsync, one file a rank (the work split: what sharing reaches here)
3. each rank: its half, one torch.save per tensor, + fsync (the format of DCP's files)
4. dcp.save of the state (DCP's plans cached, checkpoint.threads writer threads: what train/ calls)
5. Checkpointer.save (4 + trainer.pt, the CRC-32s, the manifest, the rename, `latest`, retention)
and, alone: zlib.crc32 of a rank's half (the checksum's CPU) and the copy of the whole state into reused
host memory (what an asynchronous save blocks training for, at least).
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
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _util import torchrun  # noqa: E402
from checkpoint import _Quiet, make_parts  # noqa: E402

from train.checkpoint import checkpointer, dcp_io  # noqa: E402
from train.parallel.distributed import exit_process  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="seconds: ResNet-18, one repeat")
    args = p.parse_args()
    if "RANK" not in os.environ:  # start the 2 ranks
        sys.exit(subprocess.run(torchrun(2, __file__, *sys.argv[1:])).returncode)
    if args.smoke:
        args.model, args.repeats = "resnet18", 1
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = [tempfile.mkdtemp(prefix="bench-ckpt-parts-") if rank == 0 else None]
    dist.broadcast_object_list(root)
    root = Path(root[0])
    cfg, parts = make_parts(args.model)
    parts.wrapped(torch.randn(2, 3, 64, 64)).sum().backward()
    parts.optimizer.step()  # momentum buffers exist, as in a real checkpoint
    gc.freeze()  # as train/trainer.py does once the parts are built
    cfg.run.dir = str(root / "run")
    ckpt = checkpointer.Checkpointer(cfg, rank, 2, _Quiet())
    state = {"model": parts.raw.state_dict(), "optimizer": parts.optimizer.state_dict()}
    tensors = sorted((t for t in [*state["model"].values(),
                                  *(v for s in state["optimizer"]["state"].values() for v in s.values())]
                      if torch.is_tensor(t)), key=lambda t: t.numel(), reverse=True)
    half = tensors[rank::2]  # each rank's share, by size in turn (as DCP balances the replicated tensors)
    half_bytes = b"".join(t.reshape(-1).numpy().view("uint8").tobytes() for t in half)
    dcp_tensors, _ = dcp_io.tensor_state(parts)
    threads = dcp_io.write_threads(dcp_tensors, cfg.checkpoint.threads, 2)
    n = [0]

    def fsynced(name, write):
        with open(root / f"{name}.{rank}", "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())

    def dcp_save():
        n[0] += 1
        writer = dcp_io.dcp.FileSystemWriter(root / f"dcp{n[0]}", sync_files=True, thread_count=threads)
        dcp_io.dcp.save(dcp_tensors, storage_writer=writer, planner=dcp_io.planner())
        if rank == 0:
            shutil.rmtree(root / f"dcp{n[0] - 1}", ignore_errors=True)

    def ours():
        parts.step += 1
        ckpt.save(parts, blocking=True)

    def host_copy():
        ckpt._host_copy(parts.device).stage(dcp_tensors)

    rows = {
        "1 one process: torch.save(whole) + fsync":
            lambda: rank == 0 and fsynced("whole", lambda f: torch.save(state, f)),
        "2 each rank: torch.save(its half) + fsync": lambda: fsynced("half", lambda f: torch.save(half, f)),
        "3 each rank: a torch.save per tensor + fsync":
            lambda: fsynced("items", lambda f: [torch.save(t, f) for t in half]),
        f"4 dcp.save ({threads} writer threads a rank)": dcp_save,
        "5 Checkpointer.save (ours)": ours,
    }
    alone = {"zlib.crc32 of a rank's half": lambda: zlib.crc32(half_bytes),
             "host copy of the whole state (async's floor)": host_copy}
    wall = {k: [] for k in [*rows, *alone]}
    cpu = {k: [] for k in wall}
    items = list(rows.items())
    for i in range(args.repeats):
        k = i % len(items)
        for name, fn in [*items[k:], *items[:k], *alone.items()]:
            os.sync()
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            fn()
            c = time.process_time() - c
            dist.barrier()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(c)
    ckpt.wait()
    if rank == 0:
        med = statistics.median
        size = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        print(f"model {args.model}, 2 ranks (gloo), {len(tensors)} tensors, {size:.0f} MiB ({len(half)} tensors, "
              f"{len(half_bytes) / 2**20:.0f} MiB a rank), {args.repeats} repeats in alternating order, medians; "
              f"{os.cpu_count()} CPUs")
        print(f"{'':50s} {'wall s':>7s} {'min':>7s} {'max':>7s} {'CPU s r0':>9s}")
        for name in wall:
            print(f"{name:50s} {med(wall[name]):7.3f} {min(wall[name]):7.3f} {max(wall[name]):7.3f} "
                  f"{med(cpu[name]):9.3f}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    dist.destroy_process_group()
    exit_process(0)  # not through Python's finalization, which DDP's gloo threads can abort (see there)


if __name__ == "__main__":
    main()
