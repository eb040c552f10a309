"""Weights in and out: `init_from` (the first step's weights from a local Hugging Face folder or from another
run's checkpoint) and the Hugging Face folder that `python -m train.export --format hf` writes.

Reads go through torch.distributed.checkpoint (DCP): its Hugging Face storage reader for safetensors folders,
this project's own reader for its checkpoints. A model spread over the ranks (FSDP2's shards) is read straight
into each rank's shards: no rank holds the whole model. The export reads its checkpoint one output file at a
time and writes each with safetensors' save_file (which writes from the tensors' memory, where DCP's Hugging
Face writer serializes a whole file to bytes first: twice the file), split and named by huggingface_hub's
split_torch_state_dict_into_shards, as transformers' save_pretrained does. The task says how its tensors are
named and laid out in Hugging Face files (Task.hf_model: a key mapping, GPT-2's transposed Conv1D weights, a
vocabulary padded for speed); nothing else is written by hand. Nothing is downloaded: a path is a local folder
(compute nodes have no network; copy the model there first).
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from train.checkpoint.dcp_io import Reader, error_text
from train.checkpoint.resume import shapes, shapes_of, state_mismatch
from train.checkpoint.storage import NAME, complete_checkpoints, fsync_dir, verify
from train.errors import ConfigError, missing_path
from train.hf_format import HFAdapters, HFModel, HFTensor, hf_config, is_hf_folder

KEY = "task.init_from"


def load(model: nn.Module, task, source: str, log) -> None:
    """The weights of `source` (a Hugging Face folder, or a run directory or checkpoint folder of this
    project) into `model`, in place, on every rank; ConfigError in one line when they do not fit, naming the task's
    key that holds `source` (task.init_from; the Hugging Face task's task.path)."""
    option = next((f"task.{f.name}" for f in (fields(task.cfg) if is_dataclass(task.cfg) else ())
                   if getattr(task.cfg, f.name) == source), KEY)
    path = Path(source)
    if is_hf_folder(path):
        hf = task.hf_model(model)
        if hf is None:
            raise ConfigError(f"{option}: {path} is a Hugging Face folder, and task {type(task).__name__} does not say "
                              f"how its model is stored as one (define hf_model(model), train/task.py)")
        hf_config(path, option)
        _load_hf(model, path, hf, option)
        what = "Hugging Face model"
    else:
        path = _checkpoint(path, option)
        _load_checkpoint(model, path, option)
        what = "checkpoint"
    log.info(f"{option}={source}: the first step starts from the weights of the {what} {path}")


def covers(model: nn.Module, task, source: str) -> set[str]:
    """The names of the tensors of `model` (built, on meta or not) that load(model, task, source) writes whole:
    not those it leaves to their init (a padded vocabulary's extra rows, buffers that no file holds). Empty
    where `source` is neither kind of folder (load then says so)."""
    path = Path(source)
    if is_hf_folder(path):
        hf = task.hf_model(model)
        if hf is None:
            return set()
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        return {name for name, spec in hf.tensors.items()
                if name in tensors and (not spec.rows or spec.rows == tensors[name].shape[0])}
    try:
        _checkpoint(path)
    except ConfigError:
        return set()
    return set(model.state_dict().keys())  # _load_checkpoint loads the model's whole state


def _load_hf(model: nn.Module, folder: Path, hf: HFModel, option: str = KEY) -> None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{option}: {folder} holds no *.safetensors file (a pytorch_model.bin folder: load it with "
                          f"transformers and save_pretrained it again, which writes safetensors)")
    _check_files(folder, files, option)
    reader = dcp.HuggingFaceStorageReader(str(folder))
    try:
        metadata = reader.read_metadata().state_dict_metadata
    except Exception as e:
        raise ConfigError(f"{option}: the safetensors files of {folder} do not read ({error_text(e)})") from None
    stored = {k: tuple(md.size) for k, md in metadata.items()}
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    targets: dict[str, torch.Tensor] = {}
    padded: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (the model's tensor, the file's rows, how many)
    for name, spec in hf.tensors.items():
        ours = tensors[name]
        key = spec.name
        if key not in stored and hf.base_prefix and key.startswith(hf.base_prefix):
            key = key[len(hf.base_prefix):]  # files of the base model (GPT2Model's) leave the prefix out
        if key not in stored:
            raise ConfigError(f"{option}: {folder} has no tensor {spec.name} (it has {len(stored)}, e.g. "
                              f"{', '.join(sorted(stored)[:3])}): "
                              f"{hf.missing or 'is it a model of this architecture?'}")
        shape = tuple(ours.shape)
        if spec.transposed:
            shape = shape[::-1]
        if spec.rows:
            shape = (spec.rows, *shape[1:])
        dtype = getattr(getattr(metadata[key], "properties", None), "dtype", None)
        if ours.is_floating_point() and dtype is not None and (not dtype.is_floating_point or dtype.itemsize < 2):
            raise ConfigError(f"{option}: {folder}'s {key} is stored as {str(dtype).removeprefix('torch.')}, not "
                              f"as float32, bfloat16 or float16: a quantized model, whose values mean nothing "
                              f"without their scales; train from the unquantized model's folder")
        if stored[key] != shape:
            raise ConfigError(f"{option}: {folder}'s {key} has the shape {list(stored[key])}, the model's {name} "
                              f"needs {list(shape)}: the model that the task's settings and the folder's config.json "
                              f"make does not fit these files")
        if spec.rows and (spec.rows != ours.shape[0] or isinstance(ours, DTensor)):
            rows = torch.empty(shape, dtype=ours.dtype)  # a row slice of a sharded tensor is no view of it: whole
            padded.append((ours, rows, spec.rows))
            targets[key] = rows
        else:
            targets[key] = ours.t() if spec.transposed else ours  # a view: DCP writes into the model's tensor
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(targets, storage_reader=reader, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is no Exception
        raise ConfigError(f"{option}: {folder} does not load ({error_text(e)})") from None
    with torch.no_grad():
        for ours, rows, n in padded:  # the stored rows; the padding rows keep their initial values
            whole = (ours.full_tensor() if isinstance(ours, DTensor) else ours).detach().to("cpu", copy=True)
            whole[:n] = rows
            if isinstance(ours, DTensor):
                ours.copy_(distribute_tensor(whole.to(ours.device), ours.device_mesh, ours.placements,
                                             src_data_rank=None))
            else:
                ours.copy_(whole)


LFS = b"version https://git-lfs"  # how a git-lfs pointer file begins


def _check_files(folder: Path, files: list[Path], option: str) -> None:
    """The safetensors files that a folder copied in part lacks, named: a git-lfs pointer in a weights file's place
    (a clone without `git lfs pull`), a shard that the index names and the folder does not hold."""
    for f in files:
        with open(f, "rb") as fh:
            if fh.read(len(LFS)) == LFS:
                raise ConfigError(f"{option}: {f} is a git-lfs pointer file, not the weights (a git clone without "
                                  f"git-lfs): run `git lfs pull` in the clone, or copy the folder with `hf download`")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{option}: {index} does not read as a safetensors index ({e})") from None
        missing = sorted(name for name in shards if not (folder / name).is_file())
        if missing:
            raise ConfigError(f"{option}: {folder} lacks {len(missing)} of the {len(shards)} safetensors files that "
                              f"its model.safetensors.index.json names ({', '.join(missing[:3])}): a copy or a "
                              f"download that stopped early; copy the whole folder again")


def _checkpoint(path: Path, option: str = KEY) -> Path:
    """The checkpoint folder that `path` names: itself, or the newest complete one of a run directory."""
    if not path.exists():
        raise missing_path(option, path, "a Hugging Face model folder, or a run directory or checkpoint folder of "
                                         "this project, on this machine: nothing is downloaded")
    if NAME.match(path.name) and path.is_dir():
        return path
    for folder in (path, path / "checkpoints"):
        if folder.is_dir() and (found := complete_checkpoints(folder)):
            return found[0]
    raise ConfigError(f"{option}: {path} is neither a Hugging Face model folder (config.json and *.safetensors) nor a "
                      f"run directory or checkpoint folder of this project")


def _load_checkpoint(model: nn.Module, path: Path, option: str = KEY) -> None:
    """Another run's model weights (not its optimizer, step or data position: this is a new run)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    try:
        verify(path, rank, world)
        metadata = Reader(path).read_metadata()
    except Exception as e:
        raise ConfigError(f"{option}: checkpoint {path} does not load ({error_text(e)})") from None
    state = get_model_state_dict(model)
    mismatch = state_mismatch(shapes_of(state), shapes(metadata, "model"))
    if mismatch is not None:
        raise ConfigError(f"{option}: checkpoint {path} holds another model than this run's: {mismatch}")
    try:
        dcp.load({"model": state}, storage_reader=Reader(path), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        raise ConfigError(f"{option}: checkpoint {path} does not load ({error_text(e)})") from None
    set_model_state_dict(model, state)


# ---------------------------------------------------------------- the folder that train.export writes

INDEX = "model.safetensors.index.json"


@dataclass
class HFExport:
    """What `python -m train.export --format hf` writes, planned (and checked) before anything is written: for
    each tensor of the files, the checkpoint key it comes from (its stored shape and dtype) and how it is laid
    out; the files (transformers' split and names) and their index."""

    config: dict
    tensors: dict[str, tuple[str, HFTensor, torch.Size, torch.dtype, torch.dtype]]  # key: (source, spec, ., ., out)
    files: dict[str, list[str]]  # file name -> its keys
    index: dict | None  # model.safetensors.index.json where there is more than one file
    copied: tuple[str, ...]  # written beside (the tokenizer of the folder the run started from)
    total_size: int
    # --merged: an adapted weight's name -> its adapters' {name: (stored shape, dtype)}, and how they merge into it
    into: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = field(default_factory=dict)
    merge: Callable | None = None


@dataclass
class AdapterExport:
    """What `python -m train.export --format hf` writes for a run that trained adapters (LoRA): their tensors
    (name: stored shape and dtype), written as their library saves them (HFAdapters.save)."""

    adapters: HFAdapters
    tensors: dict[str, tuple[torch.Size, torch.dtype]]
    dtype: torch.dtype | None  # --dtype

    @property
    def total_size(self) -> int:
        return sum(math.prod(shape) * (self.dtype or kept).itemsize for shape, kept in self.tensors.values())


def _stored_adapters(names, model: nn.Module, stored: dict) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The checkpoint's adapter tensors `names` (shape, dtype), checked against the task's model; ValueError."""
    shapes = {name: tuple(t.shape) for name, t in model.named_parameters()}
    found = {}
    for name in names:
        if name not in stored:
            raise ValueError(f"holds no adapter tensor model.{name}, which the task's model has (it holds "
                             f"{len(stored)}, e.g. {', '.join(sorted(stored)[:3])}): a checkpoint of another model")
        if tuple(stored[name][0]) != shapes[name]:
            raise ValueError(f"holds model.{name} of the shape {list(stored[name][0])}, the task's model has "
                             f"{list(shapes[name])}: a checkpoint of another model")
        found[name] = stored[name]
    return found


def adapter_export(hf: HFModel, model: nn.Module, stored: dict, dtype: torch.dtype | None) -> AdapterExport:
    """The export of a run's adapters (hf.adapters) from the checkpoint whose model tensors are `stored`."""
    return AdapterExport(hf.adapters, _stored_adapters(hf.adapters.tensors, model, stored), dtype)


def save_adapters(checkpoint: Path, plan: AdapterExport, out: Path) -> None:
    """The adapters of `checkpoint` (read by DCP: only theirs), cast where --dtype says, written at `out` (a new
    folder) by their library."""
    tensors = {name: torch.empty(tuple(shape), dtype=kept) for name, (shape, kept) in plan.tensors.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({f"model.{k}": v for k, v in tensors.items()}, storage_reader=Reader(checkpoint), no_dist=True)
    if plan.dtype is not None:
        tensors = {k: v.to(plan.dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    plan.adapters.save(tensors, out)


def hf_export(hf: HFModel, model: nn.Module, stored: dict, dtype: torch.dtype | None, max_shard_size: int,
              merged: bool = False) -> HFExport:
    """The export of the checkpoint whose model tensors are `stored` ({name: (shape, dtype)}) as the task's HF
    model `hf` (of `model`, built on meta); ValueError in one line where a key or a shape does not fit: the
    checkpoint against the task's model, the files against what transformers builds from config.json. `merged`:
    the adapters (hf.adapters) added into the weights they adapt."""
    from huggingface_hub import split_torch_state_dict_into_shards

    params = {name for name, _ in model.named_parameters()}
    whole = dict(model.named_parameters()) | dict(model.named_buffers())
    shapes = {name: tuple(t.shape) for name, t in whole.items()}
    tensors, layout = {}, {}
    for name, spec in hf.tensors.items():
        if name not in stored:
            raise ValueError(f"holds no tensor model.{name}, which the task's model has (it holds "
                             f"{len(stored)}, e.g. {', '.join(sorted(stored)[:3])}): a checkpoint of another model")
        shape, kept = stored[name]
        if tuple(shape) != shapes[name]:
            raise ValueError(f"holds model.{name} of the shape {list(shape)}, the task's model has "
                             f"{list(shapes[name])}: a checkpoint of another model")
        out = tuple(shape[::-1]) if spec.transposed else tuple(shape)
        if spec.rows:
            out = (spec.rows, *out[1:]) if not spec.transposed else (*out[:-1], spec.rows)
        cast = dtype if dtype is not None and kept.is_floating_point else kept  # integers and bools keep theirs
        tensors[spec.name] = (name, spec, shape, kept, cast)
        layout[spec.name] = torch.empty(out, dtype=cast, device="meta")
    config = dict(hf.config)
    # transformers 5 reads "dtype" (and "torch_dtype" only where "dtype" is missing), 4.x "torch_dtype": both, so a
    # folder's own "dtype" (a config.json that transformers 5 wrote) does not say float32 over bfloat16 files
    floats = [t.dtype for t in layout.values() if t.is_floating_point()]
    config["dtype"] = config["torch_dtype"] = str(floats[0] if floats else torch.float32).removeprefix("torch.")
    built, order = _check_architecture(config, {k: tuple(t.shape) for k, t in layout.items()})
    layout = {k: layout[k] for k in order} | layout  # transformers' order: its split of the files
    if not (isinstance(config.get("architectures"), list) and config["architectures"]
            and all(isinstance(a, str) for a in config["architectures"])):
        if built is None:
            raise ValueError(f"its config.json names no architectures ({json.dumps(config.get('architectures'))}), "
                             f"and transformers, which would say it, is not installed")
        config["architectures"] = [built]  # null or missing: the class transformers builds from it
    split = split_torch_state_dict_into_shards(layout, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    index = None
    if split.is_sharded:  # as transformers' save_pretrained writes it
        total = sum(layout[k].numel() for k, (name, *_) in tensors.items() if name in params)
        index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
    into = {}
    if merged:
        into = {name: _stored_adapters(names, model, stored) for name, names in hf.adapters.into.items()}
    return HFExport(config=config, tensors=tensors, files=dict(split.filename_to_tensors), index=index,
                    copied=hf.files, total_size=split.metadata["total_size"], into=into,
                    merge=hf.adapters.merge if merged else None)


def _check_architecture(config: dict, files: dict[str, tuple]) -> tuple[str | None, list[str]]:
    """The files' keys and shapes against the model that transformers builds from config.json (on meta: no
    memory), where transformers is installed and knows its model_type: its class name and its state dict's
    order (save_pretrained's), or ValueError in one line; (None, []) where it cannot say."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return None, []
    if config.get("model_type") not in CONFIG_MAPPING:
        return None, []
    transformers.logging.set_verbosity_error()
    try:
        built = transformers.AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(built)
    except Exception as e:
        raise ValueError(f"its config.json builds no model in transformers {transformers.__version__} "
                         f"({error_text(e)})") from None
    expected = {name: tuple(t.shape) for name, t in model.named_parameters()}  # a tied weight once
    for prefix, module in model.named_modules():
        for key, t in module._buffers.items():
            if t is not None and key not in module._non_persistent_buffers_set:
                expected[f"{prefix}.{key}" if prefix else key] = tuple(t.shape)
    what = f"the {type(model).__name__} that transformers builds from its config.json"
    if missing := [k for k in expected if k not in files]:
        raise ValueError(f"would lack {len(missing)} tensor(s) of {what}, e.g. {', '.join(missing[:3])}")
    if extra := [k for k in files if k not in expected]:
        raise ValueError(f"would hold {len(extra)} tensor(s) that {what} does not have, e.g. {', '.join(extra[:3])}")
    if differ := [k for k in files if files[k] != expected[k]]:
        k = differ[0]
        raise ValueError(f"would hold {len(differ)} tensor(s) of other shapes than {what}, e.g. {k} of the shape "
                         f"{list(files[k])} where it has {list(expected[k])}")
    return type(model).__name__, [k for k in model.state_dict(keep_vars=True) if k in files]


def save_hf(checkpoint: Path, plan: HFExport, out: Path) -> None:
    """The planned folder at `out`, a new one (train.export writes it beside its --out, then renames it): one
    safetensors file at a time, its tensors read from the checkpoint by DCP into tensors of the file's layout
    (a transposed view: no copy), cast where --dtype says, written by safetensors, then freed. So the export
    holds one file's tensors (in the checkpoint's dtype) and one stored chunk, whatever the model's size.
    Then the index, config.json and the files the model's folder had beside (its tokenizer)."""
    from safetensors.torch import save_file

    out.mkdir()
    for filename, keys in plan.files.items():
        targets, tensors, adapters = {}, {}, {}
        for key in keys:
            name, spec, shape, kept, _ = plan.tensors[key]
            buf = torch.empty(tuple(shape[::-1]) if spec.transposed else tuple(shape), dtype=kept)
            tensors[key] = buf
            targets[f"model.{name}"] = buf.t() if spec.transposed else buf  # DCP writes into the file's layout
            for adapter, (ashape, akept) in plan.into.get(name, {}).items():  # --merged: read beside it
                adapters.setdefault(name, {})[adapter] = targets[f"model.{adapter}"] = torch.empty(ashape,
                                                                                                   dtype=akept)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(targets, storage_reader=Reader(checkpoint), no_dist=True)
        del targets
        for key in keys:
            name, spec, _, kept, cast = plan.tensors[key]
            t = tensors[key]
            if name in adapters:  # (an adapted layer is stored as the model has it: not transposed, no padding)
                t = plan.merge(name, t, adapters.pop(name))
            if spec.rows:  # the vocabulary's first rows: a view, contiguous
                t = t[:spec.rows] if not spec.transposed else t[..., :spec.rows].contiguous()
            tensors[key] = t.to(cast) if cast != kept else t  # one tensor's copy at a time
        save_file(tensors, out / filename, metadata={"format": "pt"})
        del tensors
        fsync_dir(out / filename)
    if plan.index is not None:
        (out / INDEX).write_text(json.dumps(plan.index, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
    for extra in plan.copied:
        shutil.copy2(extra, out / Path(extra).name)


