"""Image classification: torchvision's ResNets on the built-in images, CIFAR-10 or an ImageFolder."""

from __future__ import annotations

import difflib
import os
import pickle
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from train.config import ConfigError
from train.task import Task

RESNETS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
    "wide_resnet50_2", "wide_resnet101_2",
)
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = "test_batch"


class ImageClassification(Task):
    @dataclass
    class Config:
        data: Literal["builtin", "cifar10", "imagefolder"] = "builtin"
        path: str = ""  # cifar10: the cifar-10-batches-py folder; imagefolder: a folder with train/ and val/
        image_size: int = 32  # pixels a side the model sees (builtin data is drawn at this size)
        num_classes: int = 10  # builtin data only; cifar10 has 10, imagefolder counts its folders
        train_samples: int = 8192  # builtin data only
        eval_samples: int = 2048  # builtin data only
        augment: bool = True  # random crop and flip
        model: str = "resnet18"  # a torchvision ResNet
        small_input: bool = True  # 3x3 stem without max-pool when image_size <= 64 (CIFAR-style)
        norm: Literal["batch", "group"] = "batch"  # the ResNet's normalization layers

    unit = "images"
    relaunch = {"data": "data", "path": "data", "image_size": "data", "num_classes": "refused",
                "train_samples": "data", "eval_samples": "applied", "augment": "training", "model": "refused",
                "small_input": "refused", "norm": "refused"}

    def check(self) -> None:
        c = self.cfg
        if c.model not in RESNETS:
            near = difflib.get_close_matches(c.model, RESNETS, 1)
            raise ConfigError(f"task.model: '{c.model}' is not a torchvision ResNet"
                              + (f" (did you mean '{near[0]}'?)" if near else f" (one of {', '.join(RESNETS)})"))
        if c.image_size < 8:
            raise ConfigError(f"task.image_size must be >= 8, got {c.image_size}")
        if c.num_classes < 2:
            raise ConfigError(f"task.num_classes must be >= 2, got {c.num_classes}")
        if c.train_samples <= 0 or c.eval_samples <= 0:
            raise ConfigError("task.train_samples and task.eval_samples must be > 0")
        if c.data != "builtin" and not c.path:
            raise ConfigError(f"task.path is required with task.data={c.data}")

    def datasets(self) -> tuple[Dataset, Dataset]:
        c, seed = self.cfg, self.seed
        if c.data == "builtin":
            protos = prototypes(c.num_classes, c.image_size, seed)
            tr = builtin(c.train_samples, c.num_classes, c.image_size, seed, "train", protos)
            ev = builtin(c.eval_samples, c.num_classes, c.image_size, seed, "eval", protos)
            self.num_classes = c.num_classes
            self.mean, self.std = 0.5, 0.25
            return ArrayDataset(*tr, c.augment), ArrayDataset(*ev, False)
        if c.data == "cifar10":
            self.mean, self.std = 0.4734, 0.2516  # CIFAR-10's pixel statistics over all channels
            self.num_classes = 10
            return (ArrayDataset(*cifar10(c.path, "train"), c.augment), ArrayDataset(*cifar10(c.path, "test"), False))
        train_root, val_root = _folder(c.path, "train"), _folder(c.path, "val")
        try:
            tr = FolderDataset(train_root, c.image_size, True, c.augment)
            ev = FolderDataset(val_root, c.image_size, False, False)
        except (FileNotFoundError, OSError) as e:
            raise ConfigError(f"task.path: {c.path}: {e}") from None
        if tr.base.classes != ev.base.classes:
            raise ConfigError(f"task.path: {train_root} and {val_root} have different class folders")
        self.num_classes = len(tr.base.classes)
        return tr, ev

    def model(self) -> nn.Module:
        import torchvision  # slow to import: only where a model is built

        c = self.cfg
        norm = None
        if c.norm == "group":  # no batch statistics: results independent of how a batch is split
            def norm(channels: int) -> nn.Module:
                return nn.GroupNorm(min(32, channels), channels)
        classes = getattr(self, "num_classes", c.num_classes)
        model = getattr(torchvision.models, c.model)(weights=None, num_classes=classes, norm_layer=norm)
        if c.small_input and c.image_size <= 64:
            # The ImageNet stem (7x7 stride-2 conv + max-pool) shrinks 32x32 input to 8x8 before the
            # first block; a 3x3 stride-1 conv keeps the resolution, as in the CIFAR ResNets.
            width = model.conv1.out_channels
            model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        return model

    def pixels(self, x: torch.Tensor) -> torch.Tensor:
        """The model's input: the built-in data and CIFAR-10 come as uint8 pixels (ArrayDataset), scaled and
        normalized here, on the device; an ImageFolder's come normalized (FolderDataset)."""
        if x.dtype != torch.uint8:
            return x
        return (x.float().div_(255) - self.mean) / self.std

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(self.pixels(x)), y)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [model.layer1, model.layer2, model.layer3, model.layer4]  # the stages

    def eval_step(self, model: nn.Module, batch) -> dict:
        x, y = batch
        logits = model(self.pixels(x)).float()
        return {"loss": F.cross_entropy(logits, y, reduction="sum"),
                "accuracy": (logits.argmax(1) == y).sum(), "count": len(y)}


class ArrayDataset(Dataset):
    """Images held in memory as uint8 (N, 3, H, W): the built-in data and CIFAR-10. Samples stay uint8
    (ImageClassification.pixels normalizes them on the device)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool):
        self.images, self.labels, self.augment = images, labels, augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        x = self.images[index]
        if self.augment:  # random 4-pixel-padded crop and horizontal flip (the trainer seeds the draws)
            pad = max(1, x.shape[-1] // 8)
            dx, dy = torch.randint(0, 2 * pad + 1, (2,)).tolist()
            x = F.pad(x, (pad, pad, pad, pad), mode="reflect")[:, dy:dy + x.shape[1], dx:dx + x.shape[2]]
            if torch.randint(0, 2, ()).item():  # a draw of its own: an offset's parity is odd 4 times in 9
                x = x.flip(-1)
        # uint8 still: a quarter of float32's bytes through the workers, the pinned memory and the copy to the GPU,
        # so that large images do not leave the GPU waiting on the loader; pixels() scales and normalizes there
        return x.contiguous(), int(self.labels[index])


class FolderDataset(Dataset):
    """torchvision's ImageFolder with its usual transforms."""

    def __init__(self, root: Path, image_size: int, train: bool, augment: bool):
        from torchvision import datasets
        from torchvision.transforms import v2

        self.base = datasets.ImageFolder(str(root))
        if train and augment:
            head = [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
        else:
            head = [v2.Resize(int(image_size * 256 / 224), antialias=True), v2.CenterCrop(image_size)]
        self.transform = v2.Compose([v2.ToImage(), *head, v2.ToDtype(torch.float32, scale=True),
                                     v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        try:
            img, label = self.base[index]
        except Exception as e:  # only a failure pays for this (a try costs nothing in Python 3.11+)
            raise ConfigError(unreadable_image(self.base.samples[index][0], e)) from None
        return self.transform(img), label


def unreadable_image(path: str, e: Exception) -> str:
    """The one line for an ImageFolder file that does not read (a corrupt or truncated image, a file that is not
    an image, one removed or unreadable since the folder was listed): the file, what failed, the fix. Raised as a
    ConfigError at the batch that reads it, in the training process or in a loader worker (torch re-raises that
    there as a ConfigError: ConfigError.line), it ends the run as every usage error does: exit 2, one line on
    each rank that read one, and under the launcher a verdict that does not retry it."""
    if isinstance(e, FileNotFoundError):
        return f"task.path: {path} was removed after the run listed the folder: restore it, or relaunch (the folder " \
               f"is listed again)"
    if isinstance(e, OSError) and e.strerror and e.filename is not None:  # the file itself, not its content
        return f"task.path: {path} cannot be read ({e.strerror}): make it readable by this user, or remove it"
    text = str(e).split(" <_io.", 1)[0]  # PIL names the file by its open file object: "<_io.BufferedReader ...>"
    text = text.replace(repr(path), "").replace(path, "").strip(" :") or type(e).__name__
    frames = traceback.extract_tb(e.__traceback__)
    who = "PIL" if frames and f"{os.sep}PIL{os.sep}" in frames[-1].filename else type(e).__name__
    return f"task.path: {path} is not a readable image ({who}: {text}): remove or replace it"


def prototypes(num_classes: int, size: int, seed: int) -> torch.Tensor:
    """builtin()'s class layouts: smooth colour fields, a quarter of `size` larger on each side than the images
    cropped from them (shared by the train and eval splits: 1.35 GB at 1000 classes of 224 px)."""
    g = torch.Generator().manual_seed(seed)
    pad = size // 4
    return F.interpolate(torch.rand(num_classes, 3, 4, 4, generator=g), size=size + 2 * pad,
                         mode="bicubic", align_corners=False)


BUILTIN_CHUNK = 256  # images drawn at a time; a multiple of 16, as torch's CPU randn fills blocks of 16 values


def builtin(n: int, num_classes: int, size: int, seed: int, split: str,
            protos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic set: each class is a smooth colour layout; samples are shifted, dimmed,
    blended with another class and noised copies of it. Same seed, same data, on every rank.
    Drawn BUILTIN_CHUNK images at a time into the uint8 result, the same bits as all at once: the float32
    draws of one chunk are held at a time, not those of the whole set."""
    pad = size // 4
    if protos is None:
        protos = prototypes(num_classes, size, seed)
    g = torch.Generator().manual_seed(seed * 7919 + (1 if split == "train" else 2))
    labels = torch.randint(num_classes, (n,), generator=g)
    other = torch.randint(num_classes, (n,), generator=g)
    shift = torch.randint(0, 2 * pad + 1, (n, 2), generator=g).tolist()
    alpha = 0.45 * torch.rand(n, 1, 1, 1, generator=g)
    gain = 0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=g)
    out = torch.empty(n, 3, size, size, dtype=torch.uint8)
    for lo in range(0, n, BUILTIN_CHUNK):  # the noise is one stream: the chunks draw what one draw of all would
        hi = min(lo + BUILTIN_CHUNK, n)
        x = torch.empty(hi - lo, 3, size, size)
        for i in range(lo, hi):
            dy, dx = shift[i]
            x[i - lo] = protos[labels[i], :, dy:dy + size, dx:dx + size]
            x[i - lo].lerp_(protos[other[i], :, pad:pad + size, pad:pad + size], alpha[i, 0, 0, 0].item())
        x.mul_(gain[lo:hi]).add_(torch.randn(x.shape, generator=g).mul_(0.2))
        out[lo:hi] = x.clamp_(0, 1).mul_(255).round_()
    return out, labels


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except Exception as e:  # any unreadable file is the same user error
        raise ConfigError(f"task.path: {path} is not a CIFAR-10 python batch ({type(e).__name__}: {e})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise ConfigError(f"task.path: {path} is not a CIFAR-10 python batch (data shape {data.shape})")
    return {"data": data, "labels": labels}


def cifar10(path: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    root = Path(path)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    if not root.is_dir():
        raise ConfigError(f"task.path: {path} does not exist (expected the cifar-10-batches-py folder)")
    names = CIFAR_TRAIN if split == "train" else [CIFAR_TEST]
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise ConfigError(f"task.path: {root} has no {', '.join(missing)} (expected cifar-10-batches-py)")
    parts = [_unpickle(root / n) for n in names]
    data = np.concatenate([p["data"] for p in parts]).reshape(-1, 3, 32, 32)
    labels = np.concatenate([p["labels"] for p in parts])
    if labels.min() < 0 or labels.max() > 9:
        raise ConfigError(f"task.path: {root} has labels outside 0-9")
    return torch.from_numpy(data), torch.from_numpy(labels)


def _folder(path: str, split: str) -> Path:
    root = Path(path) / split
    if not root.is_dir():
        raise ConfigError(f"task.path: {root} does not exist (ImageFolder needs {path}/train and {path}/val)")
    if not any(p.is_dir() for p in root.iterdir()):
        raise ConfigError(f"task.path: {root} has no class folders")
    return root
