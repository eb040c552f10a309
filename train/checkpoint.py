"""Checkpoints: this module alone decides when to save, what to keep and which one is latest.

Layout, in <run_dir>/checkpoints/:
    step_00000100/           one checkpoint: a torch.distributed.checkpoint (DCP) folder
        __0_0.distcp, ...    the model's and optimizer's tensors, __<rank>_<n>.distcp: every rank writes (DCP
                             spreads DDP's replicated tensors over the ranks; FSDP's shards are each rank's own),
                             up to checkpoint.threads files at once
        .metadata            DCP's index of the tensors (rank 0)
        trainer.pt           the rest (rank 0): step, data position, each rank's RNG states and loss window,
                             the loss scaler, the optimizer's hyper-parameters, the config (weights_only)
        manifest.json        the size and CRC-32 of each file above, written last, by rank 0
    latest                   the name of the latest complete checkpoint
    abandoned/<time>-resumed-at-step-<N>/   checkpoints after step N, set aside by a resume from step N
A save goes to .step_00000100.tmp/: every rank writes and fsyncs its files, rank 0 adds the manifest once
all have, fsyncs, renames the folder into place, and only then moves `latest`. A process killed at any
point leaves the previous checkpoint intact; a folder without its manifest, or with a file that fails its
size or CRC, never counts. Loading runs no code from the files: DCP reads the tensors (its .metadata is
unpickled with a whitelist of DCP's own classes), torch.load(weights_only=True) the rest. A resume onto
another world size reshards on load (DCP). Checkpoints of this project before DCP (one step_00000100.pt
and its .json) are converted by `python -m train.checkpoint --convert RUN_DIR`; train/export.py writes
one plain file of a checkpoint's weights.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import importlib
import json
import mmap
import os
import pickle
import queue
import random
import re
import shutil
import signal
import sys
import threading
import time
import warnings
import zlib
from concurrent import futures
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from train.config import Config, OneLineParser, to_dict
from train.distributed import launch_id, launch_round, sync_buffers
from train.errors import EXIT_REQUEUE as EXIT_REQUEUE  # a stop after saving: the exit code tests read here
from train.errors import ConfigError, UsageError

FORMAT = 2
NAME = re.compile(r"^step_(\d{8})$")  # a checkpoint folder
OLD_NAME = re.compile(r"^step_(\d{8})\.pt$")  # format 1: one file (convert: python -m train.checkpoint --convert)
MANIFEST, TRAINER = "manifest.json", "trainer.pt"
# Always a stop (torchrun, Kubernetes, SLURM, Ctrl-C, a hang-up); plus checkpoint.signal. torchrun passes TERM,
# INT, HUP and QUIT on to the workers as they came; HUP stays ignored where it was (nohup: see train/launch.py).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# How an asynchronous save runs DCP's write: a thread of each rank (measured against a process by
# bench/checkpoint.py: it blocks training less here).
ASYNC_TYPE = dcp.state_dict_saver.AsyncCheckpointerType.THREAD


# ---------------------------------------------------------------- files

class SaveError(RuntimeError):
    """A save that failed (a full disk, say): it never counts, and the checkpoints before it are intact."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _remove(path: Path, later: bool = False) -> threading.Thread | None:
    """Remove a checkpoint folder: renamed first (at once it no longer counts), then deleted; `later`: by a
    thread, returned, while training goes on (a ResNet-50's took 0.045 s of each save). A process killed
    before it is done leaves a .*.removed.tmp folder, which the next resume deletes."""
    gone = path.with_name(f".{path.name}.removed.tmp")
    os.replace(path, gone)
    if not later:
        shutil.rmtree(gone, ignore_errors=True)
        return None
    t = threading.Thread(target=shutil.rmtree, args=(gone,), kwargs={"ignore_errors": True}, daemon=True)
    t.start()
    return t


def _file_crc(path: Path) -> dict:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return {"bytes": 0, "crc32": 0}
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return {"bytes": size, "crc32": zlib.crc32(m)}


def _file_crcs(paths: list[Path]) -> list[dict | OSError]:
    """_file_crc of each file, or the error reading it."""
    def one(path: Path) -> dict | OSError:
        try:
            return _file_crc(path)
        except OSError as e:
            return e
    return [one(p) for p in paths]


def _own_files(folder: Path, rank: int, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """Size and CRC-32 of the files this rank wrote into a checkpoint folder (rank 0: also DCP's .metadata
    and trainer.pt): `known` (computed while writing), the others read back."""
    names = [p.name for p in folder.iterdir() if re.fullmatch(rf"__{rank}_\d+\.distcp", p.name)]
    if rank == 0:
        names += [".metadata", TRAINER]
    known = known or {}
    rest = sorted(n for n in names if n not in known)
    crcs = _file_crcs([folder / n for n in rest])
    if errors := [e for e in crcs if isinstance(e, OSError)]:
        raise errors[0]
    found = {n: known[n] for n in names if n in known} | dict(zip(rest, crcs, strict=True))
    return dict(sorted(found.items()))


class _CrcWriter:
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


class _ChecksummedFiles(FileSystem):
    """DCP's file system, where each .distcp file is CRC-32'd as DCP writes it: no read-back (which cost
    0.03 s a save for ResNet-50's 98 MiB a rank). DCP's writer threads share it; each file is one thread's."""

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
                w = _CrcWriter(f)
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


def _publish(directory: Path, tmp: Path, step: int, files: dict, extra: dict) -> Path:
    """The last steps of a save (one process): the manifest of every rank's files, the folder renamed
    into place, `latest` moved to it."""
    manifest = {"format": FORMAT, "step": step, "time": time.time(), "files": files} | extra
    _write_atomic(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest).encode()))
    _fsync_dir(tmp)
    path = directory / f"step_{step:08d}"
    if path.exists():  # the same step saved again (a stop right after a resume): the new one replaces it
        _remove(path)
    os.replace(tmp, path)
    _fsync_dir(directory)
    _write_atomic(directory / "latest", lambda f: f.write(f"{path.name}\n".encode()))
    _fsync_dir(directory)
    return path


def verify(path: Path, share: int = 0, shares: int = 1) -> dict:
    """A checkpoint folder's manifest, after checking the size and CRC-32 of its files (of every
    `shares`-th one from the `share`-th: the ranks split the reading); raises ValueError saying what is
    wrong with it."""
    if OLD_NAME.match(path.name) and path.is_file():
        raise ValueError(f"is in the format of an earlier version of this project: {_convert_hint(path.parent)}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = sorted(manifest["files"].items())
    except FileNotFoundError:
        raise ValueError(f"incomplete (no {MANIFEST}: the save did not finish)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"unreadable ({MANIFEST}: {e})") from None
    mine = files[share::shares]
    for (name, want), got in zip(mine, _file_crcs([path / name for name, _ in mine]), strict=True):
        if isinstance(got, OSError):
            raise ValueError(f"unreadable ({name}: {got.strerror})") from None
        if got["bytes"] != want.get("bytes"):
            raise ValueError(f"fails its checksum ({name}: {got['bytes']} bytes, expected {want.get('bytes')})")
        if got["crc32"] != want.get("crc32"):
            raise ValueError(f"fails its checksum ({name}: CRC-32 differs)")
    return manifest


class _MetadataUnpickler(pickle.Unpickler):
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
            return _enum_member
        # A class is named by the module that defines it, which moves between versions (Python 3.13 pickles
        # pathlib.PosixPath as pathlib._local.PosixPath): a submodule of an allowed module counts as that
        # module, and the class is taken from the allowed module itself (the submodule is never imported).
        # A file written on any Python loads on any other.
        for allowed, names in self.ALLOWED.items():
            if (module == allowed or module.startswith(allowed + ".")) and name in names:
                return getattr(importlib.import_module(allowed), name)
        raise pickle.UnpicklingError(f".metadata names {module}.{name}, which is none of DCP's metadata classes")


def _enum_member(cls, name: str):
    """getattr as .metadata may use it: a member of one of the allowed enums, nothing else."""
    if isinstance(cls, enum.EnumMeta) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f".metadata asks for {getattr(cls, '__name__', cls)!r}.{name}, which is no member "
                                 "of DCP's metadata enums")


class Reader(dcp.FileSystemReader):
    """DCP's reader of a checkpoint folder, with .metadata unpickled by _MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
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
        raise ValueError(f"does not load ({_why(e)})") from None
    return _merge(_unflatten(tensors, metadata), state.pop("rest", {})) | state


def _why(e: BaseException) -> str:
    """One line for what went wrong (of DCP's CheckpointException, the first failing rank's error)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = min(e.failures.items())[1]
        e = e[0] if isinstance(e, tuple) else e
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__


def _unflatten(flat: dict, metadata: Metadata) -> dict:
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


def _split(tree: dict) -> tuple[dict, dict]:
    """A nested dict's tensors, and the rest, each in the shape of the original."""
    tensors, rest = {}, {}
    for k, v in tree.items():
        if isinstance(v, dict):
            t, r = _split(v)
            if t:
                tensors[k] = t
            if r or not t:
                rest[k] = r
        elif torch.is_tensor(v):
            tensors[k] = v
        else:
            rest[k] = v
    return tensors, rest


def _nbytes(tree: dict) -> int:
    return sum(_nbytes(v) if isinstance(v, dict) else v.numel() * v.element_size() for v in tree.values())


def _buffers_copied(model: dict, module: torch.nn.Module) -> dict:
    """The model's state with its buffers (BatchNorm statistics: a forward changes them in place, DDP's
    broadcast too) copied now, for an asynchronous save whose host copy of the rest comes later."""
    buffers = {b.data_ptr() for b in module.buffers()}
    return {k: v.clone() if torch.is_tensor(v) and not isinstance(v, DTensor) and v.data_ptr() in buffers else v
            for k, v in model.items()}


def _write_threads(tensors: dict, most: int, world_size: int) -> int:
    """How many files each rank writes at once: checkpoint.threads, but none for less than 16 MiB of this
    rank's share (a small model's save stays one file per rank, its fsyncs few)."""
    return max(1, min(most, _nbytes(tensors) // world_size // (16 << 20)))


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def complete_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint folders with their manifest, newest first, none newer than the one `latest` names."""
    if not directory.is_dir():
        return []
    found = sorted((p for p in directory.iterdir() if NAME.match(p.name) and (p / MANIFEST).exists()),
                   reverse=True)
    latest = directory / "latest"
    if latest.exists():
        name = latest.read_text().strip()
        if NAME.match(name):
            found = [p for p in found if p.name <= name]
    return found


def _old_checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if OLD_NAME.match(p.name) and p.with_suffix(".json").exists()),
                  reverse=True)


def _convert_hint(folder: Path) -> str:
    return f"convert it with `python -m train.checkpoint --convert {folder}`, then resume"


def _meta(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def write_launch_marker(run_dir: Path, name: str, marker: dict) -> None:
    """<run_dir>/.launch/<launch id>.<name>: what the workers tell the launcher of one node (train/launch.py
    reads it and removes it). `round` is torchrun's round of the writer (launch_round): the launcher judges
    an ending by the markers of the round that ended."""
    folder = run_dir / ".launch"
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / f"{marker['launch_id']}.{name}", lambda f: f.write(json.dumps(marker).encode()))


# ---------------------------------------------------------------- state

def _rng_state(device: torch.device) -> dict:
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


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    *mt, version, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _planner() -> DefaultSavePlanner:
    """DCP's planner, with its plans cached: the same model saves the same items from the same ranks, so
    after the first save the ranks exchange empty plans instead of ~500 items each (bench/checkpoint.py)."""
    return DefaultSavePlanner(enable_plan_caching=True)


def _tensor_state(parts) -> tuple[dict, dict]:
    """The model's and optimizer's state as DCP takes it (torch.distributed.checkpoint.state_dict: parameter
    names for keys, DTensors where the model is sharded): its tensors, and the rest (hyper-parameters)."""
    model, optimizer = get_state_dict(parts.raw, parts.optimizer)
    return _split({"model": model, "optimizer": optimizer})


def _config_diff(cfg: Config, state: dict, section: str) -> str:
    """How the checkpoint's keys of a config section (task, optim) differ from this run's, as ` (it has
    task.model=resnet18, this run task.model=resnet34)`; empty when they are the same or unknown."""
    theirs = (state.get("config") or {}).get(section)
    if not isinstance(theirs, dict):
        return ""
    ours = to_dict(cfg)[section]
    keys = [k for k in dict.fromkeys([*theirs, *ours]) if theirs.get(k) != ours.get(k)]
    if not keys:
        return ""
    return (" (it has " + ", ".join(f"{section}.{k}={theirs.get(k)}" for k in keys[:3])
            + ", this run " + ", ".join(f"{section}.{k}={ours.get(k)}" for k in keys[:3]) + ")")


def _mismatch(expected: dict, got: dict) -> str | None:
    """How two {name: shape} of a state differ (this run's, the checkpoint's); None when they do not."""
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [f"{k} {got[k]} vs {v}" for k, v in expected.items() if k in got and got[k] != v]
    problems = []
    if shapes:
        problems.append(f"{len(shapes)} shape(s) differ, first {shapes[0]} (checkpoint vs config)")
    if missing:
        problems.append(f"{len(missing)} missing, first {missing[0]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected, first {unexpected[0]}")
    return "; ".join(problems) or None


def _shapes(metadata: Metadata, part: str) -> dict:
    """{name: shape} of the tensors of one part ("model", "optimizer") of a checkpoint, by DCP's index."""
    paths = metadata.planner_data or {}
    return {".".join(paths.get(fqn, tuple(fqn.split(".")))[1:]): tuple(md.size)
            for fqn, md in metadata.state_dict_metadata.items()
            if fqn.split(".", 1)[0] == part and isinstance(md, TensorStorageMetadata)}


def _shapes_of(tree: dict, prefix: str = "") -> dict:
    """{name: shape} of the tensors of a nested state dict, named as _shapes names a checkpoint's."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _shapes_of(v, f"{prefix}{k}.")
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = tuple(v.shape)
    return out


def check_fresh_start(cfg: Config) -> None:
    """resume=never starts afresh, which must not overwrite an earlier run's checkpoints and metrics."""
    if cfg.resume != "never":
        return
    found = [p.name for p in (cfg.run_dir / "checkpoints", cfg.run_dir / "metrics.jsonl", cfg.run_dir / "summary.json")
             if p.exists() and (p.is_file() or any(p.iterdir()))]
    if found:
        raise ConfigError(f"resume=never but {cfg.run_dir} already holds a run ({', '.join(found)}): choose a new "
                          f"run.name or run.dir for the fresh start, or resume=auto to continue it")


# ---------------------------------------------------------------- the manager

def _background() -> None:
    """The calling thread, and every thread it starts from now on, at the lowest CPU priority (Linux: nice
    19 per thread): an asynchronous save writes with the CPU time that training leaves."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):  # a sandbox that forbids it: the save runs at training's priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class _BackgroundWriter(dcp.FileSystemWriter):
    """DCP's writer for checkpoint.async: runs in DCP's thread, which starts the threads that write."""

    def write_data(self, plan, planner):
        _background()
        return super().write_data(plan, planner)


# What a start does with the checkpoints it finds: every case, once. Checkpointer.find_resume picks the candidates,
# Checkpointer.resume tries them; check_fresh_start guards resume=never. Each case names the tests that show it
# (tests/test_resume.py::test_the_resume_table_names_real_tests keeps them real): a case is added here with its test.
RESUME_CASES = {
    "auto, no checkpoint": (
        "a fresh run from step 0",
        ["test_resume.py::test_sigterm_to_torchrun_mid_epoch_then_resume_is_bitwise_exact"]),
    "auto, the run's own checkpoints": (
        "the newest complete one (not newer than `latest`), bitwise as an uninterrupted run",
        ["test_resume.py::test_sigterm_to_torchrun_mid_epoch_then_resume_is_bitwise_exact",
         "test_resume.py::test_relaunching_a_finished_run_changes_nothing"]),
    "auto, the newest corrupt (any rank's share)": (
        "one warning each, all ranks fall back to the newest that loads; the newer ones are set aside",
        ["test_resume.py::test_corrupt_latest_falls_back_to_the_previous",
         "test_checkpoint_format.py::test_a_flipped_byte_in_rank_1s_shard_falls_back_in_one_line_on_every_rank",
         "test_resume.py::test_a_checkpoint_that_passes_its_crc_but_does_not_load_is_skipped_and_never_executed"]),
    "auto, none loads": (
        "refused (exit 2) with the newest one's problem and the ways out; every checkpoint stays, nothing trained",
        ["test_resume.py::test_a_run_none_of_whose_checkpoints_loads_is_refused_in_one_line_and_they_stay"]),
    "another model or optimizer": (
        "refused (exit 2), naming the config keys and tensors that differ; nothing is written",
        ["test_resume.py::test_a_run_none_of_whose_checkpoints_loads_is_refused_in_one_line_and_they_stay"]),
    "another world size or strategy (DDP, FSDP)": (
        "DCP reshards on load; the same samples seen, with a warning that it is no longer bitwise",
        ["test_checkpoint_format.py::test_world_size_2_then_1_then_3_ends_with_the_samples_and_weights_of_an_"
         "uninterrupted_run", "test_fsdp.py::test_a_run_changes_strategy_at_each_stop_ddp_to_fsdp_and_back"]),
    "another seed": (
        "a relaunch of the run is refused (exit 2); a new run from resume=PATH takes its own, with a warning",
        ["test_data.py::test_a_relaunch_with_another_seed_is_refused_and_changes_nothing",
         "test_resume.py::test_resume_from_a_path"]),
    "an earlier format (one .pt file)": (
        "refused (exit 2) with the `python -m train.checkpoint --convert` command, which converts it",
        ["test_checkpoint_format.py::test_a_checkpoint_of_the_earlier_format_is_refused_in_one_line_until_converted",
         "test_compat.py::test_a_checkpoint_of_42fd791_converts_and_resumes_bitwise"]),
    "the previous release's checkpoint": (
        "resumes bitwise as an uninterrupted run of this release",
        ["test_compat.py::test_the_previous_releases_checkpoint_resumes_bitwise"]),
    "PATH, the run directory holds none of its own": (
        "a new run (a branch, a fine-tune) from PATH; refused (exit 2) if nothing there loads",
        ["test_resume.py::test_resume_from_a_path",
         "test_resume.py::test_a_checkpoint_that_passes_its_crc_but_does_not_load_is_skipped_and_never_executed"]),
    "PATH, the run directory holds its own": (
        "a relaunch: continues from its own as auto does, PATH last",
        ["test_resume.py::test_a_relaunched_branch_continues_from_its_own_checkpoints_not_from_resume_path"]),
    "PATH inside the run directory": (
        "a rollback, once: the later checkpoints are set aside, the saves after it record it",
        ["test_resume.py::test_resuming_before_newer_checkpoints_sets_them_aside_and_keeps_the_new_saves"]),
    "never, the run directory holds a run": (
        "refused (exit 2): nothing is overwritten",
        ["test_launcher.py::test_a_usage_error_found_by_the_workers_is_exit_2_once_not_retried"]),
}


class Checkpointer:
    def __init__(self, cfg: Config, rank: int, world_size: int, log):
        self.cfg, self.rank, self.world_size, self.log = cfg, rank, world_size, log
        self.dir = cfg.run_dir / "checkpoints"
        self.stop_signal: str | None = None  # the signal this rank received, if any
        self.stopping = False  # all ranks agreed to stop: the next save is the last
        self.saved_step: int | None = None  # the step of the last save started in this process
        self.resumed_from: Path | None = None  # the checkpoint this process resumed from
        # With resume=PATH into this run's own directory (a rollback): PATH, relative to the run directory. It
        # goes into the manifest of every save, so that a relaunch knows the rollback is done (find_resume).
        self.rollback: str | None = None
        self._pending: futures.Future | None = None  # a save being written in the background
        self._jobs: queue.SimpleQueue | None = None  # what the writer thread does (checkpoint.async)
        # DCP's collectives (and this module's during a save) run in a process group of their own: an
        # asynchronous save's never interleave with training's (gloo: DCP's are on host memory).
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.dist.timeout_s))
        self._error: BaseException | None = None
        self._removing: list[threading.Thread] = []  # deletions of checkpoints that retention let go
        self._stager: DefaultStager | None = None  # checkpoint.async's host copy, made the first time
        self._staging: futures.Future | None = None  # that copy being made, for the next optimizer step
        self._gate_handle = None  # the optimizer step's pre-hook that waits for it
        self.staging_wait_s = 0.0  # how long optimizer steps waited for it in all (bench/checkpoint.py)
        self.tracker_id: str | None = None  # the experiment tracker's run id, kept across resumes

    # ---- stop requests
    def install_signal_handler(self) -> None:
        """SIGTERM (what torchrun, Kubernetes and SLURM send), SIGINT (Ctrl-C), SIGHUP and SIGQUIT (which
        torchrun passes on unchanged) and checkpoint.signal request a stop. A second signal changes nothing:
        the save it asked for is already coming."""

        def request_stop(signum, frame):  # only sets a flag: the ranks agree at the next step or eval batch
            self.stop_signal = self.stop_signal or signal.Signals(signum).name

        for name in {*STOP_SIGNALS, self.cfg.checkpoint.signal}:
            sig = getattr(signal, name)
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started under nohup
            signal.signal(sig, request_stop)

    def stop_agreed(self, device: torch.device) -> bool:
        """All ranks agree to stop if any got the signal (an all-reduce, so nobody waits alone): a signal
        that reached one rank (one node's kubelet, one srun task) stops them all at the same step."""
        if self.stopping:
            return True
        flag = torch.tensor([1.0 if self.stop_signal else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopping = bool(flag.item())
        return self.stopping

    def _mark(self, name: str, step: int, **fields) -> None:
        """A marker in the run directory: `name` for the user (rank 0), and for each node's launcher
        (train/launch.py) one under .launch/ named by the id of its launch (each node's launcher has its own):
        every node's first local rank writes its own."""
        marker = {"step": step, "time": time.time(), "launch_id": launch_id(), "round": launch_round()} | fields
        if self.rank == 0:
            _write_atomic(self.cfg.run_dir / name, lambda f: f.write(json.dumps(marker).encode()))
        if launch_id() and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            write_launch_marker(self.cfg.run_dir, name, marker)

    def _mark_stopped(self, step: int) -> None:
        """Tell the launcher this exit was a stop after a checkpoint, not a crash (removed on resume)."""
        self._mark("STOPPED", step, signal=self.stop_signal)

    def mark_started(self, step: int) -> None:
        """Tell the launcher training begins (every rank is resumed and handles stop signals): a stop from
        now on must end with a checkpoint; one that came earlier lost nothing. Every rank calls it."""
        self._mark("STARTED", step)

    def mark_finished(self, step: int) -> None:
        """Tell the launcher the run is complete (summary.json written). Every rank calls it."""
        if launch_id() and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            write_launch_marker(self.cfg.run_dir, "FINISHED", {"step": step, "launch_id": launch_id(),
                                                               "round": launch_round()})

    # ---- saving
    def due(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def save(self, parts, blocking: bool = False) -> None:
        """Called on every rank: every rank writes its share of the tensors (DCP); rank 0 the rest, then the
        manifest. With checkpoint.async (and not `blocking`), training goes on at once: DCP copies the
        tensors to host memory while the next step's forward and backward run (its optimizer step waits for
        the copy: _gate), and writes the files in the background, one save at a time."""
        self.saved_step = parts.step
        mine = {"rng": _rng_state(parts.device),  # gathered to rank 0's trainer.pt by _write
                "window": {"loss": float(parts.window_loss.item()), "steps": parts.window_steps}}
        self.wait()  # the next save waits for the previous one
        # DCP writes each replicated tensor from one rank of its choosing: every rank holds rank 0's buffers
        # (BatchNorm statistics), those that DDP would give them at the start of the next forward anyway.
        sync_buffers(parts.raw)
        tensors, rest = _tensor_state(parts)
        trainer = {
            "format": FORMAT,
            "rest": rest,  # the optimizer's hyper-parameters: all of its state that is not a tensor
            "scaler": parts.scaler.state_dict(),
            "step": parts.step,
            "data": parts.stream.state_dict() | {"seed": self.cfg.seed},
            "eval_pending": parts.eval_pending,
            "world_size": self.world_size,
            "config": to_dict(self.cfg),
            "tracker": {"run_id": self.tracker_id},
        } if self.rank == 0 else None
        tmp = self.dir / f".step_{parts.step:08d}.tmp"
        threads = _write_threads(tensors, self.cfg.checkpoint.threads, self.world_size)
        background = self.cfg.checkpoint.async_ and not blocking
        writer = (_BackgroundWriter if background else dcp.FileSystemWriter)(tmp, sync_files=True, thread_count=threads)
        writer.fs = _ChecksummedFiles()
        if background:
            tensors["model"] = _buffers_copied(tensors.get("model", {}), parts.raw)
            self._gate(parts.optimizer)
            stager, self._staging, self._pending = self._host_copy(parts.device), futures.Future(), futures.Future()
            job = (tensors, writer, stager, tmp, parts.step, trainer, mine, self._staging, self._pending)
            self._writer_jobs(parts.device).put(lambda: self._write_async(*job))
        else:
            upload = lambda: dcp.save(tensors, storage_writer=writer, planner=_planner(),  # noqa: E731
                                      process_group=self._group)
            self._write(upload, tmp, parts.step, trainer, mine, writer.fs)
            self._raise_pending_error()

    def _writer_jobs(self, device: torch.device) -> queue.SimpleQueue:
        """This process's checkpoint writer: one daemon thread, started at the first asynchronous save and
        reused (a thread started per save cost the training thread ~8 ms here: bench/checkpoint.py)."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()

            def work(jobs: queue.SimpleQueue = self._jobs) -> None:
                if device.type == "cuda":  # a new thread's current GPU is cuda:0, whatever its rank's
                    torch.cuda.set_device(device)
                for job in iter(jobs.get, None):
                    job()

            threading.Thread(target=work, daemon=True, name="checkpoint-writer").start()
        return self._jobs

    def _write_async(self, tensors: dict, writer, stager: DefaultStager, tmp: Path, step: int, trainer: dict | None,
                     mine: dict, staged: futures.Future, done: futures.Future) -> None:
        """checkpoint.async, in the writer thread: DCP's async_save copies the tensors to host memory here
        (the optimizer's next step waits for that: _gate), then writes them from DCP's own thread."""
        try:
            try:
                upload = dcp.async_save(tensors, storage_writer=writer, planner=_planner(), async_stager=stager,
                                        process_group=self._group, async_checkpointer_type=ASYNC_TYPE)
            finally:
                staged.set_result(None)
            self._write(upload.result, tmp, step, trainer, mine, writer.fs)
        except BaseException as e:  # reported by the training thread at the next save or at exit
            self._error = e
        finally:
            done.set_result(None)

    def _host_copy(self, device: torch.device) -> DefaultStager:
        """What an asynchronous save copies the tensors into: host memory allocated at the first save and
        reused by every later one (pinned on a GPU; shared with DCP's process when it writes from one), at
        the cost of one more copy of this rank's state in host memory. A fresh allocation each save cost more
        than the copy itself (bench/checkpoint.py). The copy runs in the writer thread while the next step's
        forward and backward run (_gate); on a GPU it is queued on the default stream, after the step."""
        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=device.type == "cuda",
                use_shared_memory=ASYNC_TYPE == dcp.state_dict_saver.AsyncCheckpointerType.PROCESS,
                use_async_staging=False, use_non_blocking_copy=False))
        return self._stager

    def _gate(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the optimizer's next step wait until an asynchronous save's host copy is made: parameters and
        optimizer state change only there, so training blocks for the copy only where forward and backward
        did not cover it (buffers, which a forward changes, were copied before: _buffers_copied)."""
        if self._gate_handle is None:
            self._gate_handle = optimizer.register_step_pre_hook(lambda *_: self._wait_for_staging())

    def _wait_for_staging(self) -> None:
        if self._staging is not None:
            t = time.perf_counter()
            futures.wait([self._staging])  # a failed copy is reported with the write's error (_write)
            self.staging_wait_s += time.perf_counter() - t
            self._staging = None

    def save_and_stop(self, parts) -> int:
        """The last save of a stopped run, then the STOPPED marker for the launcher; no rank exits before
        the checkpoint is complete and every node's marker is written. Returns the step the run stopped
        at (that of its last checkpoint).

        A stop ends with the last save if it is of this step or of the one before: a save in flight
        (checkpoint.async, or a stop that came during a blocking save) is waited for, never written twice,
        and a step trained since it is trained again after the resume. Otherwise this step is saved,
        blocking. Either way a stop costs at most one step and one save (docs/stops.md: the stop budget)."""
        if self.saved_step is not None and parts.step - self.saved_step <= 1:
            step = self.saved_step
        else:
            self.save(parts, blocking=True)
            step = parts.step
        self.wait()
        dist.barrier()  # the checkpoint is complete: every node's marker says so
        self._mark_stopped(step)
        dist.barrier()
        return step

    def _write(self, upload, tmp: Path, step: int, trainer: dict | None, mine: dict, fs: _ChecksummedFiles) -> None:
        """Every rank: `upload` (DCP's write of the tensors, or the wait for it), then its RNG states and
        loss window (`mine`) and the CRC-32s of its files to rank 0, which writes the rest (trainer.pt), the
        manifest and `latest` (_publish). In checkpoint.async's thread, off the training thread's time."""
        try:
            t = time.perf_counter()
            upload()
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, mine, group=self._group)
            try:
                if fs.failed is not None:
                    raise fs.failed
                if self.rank == 0:
                    trainer["rng"] = [r["rng"] for r in ranks]
                    trainer["window"] = [r["window"] for r in ranks]  # each rank's loss since the last log step
                    _write_atomic(tmp / TRAINER, lambda f: torch.save(trainer, f))
                own = _own_files(tmp, self.rank, fs.crcs)
            except OSError as e:  # still sent: no rank waits alone in the gather
                own = e
            files = [None] * self.world_size
            dist.all_gather_object(files, own, group=self._group)
            if failed := [f for f in files if isinstance(f, OSError)]:
                raise failed[0]
            if self.rank == 0:
                extra = {"world_size": self.world_size} | ({"rollback": self.rollback} if self.rollback else {})
                path = _publish(self.dir, tmp, step, {k: v for f in files for k, v in f.items()}, extra)
                self._retain()
                self.log.info(f"saved {path} in {time.perf_counter() - t:.2f} s")
        except BaseException as e:  # reported by the training thread at the next save or at exit
            self._error = e

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise SaveError(f"checkpoint save failed: {_why(err)}") from err

    def wait(self) -> None:
        """Until the save in flight (checkpoint.async) is complete and the checkpoints it replaced are
        deleted; raises its error."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self._staging = None
        while self._removing:
            self._removing.pop().join()
        self._raise_pending_error()

    def _retain(self) -> None:
        """Keep the newest `keep` checkpoints and, with keep_every, every K-th step for good."""
        c = self.cfg.checkpoint
        ckpts = sorted((p for p in self.dir.iterdir() if NAME.match(p.name)), reverse=True)
        for p in ckpts[c.keep:]:
            step = int(NAME.match(p.name).group(1))
            if c.keep_every and step % c.keep_every == 0:
                continue
            self._removing.append(_remove(p, later=True))

    # ---- resuming
    def find_resume(self) -> list[Path]:
        """Candidates to resume from, best first, per cfg.resume (rank 0).

        resume=PATH is where a new run starts. Once this run directory holds complete checkpoints of its
        own, the same command line relaunched (a requeue, a torchrun or pod restart) continues from them as
        resume=auto does, PATH last. A PATH inside this run directory rolls the run back to it, once: the
        saves after the rollback carry PATH in their manifest, and a relaunch continues from those."""
        r = self.cfg.resume
        if r == "never":
            return []
        own = complete_checkpoints(self.dir)
        if not own and (old := _old_checkpoints(self.dir)):
            raise ConfigError(f"{old[0]} is a checkpoint of an earlier version of this project (one .pt file): "
                              f"{_convert_hint(self.dir)}")
        if r == "auto":
            return own
        p = Path(r)
        if _inside(p, self.cfg.run_dir) and p.resolve() not in (self.cfg.run_dir.resolve(), self.dir.resolve()):
            self.rollback = str(p.resolve().relative_to(self.cfg.run_dir.resolve()))
        try:
            targets = self._resume_targets(p)
        except ConfigError:
            if not own:
                raise
            targets = []  # PATH is gone, but this run no longer needs it
        if own and (self.rollback is None or any(_meta(c).get("rollback") == self.rollback for c in own)):
            self.log.info(f"resume={r}: this run directory holds checkpoints of its own (newest {own[0].name}), "
                          f"so this is a relaunch: continuing from them as resume=auto does, not from {r}")
            return own + [t for t in targets if t not in own]
        if self.rollback is not None:
            self.log.info(f"resume={r}: rolling this run back to it (its checkpoints after it are set aside)")
        else:
            self.log.info(f"resume={r}: a new run from it (the run directory holds no checkpoint of its own)")
        return targets

    @staticmethod
    def _resume_targets(p: Path) -> list[Path]:
        for d in (p, p / "checkpoints"):
            if not complete_checkpoints(d) and _old_checkpoints(d):
                raise ConfigError(f"resume: {p} holds checkpoints of an earlier version of this project (one .pt "
                                  f"file each): {_convert_hint(d)}")
        if OLD_NAME.match(p.name) and p.is_file():
            raise ConfigError(f"resume: {p} is a checkpoint of an earlier version of this project (one .pt file): "
                              f"{_convert_hint(p.parent)}")
        if NAME.match(p.name) and p.is_dir():
            return [p]
        for d in (p, p / "checkpoints"):
            if d.is_dir() and (found := complete_checkpoints(d)):
                return found
        raise ConfigError(f"resume: {p} is neither a checkpoint folder nor a folder holding checkpoints")

    def resume(self, parts) -> bool:
        """Load the best complete checkpoint into parts; False when starting fresh. What it does in each case
        is RESUME_CASES (above the class)."""
        self.wait()  # this process's own save and deletions, if any, are done: what is left over is a killed one's
        if self.rank == 0:
            (self.cfg.run_dir / "STOPPED").unlink(missing_ok=True)
            if self.dir.is_dir():  # leftovers of a save (or a removal) that was killed: never counted
                for p in self.dir.glob(".*.tmp*"):
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        candidates, error = self._agreed_candidates()
        if error is not None:
            raise ConfigError(error)
        failed: list[str] = []  # "step_00000020 <what is wrong with it>" of each that did not load
        tensors = _tensor_state(parts)[0] if candidates else {}  # this run's model and optimizer, as DCP takes them
        expected = {part: _shapes_of(tensors.get(part, {})) for part in ("model", "optimizer")}
        for path in candidates:
            t = time.perf_counter()
            # Every rank resumes from the same checkpoint: one that any rank cannot read is skipped by all.
            if problem := self._agreed_problem(self._check(path)):
                self.log.warning(f"checkpoint {path} {problem}; all ranks trying the previous one")
                failed.append(f"{path.name} {problem}")
                continue
            trainer = torch.load(path / TRAINER, map_location="cpu", weights_only=True)
            metadata = Reader(path).read_metadata()
            # A checkpoint of another model or optimizer is no damage to fall back from: the same config
            # meets the same mismatch in every checkpoint of the run. It is named, and nothing is trained.
            for part, section in (("model", "task"), ("optimizer", "optim")):
                if (mismatch := _mismatch(expected[part], _shapes(metadata, part))) is not None:
                    raise ConfigError(f"checkpoint {path} does not match the {part} of this run"
                                      f"{_config_diff(self.cfg, trainer, section)}: {mismatch}; relaunch with "
                                      f"the {section}.* settings it was trained with, or start afresh with a new "
                                      f"run.name")
            if problem := self._agreed_problem(self._load_tensors(parts, path, trainer)):
                self.log.warning(f"checkpoint {path} {problem}; all ranks trying the previous one")
                failed.append(f"{path.name} {problem}")
                continue
            self._load(parts, trainer, path, time.perf_counter() - t)
            self.resumed_from = path
            if self.rank == 0:
                self._set_aside_after(parts.step)
            return True
        if self.cfg.resume not in ("auto", "never"):
            raise ConfigError(f"resume: no loadable checkpoint at {self.cfg.resume}"
                              + (f" ({failed[0]})" if failed else ""))
        if failed:  # resume=auto: the run has checkpoints and none loads. Training from step 0 would lose them.
            more = f" (and {len(failed) - 1} more that do not load either)" if len(failed) > 1 else ""
            raise ConfigError(f"resume=auto: no checkpoint of this run loads: {failed[0]}{more}. Nothing was "
                              f"trained and every checkpoint is left as it is: fix what changed since they were "
                              f"written (the Python or torch version, the config, a run directory that every "
                              f"node must share), resume from another with resume=PATH, or start afresh with a "
                              f"new run.name")
        return False

    def _check(self, path: Path) -> str | None:
        """What is wrong with a checkpoint, from this rank's share of its files (None: nothing)."""
        try:
            verify(path, self.rank, self.world_size)
            torch.load(path / TRAINER, map_location="cpu", weights_only=True)
            Reader(path).read_metadata()
        except ValueError as e:
            return str(e)
        except Exception as e:  # a file that passes its CRC but does not load is corrupt all the same
            return f"does not load ({_why(e)})"
        return None

    def _load_tensors(self, parts, path: Path, trainer: dict) -> str | None:
        """DCP's load of the model and optimizer (every rank reads what it holds: a reshard when the world
        size or the sharding changed); what went wrong, or None."""
        tensors, _ = _tensor_state(parts)  # the shapes to read into
        try:
            dcp.load(tensors, storage_reader=Reader(path), process_group=self._group)
            state = _merge(tensors, trainer["rest"])
            set_state_dict(parts.raw, parts.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        except (Exception, CheckpointException) as e:
            return f"does not load ({_why(e)})"
        return None

    def _set_aside_after(self, step: int) -> None:
        """Move this run's checkpoints after `step` (abandoned by a resume from it: a rollback, or a fall back
        past corrupt newer ones) to abandoned/<time>-resumed-at-step-<step>/, so that they are kept but no
        longer count: retention would otherwise delete each new save as it is written (they sort above it)
        and `latest` could name one of them."""
        if not self.dir.is_dir():
            return
        after = sorted(p for p in self.dir.iterdir() if (m := NAME.match(p.name)) and int(m.group(1)) > step)
        if not after:
            return
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-resumed-at-step-{step}"
        for n in range(100):
            folder = self.dir / "abandoned" / (stamp if n == 0 else f"{stamp}.{n}")
            try:
                folder.mkdir(parents=True)
                break
            except FileExistsError:
                continue
        for p in after:  # a folder's rename is atomic: it counts where it was, or not at all
            os.replace(p, folder / p.name)
        latest = self.dir / "latest"
        if latest.exists() and latest.read_text().strip() in {p.name for p in after}:
            if kept := complete_checkpoints(self.dir):
                _write_atomic(latest, lambda f: f.write(f"{kept[0].name}\n".encode()))
            else:
                latest.unlink()
        _fsync_dir(folder)
        _fsync_dir(self.dir)
        names = ", ".join(p.name for p in after)
        self.log.info(f"resumed at step {step}: this run's later checkpoints ({names}) are set aside in {folder}, "
                      f"kept but no longer counted (retention, `latest`, resume=auto)")

    def _agreed_candidates(self) -> tuple[list[Path], str | None]:
        """Rank 0's list of checkpoints to try (or its usage error), the same on every rank: a node with a
        stale listing of a shared folder must not pick another step."""
        found: list = [None, None]
        if self.rank == 0:
            try:
                found[0] = [str(p) for p in self.find_resume()]
            except ConfigError as e:
                found[1] = str(e)
        if self.world_size > 1:
            dist.broadcast_object_list(found, src=0)
        return [Path(p) for p in found[0] or []], found[1]

    def _agreed_problem(self, problem: str | None) -> str | None:
        """The first rank's problem with a checkpoint, the same on every rank (None: no rank has one)."""
        problems = [problem]
        if self.world_size > 1:
            problems = [None] * self.world_size
            dist.all_gather_object(problems, problem)
        for rank, p in enumerate(problems):
            if p is not None:
                return p + (f" (rank {rank})" if self.world_size > 1 else "")
        return None

    def _load(self, parts, state: dict, path: Path, seconds: float) -> None:
        """The trainer's state (trainer.pt), after the tensors."""
        if parts.scaler.is_enabled() and not state["scaler"]:
            was = state.get("config", {}).get("train", {}).get("precision", "fp32/bf16")
            self.log.warning(f"checkpoint {path} was trained in {was} (no loss scaler): train.precision=fp16 "
                             f"starts a fresh GradScaler (scale {parts.scaler.get_scale():g})")
        else:
            parts.scaler.load_state_dict(state["scaler"])  # a disabled scaler (fp32, bf16) ignores it
        parts.step = int(state["step"])
        parts.eval_pending = bool(state.get("eval_pending", False))
        data_state = state["data"]
        if data_state.get("seed", self.cfg.seed) != self.cfg.seed and not _inside(path, self.cfg.run_dir):
            # A new run from another run's checkpoint (a fine-tune) may choose its own seed; a relaunch of this
            # run may not (TrainStream refuses it): the rest of its epoch would follow another permutation.
            self.log.warning(f"a new run from {path}, trained with seed={data_state['seed']}: from its data "
                             f"position on, this run's seed={self.cfg.seed} orders the data")
            data_state = data_state | {"seed": self.cfg.seed}
        parts.stream.load_state_dict(data_state)
        self.tracker_id = state.get("tracker", {}).get("run_id")
        if state["world_size"] == self.world_size:
            _set_rng_state(state["rng"][self.rank], parts.device)
            if "window" in state:  # this rank's loss sum since the last log step, bit for bit
                window = state["window"][self.rank]
                parts.window_loss.fill_(window["loss"])
                parts.window_steps = int(window["steps"])
        else:
            seen = state["step"] * self.cfg.train.global_batch_size
            self.log.warning(f"world size changed from {state['world_size']} to {self.world_size}: continuing "
                             f"after {seen} samples seen, but no longer bitwise identical to an uninterrupted run")
        self.log.info(f"resumed from {path} at step {parts.step} (epoch {parts.stream.epoch}, "
                      f"{parts.stream.samples_in_epoch} samples into it) in {seconds:.2f} s")


# ---------------------------------------------------------------- checkpoints of format 1

# Format 1 (one step_XXXXXXXX.pt, torch.save'd by rank 0, and its .json: size and CRC-32) was written in two
# config layouts. Up to commit 42fd791 the model was a torchvision ResNet configured by data.* and model.*;
# since the task interface (85e7892) those keys are task.* keys of the built-in image task. Old key -> key:
OLD_KEYS = {
    "data.name": "task.data",
    "data.path": "task.path",
    "data.image_size": "task.image_size",
    "data.num_classes": "task.num_classes",  # what the weights say wins: _today_config
    "data.train_samples": "task.train_samples",
    "data.eval_samples": "task.eval_samples",
    "data.augment": "task.augment",
    "model.name": "task.model",
    "model.small_input": "task.small_input",
    "model.norm": "task.norm",
    "model.sync_bn": "dist.sync_bn",
}
OLD_TASK = "train.tasks.image:ImageClassification"  # the task that the old keys configure
# BatchNorm's buffers (torch.nn's _NormBase): the floating-point tensors of a state dict that are no parameters
BN_BUFFERS = (".running_mean", ".running_var")


def _read_old(path: Path) -> dict:
    """A checkpoint of format 1 (one step_XXXXXXXX.pt and its .json), its CRC checked, loaded weights_only
    (no code in it runs: a file that would need any is refused); raises ValueError saying what is wrong."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        crc = _file_crc(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({_why(e)}): resume from the checkpoint before it, or copy it "
                         f"again from where it was written") from None
    if crc != {"bytes": meta.get("bytes"), "crc32": meta.get("crc32")}:
        why = ("CRC-32 differs" if crc["bytes"] == meta.get("bytes")
               else f"{crc['bytes']} bytes, its .json says {meta.get('bytes')}")
        raise ValueError(f"{path} fails its checksum ({why}): copy it again from where it was written, or remove "
                         f"it and its .json to convert the ones before it")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))  # weights_only's refusal, lines down
        why = f"it names {named.group(1)}, which is no tensor or plain value" if named else _why(e)
        raise ValueError(f"{path} does not load as plain tensors and values ({why}): finish its run with the "
                         f"version of this project that wrote it") from None
    keys = ("format", "model", "optimizer", "step", "data", "rng", "world_size", "config")
    if not isinstance(state, dict) or (missing := [k for k in keys if k not in state]) or state["format"] != 1:
        what = (f"a {type(state).__name__}" if not isinstance(state, dict) else
                f"no {', '.join(missing)}" if missing else f"format {state['format']!r}")
        raise ValueError(f"{path} is no checkpoint of format 1 ({what}): finish its run with the version of this "
                         f"project that wrote it")
    return state


def _today_config(config: dict, model: dict) -> dict:
    """The config of a format-1 checkpoint in today's keys. The layout before the task interface maps by
    OLD_KEYS onto the built-in image task; its class count is the classifier's rows (cifar10 and
    imagefolder runs counted their classes, the config's data.num_classes is the built-in data's).
    Nothing named in it is imported: the result is a record (the resume takes its config from its own
    command line and checks the model's shapes against the checkpoint's)."""
    if "task" in config or not any(k in config for k in ("data", "model")):
        return config  # written since the task interface
    out: dict = {}
    for section, values in config.items():
        for key, value in (values.items() if isinstance(values, dict) else [(None, values)]):
            dotted = section if key is None else f"{section}.{key}"
            target = OLD_KEYS.get(dotted, dotted).split(".")
            node = out
            for part in target[:-1]:
                node = node.setdefault(part, {})
            node[target[-1]] = value
    out.setdefault("task", {})["name"] = OLD_TASK
    if torch.is_tensor(fc := model.get("fc.weight")) and fc.ndim == 2:
        out["task"]["num_classes"] = int(fc.shape[0])
    out["task"] = {"name": out["task"].pop("name"), **out["task"]}
    return out


def _param_names(model: dict, optimizer: dict, path: Path) -> list[str]:
    """The name of each of the optimizer's parameters, by its index in the saved optimizer, found without
    building the model. torch numbers an optimizer's parameters group after group; train/optim.py put
    those of more than one dimension in group 0 and the others in group 1, each in the order of
    model.parameters(), which is their order in the model's state dict, where a tied weight comes twice
    (kept once, by its first name, as parameters() does) and buffers come too: integer ones, and BatchNorm's
    running statistics (dropped). Every momentum or moment tensor must have its parameter's shape."""
    groups = optimizer.get("param_groups", [])
    counts = [len(g["params"]) for g in groups]
    first, seen = [], set()
    for name, t in model.items():
        same = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if not t.is_floating_point() or (t.numel() and same in seen):
            continue
        seen.add(same)
        first.append(name)
    tracked = {k.rsplit(".", 1)[0] for k in model if k.endswith(".num_batches_tracked")}
    params = [k for k in first if not (k.endswith(BN_BUFFERS) and k.rsplit(".", 1)[0] in tracked)]
    ordered = [k for k in params if model[k].ndim > 1] + [k for k in params if model[k].ndim <= 1]
    fits = (len(groups) == 2 and counts == [sum(model[k].ndim > 1 for k in params), sum(model[k].ndim <= 1
            for k in params)] and [i for g in groups for i in g["params"]] == list(range(len(ordered))))
    if fits:
        for i, st in optimizer.get("state", {}).items():
            shapes = {tuple(v.shape) for v in st.values() if torch.is_tensor(v) and v.ndim > 0}
            if not isinstance(i, int) or not 0 <= i < len(ordered) or shapes - {tuple(model[ordered[i]].shape)}:
                fits = False
                break
    if not fits:
        raise ValueError(f"{path}: which of its model's tensors its optimizer's {sum(counts)} parameters are "
                         f"cannot be told from the file (groups of {counts}; the model has {len(params)} "
                         f"candidates: frozen parameters, or buffers other than BatchNorm's?): finish its run "
                         f"with the version of this project that wrote it")
    return ordered


def _named_optimizer(optimizer: dict, names: list[str]) -> dict:
    """A saved optimizer with its parameters named, as get_state_dict gives it (DCP's keys)."""
    return {"state": {names[i]: dict(st) for i, st in optimizer.get("state", {}).items()},
            "param_groups": [g | {"params": [names[i] for i in g["params"]]} for g in optimizer["param_groups"]]}


def convert(directory: Path) -> tuple[list[Path], list[Path]]:
    """Write each format-1 checkpoint of a folder (up to the one `latest` names) as a checkpoint folder of
    this format, in this one process, without building the model or importing anything its config names;
    the .pt and .json files stay. Returns those written, and those already converted (left as they are)."""
    latest = (directory / "latest").read_text().strip() if (directory / "latest").exists() else "~"
    olds = [p for p in _old_checkpoints(directory) if p.name <= latest or not OLD_NAME.match(latest)]
    kept = [directory / p.stem for p in olds if _meta(directory / p.stem).get("converted_from") == p.name]
    todo = [p for p in reversed(olds) if directory / p.stem not in kept]  # `latest` ends at the newest
    for old in todo:  # all of them are checked before any is written: a bad one leaves nothing half done
        state = _read_old(old)
        _param_names(state["model"], state["optimizer"], old)
        del state
    done = []
    for old in todo:
        state = _read_old(old)
        names = _param_names(state["model"], state["optimizer"], old)
        optimizer = _named_optimizer(state["optimizer"], names)
        tensors, rest = _split({"model": dict(state["model"]), "optimizer": optimizer})
        tmp = directory / f".{old.stem}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
        # The step, the data position, each rank's RNG states and loss window, the scaler: as they were
        # (their layout has not changed), so that the resume continues the run bit for bit.
        trainer = {k: v for k, v in state.items() if k not in ("model", "optimizer")} | {
            "format": FORMAT, "rest": rest, "config": _today_config(state["config"], state["model"])}
        _write_atomic(tmp / TRAINER, lambda f, t=trainer: torch.save(t, f))
        extra = {"world_size": state["world_size"], "converted_from": old.name}
        done.append(_publish(directory, tmp, int(state["step"]), _own_files(tmp, 0), extra))
    return done, kept


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m train.checkpoint", description="Convert the checkpoints of an earlier version "
                "of this project (step_XXXXXXXX.pt and .json) into checkpoint folders that this one resumes from.")
    p.add_argument("--convert", metavar="RUN_DIR", required=True, help="a run directory (or its checkpoints/ folder)")
    try:
        run_dir = Path(p.parse_args(argv).convert)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    directory = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    if not _old_checkpoints(directory):
        print(f"error: {run_dir} holds no checkpoint of an earlier version (step_XXXXXXXX.pt and its .json)",
              file=sys.stderr)
        return 2
    try:
        done, kept = convert(directory)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    latest = (directory / "latest").read_text().strip() if (directory / "latest").exists() else "none"
    also = f"; {', '.join(p.name for p in kept)} converted before, left as they are" if kept else ""
    print(f"converted {len(done)} checkpoint(s) in {directory}: {', '.join(p.name for p in done) or 'none'}{also} "
          f"(`latest` names {latest}); the .pt and .json files they came from can be deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
