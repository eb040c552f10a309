"""The task interface: your model, data, loss and metrics, in one file of yours.

    task:
      name: examples/regression.py:Regression   # a file path or a module (my_pkg.tasks:Regression)
      hidden: 64                                # your own keys: the fields of Regression.Config

A task is a subclass of `Task` with three methods it must have (datasets, model, loss) and a few it may
override. The trainer does everything else for any task, without the task doing anything for it: DDP and
accumulation (no_sync), AMP (bf16, fp16 with a GradScaler), clipping, checkpoints with exact resume
mid-epoch (the data position and every RNG), stops and requeues, elastic world sizes (each sample once an
epoch), W&B, metrics.jsonl, the report, the doctor, and every launcher.

What the trainer asks of a task, and only that:
- `datasets()`: (train, eval), map-style: `len(ds)` and `ds[i]`, an item that `collate` batches (by default:
  tensors of one size, numbers, strings, or tuples/dicts of them). Random augmentation may draw from torch,
  random and numpy freely: the trainer seeds those from (seed, epoch, index) around each `ds[i]`, so a resumed
  run, any number of loader workers and any world size see the same sample. Built on every rank: keep it cheap
  (memory-map big files, as the language model's token shards do).
- `model()`: an `nn.Module`, built on the CPU with torch's global RNG already seeded (the same weights on
  every rank); the trainer moves it to the device and wraps it. Or built on the meta device (`with
  torch.device("meta"):`, no memory: a model larger than one device, or than a host's memory times its
  ranks): the trainer shards it first (FSDP2), gives each rank's shard its memory, and fills it with
  `init_parameter`, or with pretrained weights (`init_from`).
- `loss(model, batch)`: the mean loss of a micro-batch already on the device, a scalar tensor; run under
  autocast; the trainer scales, accumulates and steps. With `count` (below): the SUM over the batch's counted
  targets instead.
- optional `count(batch)`: how many targets a micro-batch counts (a language model's unmasked tokens), a tensor,
  from the batch alone (as the loader yields it, on the host); None: the loss is a per-sample mean. Where it is
  a count, a step's loss is the sum over all its counted targets (all micro-batches, all ranks) divided by their
  number: the same whatever the world size and the micro-batch split.
- optional `collate(items)`: how a micro-batch's items (a list of what `ds[i]` returns) make one batch, for
  training and evaluation alike: padding, packing, masks (items of different sizes: token sequences, audio,
  boxes). Default: torch's default_collate, which stacks them; items that differ in size are then one line
  naming where (a key, a tuple position). It runs in the loader workers: the task object is pickled to them.
- optional `units(batch)`: how many `unit`s (tokens) a batch holds that are not padding: what throughput and MFU
  count, the log showing the padding share.
- optional `blocks(model)`: the model's repeated submodules, for FSDP and activation checkpointing.
- optional `param_groups(model)`: how the parameters train: groups with a learning-rate multiplier (`lr_scale`)
  and a weight decay of their own (a head at 10x the rate). A parameter frozen in model() (requires_grad=False)
  does not train at all: no gradient is reduced for it, and the optimizer holds no state for it.
- optional `init_parameter(name, full, generator)`: a meta-built model's initial values, one tensor at a
  time, drawn from `generator` alone: the same seed gives the same weights whatever the strategy and the
  world size (every rank draws each whole tensor and keeps its shard).
- optional `init_from()`: pretrained weights for the first step (a local Hugging Face folder, or another
  run's checkpoint): `task.init_from` where the task has that key. A run's own checkpoints come first.
- optional `hf_model(model)`: how the model is stored as a Hugging Face model (its config.json, each
  tensor's name and layout in the safetensors files): `init_from` a HF folder and `python -m train.export
  --format hf` read it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from train.errors import ConfigError
from train.hf_format import HFAdapters, HFModel, HFTensor  # noqa: F401  (a task's hf_model() builds them: train.task's names)

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

class Task:
    """Subclass it in a file of yours; see the module's text for what each method is asked for."""

    @dataclass
    class Config:
        """The task's own keys (task.<key>): typed and checked like every other key. Override it."""

    unit = "samples"  # what throughput counts: "images", "tokens"
    # What a relaunch of a run does when one of the task's keys changes (train/relaunch.py, docs/reference.md):
    # "applied" (nothing trained changes), "training" (from the resumed step), "data" (the new data from its
    # beginning) or "refused" (another model: a new run). A key not listed is refused.
    relaunch: dict[str, str] = {}
    # What a run recorded before a key existed did, by key, where the key's default does otherwise: a relaunch
    # compares a record without the key with this value, not with the default (train/relaunch.py).
    legacy: dict[str, Any] = {}

    def __init__(self, cfg: Any, seed: int):
        self.cfg, self.seed = cfg, seed  # cfg: an instance of this class's Config, filled from task.*

    def check(self) -> None:
        """Range checks on self.cfg beyond their types: raise ConfigError("task.<key>: ...")."""

    def datasets(self) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def model(self) -> nn.Module:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def count(self, batch: Any) -> torch.Tensor | None:
        """How many targets `batch` counts (a scalar tensor, from the batch alone: the trainer calls it on the batch
        as the loader yields it, before it goes to the device), where loss() returns the SUM over them: the trainer
        then divides the step's gradients by the count over the whole step (all micro-batches, all ranks), and the
        logged loss is the step's sum over that count. None (the default): loss() is the batch's per-sample mean,
        and micro-batches are weighted by their samples."""
        return None

    def collate(self, items: list) -> Any:
        """One batch of a micro-batch's items (`ds[i]` of each), for training and evaluation alike: pad, pack,
        build masks. The trainer moves what it returns (tensors, or tuples, lists and dicts of them) to the
        device and hands it to loss() and eval_step(). It runs in the loader workers (data.num_workers > 0),
        which unpickle the task: keep what it holds picklable. Default: torch's default_collate, which stacks
        tensors of one size."""
        return default_collate(items)

    def eval_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor | float]:
        """Sums over one evaluation batch, and "count": what they are averaged over. The trainer sums them
        over all batches and ranks and logs eval_<key> = sum / count. Default: the loss per sample; with count():
        the summed loss and the batch's count (the loss per counted target over the whole evaluation)."""
        if (counted := self.count(batch)) is not None:
            return {"loss": self.loss(model, batch).float(), "count": counted}
        n = int(first_tensor(batch).shape[0])
        return {"loss": self.loss(model, batch).float() * n, "count": n}

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        """Metrics derived from the averaged ones (a perplexity from the loss); default: as they are."""
        return means

    def units_per_sample(self) -> int:
        """How many `unit`s one sample holds (a window of 1024 tokens: 1024)."""
        return 1

    def units(self, batch: Any) -> int | torch.Tensor | None:
        """How many `unit`s a training batch holds that are not padding (packed windows' tail), from the batch as the
        loader yields it (on the host); None (the default): units_per_sample() a sample. Throughput and MFU count
        these, and the log shows the padding share."""
        return None

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's repeated parts (a transformer's blocks, a ResNet's stages): each is an FSDP unit
        (dist.strategy=fsdp or hsdp) and what train.activation_checkpointing recomputes. Default: none (FSDP
        shards the model as one unit, gathered whole for its forward)."""
        return []

    def param_groups(self, model: nn.Module) -> list[dict]:
        """How `model`'s parameters train, beside the default (the schedule's rate, optim.weight_decay): a list of
        groups, each a dict with
        - "name": a word, its rate's name in the log and metrics (lr_<name>);
        - "params": which parameters: names or fnmatch patterns as model.named_parameters() gives them ("head.*"),
          the model's parameters themselves, or a function of the name; a parameter in one group at most;
        - "lr_scale" (default 1): its rate is the schedule's times this;
        - "weight_decay" (default optim.weight_decay): for its matrices and kernels; its biases and norm scales
          (1 dimension) take none, as in the default group.
        The parameters no group names are the group "default". One frozen in model() (requires_grad=False) trains
        in no group. `model` is the model as it trains (sharded under FSDP: the names are the same). A relaunch
        whose groups changed applies them from the resumed step: each parameter keeps its optimizer state, one
        that trains again starts afresh (docs/tasks.md). Default: none."""
        return []

    def flops_per_sample(self, model: nn.Module) -> float | None:
        """Forward + backward FLOPs of one training sample, for MFU on GPUs. None: counted by torch's
        FlopCounterMode on one batch of two samples (override it where that is wrong or slow)."""
        return None

    def init_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """For a model built on the meta device: fill `full`, a CPU tensor of the whole shape of the parameter
        or buffer `name` (as model.named_parameters() and named_buffers() name it), in place, as the model's
        own init would, drawing random numbers from `generator` only. The trainer calls it once per tensor in
        the model's order, on every rank, and keeps each rank's shard. Buffers too: after the meta build they
        hold nothing (a rotary embedding's frequencies)."""
        raise ConfigError(f"task {type(self).__name__} builds its model on the meta device: define "
                          f"init_parameter(name, full, generator) to give it its initial values (train/task.py)")

    def init_from(self) -> str:
        """Where the first step's weights come from: a local Hugging Face model folder (config.json and
        *.safetensors), or another run's checkpoint (a run directory or a step folder); "": the model's own
        init. Default: the task's `init_from` key, where it has one."""
        return getattr(self.cfg, "init_from", "") or ""

    @classmethod
    def recorded(cls, cfg: Any, run: dict) -> None:
        """A relaunch in a run directory that has a config.yaml: `run` is the task section it recorded (the keys
        of the launch before), `cfg` this launch's task keys, to complete in place with what this launch cannot
        work out again (the built-in GPT: the sizes it read from an init_from folder moved since). Default:
        nothing."""

    def hf_model(self, model: nn.Module) -> HFModel | None:
        """How `model` (built by model(), possibly on meta) is stored as a Hugging Face model; None: it is not
        (init_from a HF folder and export --format hf then say so in one line)."""
        return None


def default_collate(items: list, task: str | None = None) -> Any:
    """torch's default_collate; where it fails because the items differ in size, a ConfigError that says where
    (the key or tuple position, the two sizes) and what to define. `task`: the task's name, for the message."""
    from torch.utils.data import default_collate as stack

    try:
        return stack(items)
    except Exception:
        try:
            found = _where_sizes_differ(items, ())
        except Exception:
            found = None
        if found is None:
            raise
        path, sizes = found
        where = f" at {', '.join(path)}" if path else ""
        raise ConfigError(f"{f'task {task}: ' if task else ''}the items of a batch differ in size{where} ({sizes}), "
                          f"and the default collate stacks them: define collate(self, items) in the task to pad, "
                          f"pack or mask them (docs/tasks.md)") from None


def _where_sizes_differ(items: list, path: tuple[str, ...]) -> tuple[tuple[str, ...], str] | None:
    """The first place, depth first, where a batch's items differ in size: (the keys and positions that lead
    there, the sizes of item 0 and of the first item that differs), or None."""
    first = items[0]
    if hasattr(first, "shape") and hasattr(first, "dtype"):  # tensors and numpy arrays
        shapes = [tuple(getattr(item, "shape", ())) for item in items]
        other = next((i for i, shape in enumerate(shapes) if shape != shapes[0]), None)
        return None if other is None else (path, f"shape {shapes[0]} in item 0, {shapes[other]} in item {other}")
    if isinstance(first, Mapping):
        for key in first:
            if all(isinstance(item, Mapping) and key in item for item in items):
                if found := _where_sizes_differ([item[key] for item in items], (*path, f"key {key!r}")):
                    return found
        return None
    if isinstance(first, Sequence) and not isinstance(first, (str, bytes)):
        kind = "tuple" if isinstance(first, tuple) else "list"
        lengths = [len(item) for item in items]
        other = next((i for i, n in enumerate(lengths) if n != lengths[0]), None)
        if other is not None:
            return path, f"{kind} length {lengths[0]} in item 0, {lengths[other]} in item {other}"
        for j in range(len(first)):
            if found := _where_sizes_differ([item[j] for item in items], (*path, f"{kind} position {j}")):
                return found
    return None


def collate_fn(task: Task, name: str) -> Callable[[list], Any]:
    """What the loaders batch the task's items with: its own collate(), or for a task without one the default
    (naming the task), a function of this module: the loader workers are then sent no task object."""
    if type(task).collate is Task.collate:
        return functools.partial(default_collate, task=name)
    return task.collate


def first_tensor(batch: Any) -> torch.Tensor:
    """The first tensor of a collated batch (a tensor, or tuples, lists and dicts of them, in order, depth
    first): its length is the batch's, its device the batch's. What is not a tensor is passed over: the
    default collate makes a list of a batch's strings, and a string's first element is itself."""
    pending = [batch]
    while pending:
        item = pending.pop()
        if hasattr(item, "shape"):
            return item
        if isinstance(item, dict):
            pending.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            pending.extend(reversed(item))
    raise ConfigError(f"a batch of {type(batch).__name__} holds no tensor: the default eval_step() counts a "
                      f"batch's samples by its first tensor; define eval_step() in the task")
