"""Loading a task's data sets: sampling, per-sample seeding, and the endless training stream.

Every training sample is addressed by (index, epoch), and the random draws of its augmentation are
seeded from (seed, epoch, index) alone (`SeededSamples`). So what a step sees depends neither on the
number of loader workers nor on whether the run was resumed: the data position of a checkpoint is just
(epoch, samples consumed in that epoch over all ranks), and the sampler starts the epoch's permutation
after them on resume, whatever the world size.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing.forkserver
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, get_worker_info

from train.config import Config, ConfigError
from train.parallel.worker_args import WorkerContext
from train.stops.signals import ignore_stop_signals
from train.task import default_collate


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_033 + index) % (2**63 - 1)


class SeededSamples(Dataset):
    """A task's data set read by (index, epoch) keys: torch's, random's and numpy's generators are seeded
    from (seed, epoch, index) around each `dataset[index]`, so its random augmentation is the same in a
    resumed run, with any number of loader workers, on any world size. In the training process itself
    (num_workers=0) the generators' states are restored after each sample: the training draws (dropout)
    do not depend on the data."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        """A micro-batch's samples (the DataLoader asks for them together): in the training process the
        generators' states are saved and restored once a batch, not once a sample (numpy's is slow to copy)."""
        if get_worker_info() is not None:  # a loader worker: its generators serve nothing else
            return [self._seeded(index, epoch) for index, epoch in keys]
        states = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            return [self._seeded(index, epoch) for index, epoch in keys]
        finally:
            torch.set_rng_state(states[0])
            random.setstate(states[1])
            np.random.set_state(states[2])

    def _seeded(self, index: int, epoch: int):
        s = _sample_seed(self.seed, epoch, index)
        # torch's CPU generator, the one a sample draws from: torch.manual_seed(s) seeds it too, but also
        # queues lazy CUDA, XPU and MPS seeds, each with a traceback.format_stack() (most of a loader worker's
        # time on token windows), and would leave the CUDA generator reseeded by the data in the training
        # process (num_workers=0 on a GPU).
        torch.default_generator.manual_seed(s)
        random.seed(s)
        np.random.seed(s % 2**32)
        return self.dataset[index]


# ---------------------------------------------------------------- sampling and loading

class ShardSampler(DistributedSampler):
    """DistributedSampler's epoch (the same permutation, the same strided shards, the tail that does not
    divide dropped) that can start part-way into it, and tags each index with its epoch.

    `start` counts the samples of the epoch already read over all ranks, whatever the world size then:
    the rest of the permutation is sharded over the ranks of now. On the same world size this is exactly
    DistributedSampler's shard less its first start / world_size samples; after a world-size change no
    sample of the epoch is read twice and none skipped (but the tail of fewer than one per rank)."""

    def __init__(self, dataset: Dataset, world_size: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0  # samples of this epoch already read, over all ranks

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)  # as DistributedSampler shuffles
        rest = torch.randperm(len(self.dataset), generator=g).tolist()[self.start:]
        for index in rest[self.rank:len(self) * self.num_replicas:self.num_replicas]:
            yield index, self.epoch

    def __len__(self) -> int:
        return (len(self.dataset) - self.start) // self.num_replicas


class MicroBatches(Sampler[list]):
    """A rank's keys, a micro-batch at a time: each step takes the next global batch of the epoch's
    permutation, this rank's share of it (every world-size-th sample: ShardSampler) in micro-batches of
    `sizes`. So a step is made of the same samples at any world size that divides the global batch, and an
    epoch ends at a step boundary: the tail of fewer than one global batch is dropped."""

    def __init__(self, sampler: ShardSampler, sizes: list[int]):
        self.sampler, self.sizes = sampler, sizes

    def __iter__(self):
        keys = iter(self.sampler)
        for _ in range(len(self.sampler) // sum(self.sizes)):
            for size in self.sizes:
                yield list(itertools.islice(keys, size))

    def __len__(self) -> int:
        return len(self.sampler) // sum(self.sizes) * len(self.sizes)


@dataclass
class TrainStream:
    """Endless micro-batches across epochs that knows its position for a checkpoint."""

    loader: DataLoader
    sampler: ShardSampler
    world_size: int
    sizes: list[int]  # of a step's micro-batches on every rank (config.micro_batches)
    epoch: int = 0
    samples_in_epoch: int = 0  # global: over all ranks

    def __iter__(self):
        while True:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start = self.samples_in_epoch
            for k, batch in enumerate(self.loader):
                self.samples_in_epoch += self.sizes[k % len(self.sizes)] * self.world_size
                yield batch
            self.epoch, self.samples_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's position; refused (ConfigError) where it was trained with another seed: the seed
        orders each epoch, so the rest of the epoch would follow another permutation (samples read twice,
        others never), and it makes the built-in data sets and the augmentation."""
        seed = state.get("seed")  # absent from checkpoints older than the seed's check
        if seed is not None and int(seed) != self.sampler.seed:
            raise ConfigError(f"the checkpoint was trained with seed={seed} and this run has seed={self.sampler.seed}"
                              f", which orders and draws its data: set seed={seed} to continue it, or start a new "
                              f"run (from scratch) under another run.name")
        self.epoch, self.samples_in_epoch = int(state["epoch"]), int(state["samples_in_epoch"])


def _worker_init(worker_id: int) -> None:
    """Loader workers leave stop signals to the training process, which checkpoints and then ends
    them; a worker killed by a SIGTERM sent to the whole process group would break the last step.
    The fork server (below) already ignores and blocks them, so workers inherit that from their first
    instruction (torch's worker loop then handles SIGTERM until here: blocked, one cannot arrive); this
    ignores them again and unblocks them, and covers a fork server started without train.parallel.loader_server.

    A worker also lets go of the fork server's "alive" pipe, which it inherits: the server ends when the
    last holder of that pipe does, and a worker watches its parent, the server. Held by the workers too,
    a SIGKILL of the training process would leave the server and the workers waiting for each other.

    The server runs without a garbage collector (train.parallel.loader_server): the worker freezes torch's objects,
    which it inherits (its collections never walk them, nor copy their pages), and turns its own collector on."""
    gc.freeze()
    gc.enable()
    ignore_stop_signals()
    fs = multiprocessing.forkserver._forkserver
    if getattr(fs, "_forkserver_alive_fd", None) is not None:
        try:
            os.close(fs._forkserver_alive_fd)
        except OSError:
            pass
        # A process this worker starts with the forkserver method then starts a server of its own.
        fs._forkserver_alive_fd = fs._forkserver_address = None


def worker_context():
    """The multiprocessing context of every loader worker: forkserver, never fork.

    A worker forked from the training process, which runs threads (gloo's, the training loader's
    feeder and pin-memory threads, an asynchronous checkpoint's), can hang in os.fork() before its first
    instruction: CPython's gh-112275 (fixed in 3.12, and in 3.11 in September 2024: CI's 3.11.7 and
    Debian 12's 3.11.2 have it): the child waits forever on a lock another thread held at the fork, and its rank
    waits forever for its batch. The fork server is started by fork+exec (no Python runs in the forked
    child before the exec) and is single-threaded, so the workers it forks are safe. It preloads
    train.parallel.loader_server first (stop signals ignored, inherited by every worker), then this module, torch
    with it: imported once, a worker starts in a few ms. It ends when this process does (its pipe closes), and
    the workers then end too (torch's workers watch their parent).

    The cost: a worker's arguments are pickled, the dataset among them (and a task's own collate, the task with
    it); its tensors go through shared memory (moved there once, then passed as file descriptors; thousands of
    small ones packed into one block: train/parallel/worker_args.py), an ImageFolder's file list is copied."""
    ctx = WorkerContext()  # forkserver's, its arguments sent whatever number of tensors they hold
    ctx.set_forkserver_preload(["train.parallel.loader_server", "train.parallel.data"])  # in this order
    # Start it now: it imports torch while this process builds the model, not at the first batch. It is
    # started once per process; a fork server that died (SIGKILL) is started again at the next worker.
    multiprocessing.forkserver.ensure_running()
    return ctx


def loaders(cfg: Config, train_set: Dataset, eval_set: Dataset, rank: int, world_size: int, cuda: bool,
            collate: Callable[[list], Any] = default_collate) -> tuple[TrainStream, DataLoader]:
    """The training stream and the evaluation loader of a task's (train, eval) data sets, both batched by
    `collate` (train.task.collate_fn: the task's collate, pickled to the loader workers)."""
    for name, ds in (("training", train_set), ("evaluation", eval_set)):
        try:
            n = len(ds)
        except TypeError:
            raise ConfigError(f"task {cfg.task_name}: its {name} set has no len(): datasets() must return "
                              "map-style data sets (len(ds) and ds[i])") from None
        if n < world_size:
            raise ConfigError(f"task {cfg.task_name}: its {name} set has {n} samples, fewer than one per rank "
                              f"({world_size} ranks)")
    train_set, eval_set = SeededSamples(train_set, cfg.seed), SeededSamples(eval_set, cfg.seed)
    d, micro, sizes = cfg.data, cfg.train.micro_batch_size, cfg.micro_batches(world_size)
    if len(train_set) < cfg.train.global_batch_size:
        raise ConfigError(f"the training set has {len(train_set)} samples, fewer than one step's "
                          f"train.global_batch_size ({cfg.train.global_batch_size}): set a smaller one")
    # Every new loader iterator (each epoch, each evaluation) draws a worker seed from its generator:
    # from torch's global one unless given its own, which would shift what the training draws from it
    # (dropout, a user's augmentation) by a different amount in a resumed run than in an uninterrupted
    # one. The samples never depend on that seed (each is seeded by its (index, epoch)).
    opts = {"num_workers": d.num_workers, "pin_memory": d.pin_memory and cuda, "collate_fn": collate,
            "generator": torch.Generator().manual_seed(cfg.seed + rank)}
    if d.num_workers > 0:
        opts |= {"persistent_workers": d.persistent_workers, "prefetch_factor": d.prefetch_factor,
                 "worker_init_fn": _worker_init, "multiprocessing_context": worker_context()}
    sampler = ShardSampler(train_set, world_size, rank, cfg.seed)
    train = DataLoader(train_set, batch_sampler=MicroBatches(sampler, sizes), **opts)
    # Evaluation: every sample exactly once over all ranks (no padding), results all-reduced.
    eval_keys = [(i, 0) for i in range(rank, len(eval_set), world_size)]
    evaluation = DataLoader(eval_set, batch_size=micro, sampler=eval_keys, **(opts | {"persistent_workers": False}))
    return TrainStream(train, sampler, world_size, sizes), evaluation


def to_device(batch, device: torch.device, channels_last: bool = False):
    """A collated batch (tensors, or tuples, lists and dicts of them) on `device`; images (4-D tensors, floats or
    uint8 pixels) in channels_last where asked (train.channels_last)."""
    if torch.is_tensor(batch):
        fmt = torch.channels_last if channels_last and batch.dim() == 4 else torch.contiguous_format
        return batch.to(device, non_blocking=True, memory_format=fmt)
    if isinstance(batch, dict):
        return {k: to_device(v, device, channels_last) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, channels_last) for v in batch)
    return batch
