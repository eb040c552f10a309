"""Start-up cost of the loader workers: from the fork server (train/parallel/data.py, worker_context) against a fork of
the training process (what the template did before; it can hang: CPython gh-112275).

    python -m bench.studies.loader_start                 # about 5 minutes on 2 CPU cores
    python -m bench.studies.loader_start --smoke         # seconds: one repeat of each, one run of each

Figures, each min/median/max over alternating repeats (fork, forkserver, fork, ...) in one process:
1. a new loader's first batch, with 1 and 2 workers, over the tiny built-in evaluation set (16 px), in a
   process that runs a persistent 1-worker loader meanwhile (its threads, as a rank has);
2. the same over a CIFAR-10-sized set held as a tensor (50,000 x 3 x 32 x 32 uint8, 154 MB): the fork
   server's first start of a new tensor moves it into shared memory, later starts pass a descriptor;
3. pickling an ImageNet-sized ImageFolder file list (1,281,167 paths), which every new worker receives;
4. the wall time of a whole tiny 2-rank run (tests/conftest.py's TINY with data.num_workers=2,
   train.eval_every=1: 7 evaluations), `python -m train` against bench/studies/loader_start_fork.py (the fork).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader

from bench.common import PY, SMOKE_QUIET, run, spread, write_json
from train import config
from train.parallel import data
from train.tasks import image

TINY = ["task.image_size=16", "task.train_samples=256", "task.eval_samples=64", "train.global_batch_size=16",
        "train.micro_batch_size=8", "train.log_every=1", "train.steps=6", "checkpoint.every=0",
        "optim.warmup_steps=2", *SMOKE_QUIET]
KINDS = ("fork", "forkserver")


def contexts() -> dict:
    return {"fork": torch.multiprocessing.get_context("fork"), "forkserver": data.worker_context()}


def first_batch(dataset, keys, workers: int, ctx) -> float:
    """Seconds from a new loader to its first batch; the loader's workers are ended before returning."""
    loader = DataLoader(dataset, batch_size=8, sampler=keys, num_workers=workers, multiprocessing_context=ctx,
                        worker_init_fn=data._worker_init)
    t = time.perf_counter()
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - t
    del batches
    return seconds


def show(label: str, figures: dict, out: dict) -> None:
    s = {k: spread(v) for k, v in figures.items()}
    print(f"{label}: " + "; ".join(f"{k} {v['median'] * 1000:.0f} ms (min {v['min'] * 1000:.0f}, "
                                  f"max {v['max'] * 1000:.0f})" for k, v in s.items()), flush=True)
    out[label] = s


def loader_starts(repeats: int, out: dict) -> None:
    cfg = config.load("configs/default.yaml", TINY)
    train_set, eval_set = (data.SeededSamples(d, cfg.seed) for d in cfg.task_class(cfg.task, cfg.seed).datasets())
    ctx = contexts()
    # A rank's threads: a persistent 1-worker loader kept running (from the fork server: this process may
    # fork too, and must not hang itself).
    background = DataLoader(train_set, batch_size=8, sampler=data.ShardSampler(train_set, 1, 0, 0), num_workers=1,
                            persistent_workers=True, multiprocessing_context=ctx["forkserver"])
    def endless():
        while True:
            yield from background  # persistent: the same worker, epoch after epoch

    stream = endless()
    next(stream)
    keys = [(i, 0) for i in range(len(eval_set))]
    for workers in (1, 2):
        times = {k: [] for k in KINDS}
        for _ in range(repeats):
            for kind in KINDS:
                times[kind].append(first_batch(eval_set, keys, workers, ctx[kind]))
                next(stream)
        show(f"first batch of a new {workers}-worker loader, tiny set", times, out)

    big_n = 50_000
    labels = torch.randint(10, (big_n,))
    times = {"fork": [], "forkserver, new tensor": [], "forkserver, same tensor again": []}
    for _ in range(repeats):
        big = image.ArrayDataset(torch.randint(0, 256, (big_n, 3, 32, 32), dtype=torch.uint8), labels, False)
        big_keys = [(i, 0) for i in range(0, big_n, 1000)]
        times["fork"].append(first_batch(big, big_keys, 1, ctx["fork"]))
        times["forkserver, new tensor"].append(first_batch(big, big_keys, 1, ctx["forkserver"]))
        times["forkserver, same tensor again"].append(first_batch(big, big_keys, 1, ctx["forkserver"]))
    show("first batch of a new 1-worker loader, CIFAR-10-sized tensor (154 MB)", times, out)
    del stream

    samples = [(f"/data/imagenet/train/n{c:08d}/n{c:08d}_{i}.JPEG", c) for c in range(1000) for i in range(1281)]
    samples += samples[:167]
    times = {"pickle": [], "unpickle": []}
    for _ in range(repeats):
        t = time.perf_counter()
        blob = pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL)
        times["pickle"].append(time.perf_counter() - t)
        t = time.perf_counter()
        pickle.loads(blob)
        times["unpickle"].append(time.perf_counter() - t)
    show(f"an ImageNet-sized ImageFolder's file list ({len(samples):,} paths, {len(blob) / 1e6:.0f} MB pickled), "
         "per new worker", times, out)


def whole_runs(runs: int, out: dict) -> None:
    entries = {"fork": ["-m", "bench.studies.loader_start_fork"], "forkserver": ["-m", "train"]}
    times = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="loader-start-") as tmp:
        for i in range(runs):
            for kind in KINDS:
                cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *entries[kind],
                       "--config", "configs/default.yaml", *TINY, "data.num_workers=2", "train.eval_every=1",
                       f"run.dir={tmp}/{kind}{i}"]
                t = time.perf_counter()
                run(cmd, timeout=600)
                times[kind].append(time.perf_counter() - t)
    s = {k: spread(v) for k, v in times.items()}
    print("whole tiny 2-rank run (num_workers=2, eval_every=1), wall: " + "; ".join(
        f"{k} {v['median']:.1f} s (min {v['min']:.1f}, max {v['max']:.1f})" for k, v in s.items()), flush=True)
    out["whole tiny 2-rank run, wall s"] = s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10, help="loader starts of each kind, alternating")
    p.add_argument("--runs", type=int, default=5, help="whole 2-rank runs of each kind, alternating")
    p.add_argument("--smoke", action="store_true", help="one repeat and one run of each")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    repeats, runs = (1, 1) if args.smoke else (args.repeats, args.runs)
    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, {repeats} repeat(s), {runs} run(s) "
          "of each kind, alternating", flush=True)
    out: dict = {}
    loader_starts(repeats, out)
    whole_runs(runs, out)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
