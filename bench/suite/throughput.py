"""CPU throughput: one process against two on the same two cores, and the share of a step spent waiting for data.

    python -m bench.suite.throughput [--steps 30] [--json OUT] [--imagefolder-run RUN_DIR]

Same cores, split two ways: samples/s of the default job with 1 process of 2 threads and with 2 gloo
processes of 1 thread each, the same global batch on the same 2 cores. This is not scaling (no hardware
is added): it shows what DDP's communication and a second process cost against intra-op threads.
Data: the share of the step spent waiting for the loader, for the
built-in data and for an ImageFolder of PNG files written here, at the default worker count.
Figures are medians over the log windows after the first (start-up excluded).
`--imagefolder-run` reads the ImageFolder figures from a finished 2-process run instead of launching one:
run_all.py --smoke passes bench/overhead.py's, the same run at smoke size.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import SMOKE_QUIET, imagefolder, run, torchrun, train_records, write_json


def window_median(run_dir: Path, key: str) -> float:
    return statistics.median(r[key] for r in train_records(run_dir)[1:] or train_records(run_dir))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="seconds: tiny images, few steps")
    p.add_argument("--json")
    p.add_argument("--imagefolder-run", type=Path, help="a finished 2-process python -m train run on an ImageFolder")
    args = p.parse_args()
    common = [f"train.steps={args.steps}", "train.eval_every=0", "checkpoint.every=0", "train.log_every=5"]
    per_class = 64
    if args.smoke:
        common = ["train.steps=4", "train.eval_every=0", "checkpoint.every=0", "train.log_every=2",
                  "task.image_size=16", "task.train_samples=256", "task.eval_samples=32",
                  "train.global_batch_size=16", "train.micro_batch_size=8", "data.num_workers=0", *SMOKE_QUIET]
        per_class = 8
    figures = {}
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as d:
        d = Path(d)
        for nproc in (1, 2):
            out = d / f"scale{nproc}"
            run(torchrun(nproc, "-m", "train", *common, f"run.dir={out}"),
                OMP_NUM_THREADS=str(2 // nproc))  # the same two cores either way
            figures[f"samples_per_s_{nproc}proc"] = window_median(out, "samples_per_s")
            figures[f"data_wait_share_builtin_{nproc}proc"] = window_median(out, "data_wait_share")
        out = args.imagefolder_run
        if out is None:
            folder = imagefolder(d / "imgs", per_class)
            out = d / "folder"
            run(torchrun(2, "-m", "train", *common, "task.data=imagefolder", f"task.path={folder}",
                         f"run.dir={out}", "train.global_batch_size=32", "train.micro_batch_size=16"))
        figures["data_wait_share_imagefolder_2proc"] = window_median(out, "data_wait_share")
        figures["samples_per_s_imagefolder_2proc"] = window_median(out, "samples_per_s")
    figures["scaling_2_over_1"] = figures["samples_per_s_2proc"] / figures["samples_per_s_1proc"]
    for k, v in figures.items():
        print(f"{k:36s} {v:.3f}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
