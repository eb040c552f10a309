"""`python -m train` with the loader workers forked from the training process, as before the fork server
(train/parallel/data.py, worker_context): the baseline bench/loader_start.py compares against. Not for training:
a fork from a process that runs threads can hang (CPython gh-112275).

    torchrun --nproc-per-node 2 bench/_fork_entry.py --config configs/default.yaml key=value ...
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from train.parallel import data  # noqa: E402

data.worker_context = lambda: torch.multiprocessing.get_context("fork")
runpy.run_module("train", run_name="__main__", alter_sys=True)
