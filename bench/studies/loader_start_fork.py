"""`python -m train` with the loader workers forked from the training process, as before the fork server
(train/parallel/data.py, worker_context): the baseline bench/studies/loader_start.py compares against. Not for
training: a fork from a process that runs threads can hang (CPython gh-112275).

    torchrun --nproc-per-node 2 -m bench.studies.loader_start_fork --config configs/default.yaml key=value ...
"""

import runpy

import torch

from train.parallel import data

data.worker_context = lambda: torch.multiprocessing.get_context("fork")
runpy.run_module("train", run_name="__main__", alter_sys=True)
