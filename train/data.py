"""Data sets and loaders.

Every training sample is addressed by (index, epoch), and its augmentation is seeded from
(seed, epoch, index) alone. So the pixels a step sees depend neither on the number of loader workers
nor on whether the run was resumed: the data position of a checkpoint is just (epoch, samples
consumed in that epoch over all ranks), and the sampler starts the epoch's permutation after them on
resume, whatever the world size.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from train.config import Config, ConfigError
from train.loader_server import ignore_stop_signals

CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = "test_batch"


def _sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 1_000_033 + index) % (2**63 - 1)


class ArrayDataset(Dataset):
    """Images held in memory as uint8 (N, 3, H, W): the built-in data and CIFAR-10."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool, seed: int,
                 mean: float = 0.5, std: float = 0.25):
        self.images, self.labels = images, labels
        self.augment, self.seed, self.mean, self.std = augment, seed, mean, std

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        x = self.images[index].float().div_(255)
        if self.augment:  # random 4-pixel-padded crop and horizontal flip, seeded per sample
            g = torch.Generator().manual_seed(_sample_seed(self.seed, epoch, index))
            pad = max(1, x.shape[-1] // 8)
            dx, dy, flip = torch.randint(0, 2 * pad + 1, (3,), generator=g).tolist()
            x = F.pad(x, (pad, pad, pad, pad), mode="reflect")[:, dy:dy + x.shape[1], dx:dx + x.shape[2]]
            if flip % 2:
                x = x.flip(-1)
        return (x - self.mean) / self.std, int(self.labels[index])


class FolderDataset(Dataset):
    """ImageFolder with torchvision transforms run under a per-sample seed."""

    def __init__(self, root: Path, image_size: int, train: bool, augment: bool, seed: int):
        from torchvision import datasets
        from torchvision.transforms import v2

        self.base = datasets.ImageFolder(str(root))
        if train and augment:
            head = [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
        else:
            head = [v2.Resize(int(image_size * 256 / 224), antialias=True), v2.CenterCrop(image_size)]
        self.transform = v2.Compose([v2.ToImage(), *head, v2.ToDtype(torch.float32, scale=True),
                                     v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
        self.seed = seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, int]):
        index, epoch = key
        img, label = self.base[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_sample_seed(self.seed, epoch, index))
            return self.transform(img), label


# ---------------------------------------------------------------- the three sources

def builtin(n: int, num_classes: int, size: int, seed: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic set: each class is a smooth colour layout; samples are shifted, dimmed,
    blended with another class and noised copies of it. Same seed, same data, on every rank."""
    g = torch.Generator().manual_seed(seed)
    pad = size // 4
    protos = F.interpolate(torch.rand(num_classes, 3, 4, 4, generator=g), size=size + 2 * pad,
                           mode="bicubic", align_corners=False)
    g.manual_seed(seed * 7919 + (1 if split == "train" else 2))
    labels = torch.randint(num_classes, (n,), generator=g)
    other = torch.randint(num_classes, (n,), generator=g)
    shift = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    alpha = 0.45 * torch.rand(n, 1, 1, 1, generator=g)
    gain = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=g)
    x = torch.empty(n, 3, size, size)
    for i, (dy, dx) in enumerate(shift.tolist()):
        x[i] = protos[labels[i], :, dy:dy + size, dx:dx + size]
        x[i].lerp_(protos[other[i], :, pad:pad + size, pad:pad + size], alpha[i, 0, 0, 0].item())
    x = x * gain + 0.2 * torch.randn(x.shape, generator=g)
    return (x.clamp(0, 1) * 255).round().to(torch.uint8), labels


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except Exception as e:  # any unreadable file is the same user error
        raise ConfigError(f"data.path: {path} is not a CIFAR-10 python batch ({type(e).__name__}: {e})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise ConfigError(f"data.path: {path} is not a CIFAR-10 python batch (data shape {data.shape})")
    return {"data": data, "labels": labels}


def cifar10(path: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    root = Path(path)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    if not root.is_dir():
        raise ConfigError(f"data.path: {path} does not exist (expected the cifar-10-batches-py folder)")
    names = CIFAR_TRAIN if split == "train" else [CIFAR_TEST]
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise ConfigError(f"data.path: {root} has no {', '.join(missing)} (expected cifar-10-batches-py)")
    parts = [_unpickle(root / n) for n in names]
    data = np.concatenate([p["data"] for p in parts]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([p["labels"] for p in parts])
    if labels.min() < 0 or labels.max() > 9:
        raise ConfigError(f"data.path: {root} has labels outside 0-9")
    return torch.from_numpy(data), torch.from_numpy(labels)


def _folder(path: str, split: str) -> Path:
    root = Path(path) / split
    if not root.is_dir():
        raise ConfigError(f"data.path: {root} does not exist (ImageFolder needs {path}/train and {path}/val)")
    if not any(p.is_dir() for p in root.iterdir()):
        raise ConfigError(f"data.path: {root} has no class folders")
    return root


def datasets(cfg: Config) -> tuple[Dataset, Dataset, int]:
    """(train, eval, number of classes) for cfg.data."""
    d, seed = cfg.data, cfg.seed
    if d.name == "builtin":
        tr = builtin(d.train_samples, d.num_classes, d.image_size, seed, "train")
        ev = builtin(d.eval_samples, d.num_classes, d.image_size, seed, "eval")
        return ArrayDataset(*tr, d.augment, seed), ArrayDataset(*ev, False, seed), d.num_classes
    if d.name == "cifar10":
        mean, std = 0.4734, 0.2516  # CIFAR-10's pixel statistics over all channels
        return (ArrayDataset(*cifar10(d.path, "train"), d.augment, seed, mean, std),
                ArrayDataset(*cifar10(d.path, "test"), False, seed, mean, std), 10)
    train_root, val_root = _folder(d.path, "train"), _folder(d.path, "val")
    try:
        tr = FolderDataset(train_root, d.image_size, True, d.augment, seed)
        ev = FolderDataset(val_root, d.image_size, False, False, seed)
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"data.path: {d.path}: {e}") from None
    if tr.base.classes != ev.base.classes:
        raise ConfigError(f"data.path: {train_root} and {val_root} have different class folders")
    return tr, ev, len(tr.base.classes)


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


@dataclass
class TrainStream:
    """Endless micro-batches across epochs that knows its position for a checkpoint."""

    loader: DataLoader
    sampler: ShardSampler
    world_size: int
    epoch: int = 0
    samples_in_epoch: int = 0  # global: over all ranks

    def __iter__(self):
        while True:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start = self.samples_in_epoch
            for batch in self.loader:
                self.samples_in_epoch += len(batch[1]) * self.world_size
                yield batch
            self.epoch, self.samples_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.samples_in_epoch = int(state["epoch"]), int(state["samples_in_epoch"])


def _worker_init(worker_id: int) -> None:
    """Loader workers leave stop signals to the training process, which checkpoints and then ends
    them; a worker killed by a SIGTERM sent to the whole process group would break the last step.
    The fork server (below) already ignores and blocks them, so workers inherit that from their first
    instruction (torch's worker loop then handles SIGTERM until here: blocked, one cannot arrive); this
    ignores them again and unblocks them, and covers a fork server started without train.loader_server.

    A worker also lets go of the fork server's "alive" pipe, which it inherits: the server ends when the
    last holder of that pipe does, and a worker watches its parent, the server. Held by the workers too,
    a SIGKILL of the training process would leave the server and the workers waiting for each other."""
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
    train.loader_server: stop signals ignored (inherited by every worker), torch and this module
    imported once (a worker starts in a few ms). It ends when this process does (its pipe closes), and
    the workers then end too (torch's workers watch their parent).

    The cost: a worker's arguments are pickled, the dataset among them; its tensors go through shared
    memory (moved there once, then passed as file descriptors), an ImageFolder's file list is copied."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["train.loader_server"])
    # Start it now: it imports torch while this process builds the model, not at the first batch. It is
    # started once per process; a fork server that died (SIGKILL) is started again at the next worker.
    multiprocessing.forkserver.ensure_running()
    return ctx


def loaders(cfg: Config, rank: int, world_size: int, cuda: bool) -> tuple[TrainStream, DataLoader, int]:
    train_set, eval_set, num_classes = datasets(cfg)
    d, micro = cfg.data, cfg.train.micro_batch_size
    if len(train_set) < micro * world_size:
        raise ConfigError(f"the training set has {len(train_set)} samples, fewer than one micro-batch "
                          f"on every rank ({micro} x {world_size})")
    # Every new loader iterator (each epoch, each evaluation) draws a worker seed from its generator:
    # from torch's global one unless given its own, which would shift what the training draws from it
    # (dropout, a user's augmentation) by a different amount in a resumed run than in an uninterrupted
    # one. The samples never depend on that seed (each is seeded by its (index, epoch)).
    opts = {"num_workers": d.num_workers, "pin_memory": d.pin_memory and cuda,
            "generator": torch.Generator().manual_seed(cfg.seed + rank)}
    if d.num_workers > 0:
        opts |= {"persistent_workers": d.persistent_workers, "prefetch_factor": d.prefetch_factor,
                 "worker_init_fn": _worker_init, "multiprocessing_context": worker_context()}
    sampler = ShardSampler(train_set, world_size, rank, cfg.seed)
    train = DataLoader(train_set, batch_size=micro, sampler=sampler, drop_last=True, **opts)
    # Evaluation: every sample exactly once over all ranks (no padding), results all-reduced.
    eval_keys = [(i, 0) for i in range(rank, len(eval_set), world_size)]
    evaluation = DataLoader(eval_set, batch_size=micro, sampler=eval_keys, **(opts | {"persistent_workers": False}))
    return TrainStream(train, sampler, world_size), evaluation, num_classes
