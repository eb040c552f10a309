"""What a checkpoint holds and how DCP reads and writes it: the model's and optimizer's tensors as DCP takes
them, the rest (RNG states, optimizer hyper-parameters), the .metadata read with a whitelist of DCP's own
classes (no code runs), and the writer that an asynchronous save runs in the background.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import os
import pickle
import random
import sys
import threading
import traceback
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from train.checkpoint.storage import TRAINER, verify

# How an asynchronous save runs DCP's write: a thread of each rank, which blocks training less than a process
# (docs/dev/benchmark-studies.md).
ASYNC_TYPE = dcp.state_dict_saver.AsyncCheckpointerType.THREAD


class CrcWriter:
    """A file being written, with the CRC-32 and size of what went through it."""

    def __init__(self, f):
        self.f, self.crc, self.bytes = f, 0, 0

    def write(self, b) -> int:
        n = self.f.write(b)
        self.crc = zlib.crc32(b, self.crc)
        self.bytes += n
        return n

    def flush(self) -> None:
        # DCP's stream wrappers flush us when they are collected, which after a failed write (a full disk) is
        # after the file was closed: Python 3.13 prints that ValueError as "Exception ignored in" + a traceback
        if not self.f.closed:
            self.f.flush()

    def __getattr__(self, name):  # tell, fileno, close
        return getattr(self.f, name)


class ChecksummedFiles(FileSystem):
    """DCP's file system, where each .distcp file is CRC-32'd as DCP writes it: no read-back of what a save has
    just written. DCP's writer threads share it; each file is one thread's."""

    def __init__(self):
        super().__init__()
        self.crcs: dict[str, dict] = {}
        self.failed: OSError | None = None  # the first write that failed (a full disk): _write raises it

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        path = Path(path)
        if mode != "wb" or path.suffix != ".distcp":
            with path.open(mode) as f:
                yield f
            return
        try:
            with path.open(mode) as f:
                w = CrcWriter(f)
                yield w
        except (OSError, RuntimeError) as e:
            # torch.save's writer reports a failed write as "unexpected pos": the OSError it met is the one to
            # name. Kept, not raised: in DCP's extra writer threads it would be an uncaught exception (a
            # traceback on stderr, and the other files' results without it); _write raises it on every rank.
            error = e if isinstance(e, OSError) else e.__context__
            if not isinstance(error, OSError):
                raise
            self.failed = self.failed or error
            return
        self.crcs[path.name] = {"bytes": w.bytes, "crc32": w.crc}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle: only DCP's metadata classes, torch's sizes, dtypes and layouts and paths
    may be in it; a planted file that names anything else fails to load instead of running it."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {"Metadata", "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                                  "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module, name):
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("builtins", "getattr"):  # Python 3.11.0-3.11.4 pickle an enum member by name
            return enum_member
        # A class is named by the module that defines it, which moves between versions (Python 3.13 pickles
        # pathlib.PosixPath as pathlib._local.PosixPath): a submodule of an allowed module counts as that
        # module, and the class is taken from the allowed module itself (the submodule is never imported).
        # A file written on any Python loads on any other.
        for allowed, names in self.ALLOWED.items():
            if (module == allowed or module.startswith(allowed + ".")) and name in names:
                return getattr(importlib.import_module(allowed), name)
        raise pickle.UnpicklingError(f".metadata names {module}.{name}, which is none of DCP's metadata classes")


def enum_member(cls, name: str):
    """getattr as .metadata may use it: a member of one of the allowed enums, nothing else."""
    if isinstance(cls, enum.EnumMeta) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f".metadata asks for {getattr(cls, '__name__', cls)!r}.{name}, which is no member "
                                 "of DCP's metadata enums")


class Reader(dcp.FileSystemReader):
    """DCP's reader of a checkpoint folder, with .metadata unpickled by MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_state(path: Path, keys: tuple[str, ...] = ("model", "optimizer")) -> dict:
    """The whole checkpoint as one dict (trainer.pt's fields, and `keys` of the tensors: "model",
    "optimizer"), checked and read in this one process; raises ValueError saying what is wrong."""
    verify(path)
    try:
        state = torch.load(path / TRAINER, map_location="cpu", weights_only=True)
        metadata = Reader(path).read_metadata()
        tensors: dict = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata) and fqn.split(".", 1)[0] in keys:
                tensors[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=Reader(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # one that passes its CRCs but does not load is corrupt all the same
        raise ValueError(f"does not load ({error_text(e)})") from None
    return merge(unflatten(tensors, metadata), state.pop("rest", {})) | state


def first_error(e: BaseException) -> BaseException:
    """The error itself: of DCP's CheckpointException, the first failing rank's."""
    if isinstance(e, CheckpointException) and e.failures:
        e = min(e.failures.items())[1]
        e = e[0] if isinstance(e, tuple) else e
    return e


def error_traceback(e: BaseException) -> str:
    """Its traceback (of DCP's CheckpointException, the first failing rank's, as DCP kept it)."""
    if isinstance(e, CheckpointException) and e.failures:
        failure = min(e.failures.items())[1]
        if isinstance(failure, tuple):  # (the error, its stack): what DCP gathers from the ranks
            error, stack = failure
            return ("Traceback (most recent call last):\n" + "".join(stack.format())
                    + "".join(traceback.format_exception_only(error)))
        e = failure
    return "".join(traceback.format_exception(e))


def error_text(e: BaseException) -> str:
    """One line for what went wrong (of DCP's CheckpointException, the first failing rank's error)."""
    e = first_error(e)
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def unflatten(flat: dict, metadata: Metadata) -> dict:
    """DCP's flat keys ("optimizer.state.fc.weight.momentum_buffer") back into nested dicts, by the paths
    DCP recorded (a key's own dots are not a level)."""
    mappings = metadata.planner_data or {}
    tree: dict = {}
    for fqn, value in flat.items():
        *parents, last = mappings.get(fqn, tuple(fqn.split(".")))
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return tree


def split_state(tree: dict) -> tuple[dict, dict]:
    """A nested dict's tensors, and the rest, each in the shape of the original."""
    tensors, rest = {}, {}
    for k, v in tree.items():
        if isinstance(v, dict):
            t, r = split_state(v)
            if t:
                tensors[k] = t
            if r or not t:
                rest[k] = r
        elif torch.is_tensor(v):
            tensors[k] = v
        else:
            rest[k] = v
    return tensors, rest


def nbytes(tree: dict) -> int:
    return sum(nbytes(v) if isinstance(v, dict) else v.numel() * v.element_size() for v in tree.values())


def buffers_copied(model: dict, module: torch.nn.Module) -> dict:
    """The model's state with its buffers (BatchNorm statistics: a forward changes them in place, DDP's
    broadcast too) copied now, for an asynchronous save whose host copy of the rest comes later."""
    buffers = {b.data_ptr() for b in module.buffers()}
    return {k: v.clone() if torch.is_tensor(v) and not isinstance(v, DTensor) and v.data_ptr() in buffers else v
            for k, v in model.items()}


def write_threads(tensors: dict, most: int, world_size: int) -> int:
    """How many files each rank writes at once: checkpoint.threads, but none for less than 16 MiB of this
    rank's share (a small model's save stays one file per rank, its fsyncs few)."""
    return max(1, min(most, nbytes(tensors) // world_size // (16 << 20)))


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ---------------------------------------------------------------- state

def rng_state(device: torch.device) -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0], random.getstate()[2]],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    *mt, version, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def planner() -> DefaultSavePlanner:
    """DCP's planner, with its plans cached: the same model saves the same items from the same ranks, so
    after the first save the ranks exchange empty plans instead of an item per tensor each."""
    return DefaultSavePlanner(enable_plan_caching=True)


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> tuple[dict, dict]:
    """The model's and optimizer's state as DCP takes it (torch.distributed.checkpoint.state_dict: parameter
    names for keys, DTensors where the model is sharded): its tensors, and the rest (hyper-parameters). `step`:
    the optimizer steps done."""
    with _nothing_to_create(optimizer, step):
        model, optimizer = get_state_dict(model, optimizer)
    return split_state({"model": model, "optimizer": optimizer})


@contextlib.contextmanager
def _nothing_to_create(optimizer: torch.optim.Optimizer, step: int):
    """An optimizer that has stepped and holds no state (SGD without momentum) has none to create. torch's
    get_state_dict creates an optimizer's state wherever no parameter has a gradient (after zero_grad): a zero
    gradient for every parameter and a step with lr 0, which at each save cost a copy of the rank's parameters
    and a step's time. One zero gradient on the smallest parameter while it runs tells it so; the state it
    returns is the same (empty)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if step == 0 or optimizer.state or not params or any(p.grad is not None for p in params):
        yield
        return
    smallest = min(params, key=lambda p: p.numel())
    smallest.grad = torch.zeros_like(smallest)
    try:
        yield
    finally:
        smallest.grad = None


# ---------------------------------------------------------------- the manager

def background() -> None:
    """The calling thread, and every thread it starts from now on, at the lowest CPU priority (Linux: nice
    19 per thread): an asynchronous save writes with the CPU time that training leaves."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # a sandbox that forbids it: the save runs at training's priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class BackgroundWriter(dcp.FileSystemWriter):
    """DCP's writer for checkpoint.async: runs in DCP's thread, which starts the threads that write."""

    def write_data(self, plan, planner):
        background()
        return super().write_data(plan, planner)


@functools.cache
def stager_reusable() -> bool:
    """Whether DCP's DefaultStager stages more than once. torch 2.11's closes itself at the end of each stage
    (pytorch/pytorch#183413, fixed in 2.13): the next save's copy fails with `KeyError: <class 'type'>`. Found by
    trying (a tensor of one element staged twice), once per process, not by the version."""
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
    except Exception:  # whatever a second stage raises: a fresh stager each save is always safe
        return False
    finally:
        stager.close()
    return True
