"""Typed configuration: defaults < YAML file < command-line overrides.

Every key lives in a dataclass below; the YAML files in configs/ mirror them. Unknown keys, values of
the wrong type and values out of range raise ConfigError, which the entry point turns into a one-line
message and exit code 2 before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import socket
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from train.errors import ConfigError, UsageError  # here too: where every caller has always found them


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage block + error line -> one line
        raise UsageError(f"{message} (see {self.prog} --help)")


@dataclass
class RunConfig:
    name: str = "default"  # the run's name: its folder is runs/<name>
    dir: str = ""  # empty: runs/<name>


@dataclass
class DataConfig:
    """How the task's data sets are loaded (what they hold is the task's: task.*)."""

    num_workers: int = 2  # loader worker processes per rank (0: load in the training process)
    pin_memory: bool = True  # only used with CUDA
    persistent_workers: bool = True  # keep the workers between epochs
    prefetch_factor: int = 2  # micro-batches each worker loads ahead


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = 0.1  # peak learning rate, reached after warmup_steps
    momentum: float = 0.9  # sgd
    nesterov: bool = False  # sgd
    beta1: float = 0.9  # adamw
    beta2: float = 0.999  # adamw
    weight_decay: float = 5e-4  # not applied to biases and norm weights
    warmup_steps: int = 0  # linear warm-up from 0 to lr over these steps, then cosine decay
    min_lr_ratio: float = 0.0  # cosine decay ends at lr * min_lr_ratio
    fused: Literal["auto", True, False] = "auto"  # fused kernels; auto: every parameter on a GPU (fp16 SGD: not)


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps of the whole run
    global_batch_size: int = 64  # samples a step over all ranks: the same run on any world size that divides it
    micro_batch_size: int = 32  # at most this many a forward pass: a rank's share runs in the fewest such micro-batches
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    grad_clip: float = 0.0  # max global grad norm, 0 disables
    log_every: int = 10  # steps between log lines (loss, throughput)
    eval_every: int = 0  # 0: only at the end
    channels_last: bool = False  # images in channels_last memory format (faster convolutions on GPUs)
    compile: bool = False  # torch.compile the model with the task's loss (DDP: the DDP module)
    tf32: bool = True  # TF32 matmuls and convolutions on GPUs that have them
    deterministic: bool = False  # deterministic kernels (slower on GPU; CPU is deterministic anyway)
    activation_checkpointing: bool = False  # recompute each of the task's blocks in the backward (less memory)


@dataclass
class DistConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA, gloo on CPU
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"  # fsdp: FSDP2 per block and at the root; hsdp: fsdp in groups
    shard_size: int = 0  # hsdp: ranks a group shards over, a replica per group (0: a node's ranks)
    reshard_after_forward: bool = True  # fsdp, hsdp: free the gathered parameters after each block's forward
    timeout_s: float = 600.0  # init and collectives; a hung rank fails the job after this
    bucket_cap_mb: float = 25.0  # ddp: gradient all-reduce bucket size
    gradient_as_bucket_view: bool = True  # ddp: gradients are views of the buckets (less memory)
    static_graph: bool = False  # ddp: the same graph every step (lets DDP skip some work)
    find_unused_parameters: bool = False  # ddp: allow parameters that get no gradient in a step (slower)
    sync_bn: bool = False  # BatchNorm statistics over all ranks (torch's SyncBatchNorm; CUDA only)


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end and on a stop signal)
    keep: int = 2  # keep the last N checkpoints (at least 2)
    keep_every: int = 0  # also keep every K-th step for good (0: none)
    async_: bool = False  # YAML/CLI key: checkpoint.async; write in the background (copied during the next step)
    threads: int = 8  # files each rank writes at once (DCP's thread_count), one per 16 MiB at most
    signal: Literal["SIGTERM", "SIGUSR1", "SIGUSR2"] = "SIGTERM"  # save and exit 75 ("requeue me") on it
    memory_every: int = 0  # copy the state to host memory every N steps: a crash loses at most N (0: off)
    memory_dir: str = "/dev/shm"  # where those copies live: host memory that outlives a worker (a tmpfs)


@dataclass
class WandbConfig:
    mode: Literal["offline", "online", "disabled"] = "offline"  # offline: files in <run_dir>/wandb, `wandb sync` later
    project: str = "ddp-template"  # the W&B project
    entity: str = ""  # empty: the default entity of the API key
    tags: str = ""  # comma-separated: "baseline,resnet18"
    group: str = ""  # groups runs in the UI (a sweep, an ablation)


@dataclass
class LogConfig:
    progress_bar: Literal["auto", "always", "never"] = "auto"  # rank 0's tqdm bar; auto: when stdout is a terminal
    straggler_threshold: float = 1.25  # warn when the slowest rank needs this many times the fastest's time
    report: bool = True  # report.png and report.txt in the run directory at the end
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ProfileConfig:
    enabled: bool = False  # torch.profiler trace of a few steps into <run_dir>/profile/ (every rank)
    wait: int = 5  # steps skipped first (counted from the first step of this process)
    warmup: int = 2  # steps traced but discarded
    active: int = 3  # steps recorded
    memory: bool = False  # also record tensor allocations (larger trace)


@dataclass
class Config:
    seed: int = 0  # data order, augmentation and initial weights
    resume: str = "auto"  # auto | never | PATH
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # task.name picks the Task class (train/task.py); its Config holds the other task.* keys. Set by load().
    task_name: str = ""
    task: Any = None
    task_class: Any = None

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")

    def micro_batches(self, world_size: int) -> list[int]:
        """The sizes of a rank's micro-batches in one step: its share of the global batch (global / world size)
        in the fewest forward passes of at most train.micro_batch_size, as even as can be (they differ by at
        most one sample), so a compiled model sees one or two shapes."""
        share = self.train.global_batch_size // world_size
        n = -(-share // self.train.micro_batch_size)
        size, extra = divmod(share, n)
        return [size + 1] * extra + [size] * (n - extra)


# ---------------------------------------------------------------- key names and (de)serialisation

def _key(f: dataclasses.Field) -> str:
    """The name a field has in YAML and on the command line (`async_` is `async`)."""
    return f.name.rstrip("_")


TASK_FIELDS = ("task_name", "task", "task_class")  # Config's fields that the task section fills (below)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if cls is Config and f.name in TASK_FIELDS:
            continue
        name = prefix + _key(f)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _all_keys(hints[f.name], name + ".")
        else:
            keys.append(name)
    return keys


def _unknown(key: str, prefix: str, obj: Any) -> ConfigError:
    valid = _all_keys(Config) + ["task.name"]
    if prefix.startswith("task."):
        valid += _all_keys(type(obj), "task.")
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    if not near:  # fall back to the keys of the same section
        near = [k for k in valid if k.startswith(prefix)][:5] if prefix else []
    hint = f" (did you mean {', '.join(repr(k) for k in near)}?)" if near else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


class _Typed(str):
    """A command-line value: the text as typed, and YAML's reading of it (.parsed). A key of type str (or of a
    choice of strings) takes the text: run.name=007 is '007', log.wandb.mode=off is 'off' (YAML 1.1: 7, False)."""

    def __new__(cls, text: str, parsed: Any):
        self = super().__new__(cls, text)
        self.parsed = parsed
        return self


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check one value against its annotated type; ints are accepted for floats, nothing else is."""
    if isinstance(value, _Typed):
        text_wanted = tp is str or (typing.get_origin(tp) is Literal
                                    and all(isinstance(c, str) for c in typing.get_args(tp)))
        value = str(value) if text_wanted else value.parsed
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if not any(value == c and type(value) is type(c) for c in choices):  # 1 is not True
            names = [str(c).lower() if isinstance(c, bool) else str(c) for c in choices]  # as YAML writes them
            near = difflib.get_close_matches(str(value), names, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(names)}{hint}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # no key means anything by inf or nan: a run would train on NaNs
                raise ConfigError(f"{key} must be a finite number, got {value}")
            return number
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")


def _merge(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    fields = {_key(f): f for f in dataclasses.fields(obj) if not (isinstance(obj, Config) and f.name in TASK_FIELDS)}
    for k, v in data.items():
        key = prefix + str(k)
        if k not in fields:
            while isinstance(v, dict) and v:  # name the whole key the user wrote: trian.steps
                k, v = next(iter(v.items()))
                key += f".{k}"
            raise _unknown(key, prefix, obj)
        f = fields[k]
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            _merge(getattr(obj, f.name), v, key + ".")
        else:
            setattr(obj, f.name, _coerce(key, v, tp))


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = data.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"'{dotted}': '{p}' is not a section")
        data = node
    data[parts[-1]] = value


def to_dict(obj: Any) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        if isinstance(obj, Config) and f.name in TASK_FIELDS:
            continue
        v = getattr(obj, f.name)
        out[_key(f)] = to_dict(v) if dataclasses.is_dataclass(v) else v
    if isinstance(obj, Config):
        out["task"] = {"name": obj.task_name} | (to_dict(obj.task) if obj.task is not None else {})
    return out


def _set_task(cfg: Config, sections: list[Any]) -> None:
    """The task section: task.name (the last one given) picks the Task class, whose Config then takes the
    other task.* keys, the file's first and the command line's over them."""
    from train.task_loader import DEFAULT, load_class  # imports the task's module (a user's file: torch)

    sections = [{"name": s} if isinstance(s, str) else ({} if s is None else s) for s in sections]
    for s in sections:
        if not isinstance(s, dict):
            raise ConfigError(f"task: expected a mapping (task.name and the task's keys), got {s!r}")
    name = next((str(s["name"]) for s in reversed(sections) if "name" in s), DEFAULT)
    cfg.task_name, cfg.task_class = name, load_class(name)
    cfg.task = cfg.task_class.Config()
    # A section that names another task (the YAML file's, when the command line picks a task of its own)
    # holds that task's keys: they are left out, with those of every section before it.
    last_other = max((i for i, s in enumerate(sections) if "name" in s and str(s["name"]) != name), default=-1)
    for s in sections[last_other + 1:]:
        _merge(cfg.task, {k: v for k, v in s.items() if k != "name"}, "task.")


def from_dict(data: dict) -> Config:
    """Rebuild a Config from to_dict() output (a checkpoint's or a run directory's config)."""
    cfg = Config()
    data = dict(data)
    task = data.pop("task", {})
    _merge(cfg, data)
    _set_task(cfg, [task])
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- loading and validation

def parse_args(argv: list[str] | None, prog: str = "python -m train",
               description: str = "Train: `python -m train --config configs/X.yaml key.sub=value ...`, the one way to "
                                  "start training (under torchrun, any launcher).") -> argparse.Namespace:
    """The command line of `python -m train` (train/__main__.py), which the launcher and the doctor take too."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                epilog="Every key, its default and what a relaunch does with a changed value: "
                                       "docs/reference.md.")
    p.add_argument("--config", help="YAML file (default: configs/default.yaml)", default="configs/default.yaml")
    p.add_argument("--check", action="store_true", help="validate the config, print it resolved, and exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    return p.parse_args(argv)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in a mapping (PyYAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' given twice, first on line {seen[key] + 1}: keep one",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load(path: str | None, overrides: list[str], task: bool = True) -> Config:
    """Defaults, then the YAML file, then `key.sub=value` overrides (values parsed as YAML scalars, except that a
    key of type str takes the text as typed). With task=False the task section is left out, unchecked (its
    module, a user's file, imports torch): what the launcher checks itself before torchrun, whose process checks
    the rest (train/launch/torchrun.py)."""
    cfg = Config()
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a folder, not a file: name a YAML file in it") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"cannot read config file {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
                              f"offset {e.start}): a config is a YAML text file, saved as UTF-8") from None
        except PermissionError:
            raise ConfigError(f"cannot read config file {path}: permission denied for uid {os.getuid()}: make it "
                              f"readable (chmod a+r) or copy it to a file this user can read") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
        try:
            data = yaml.load(text, _UniqueKeyLoader) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    else:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {data!r}")
    file_task = data.pop("task", {}) if isinstance(data, dict) else {}
    _merge(cfg, data)
    cli: dict = {}
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override '{item}' is not of the form key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if not isinstance(value, dict):  # a mapping ({steps: 3}) is a section's keys; anything else keeps its text
            value = _Typed(raw, value)
        _set_dotted(cli, key.strip(), value)
    cli_task = cli.pop("task", {})
    _merge(cfg, cli)
    if task:
        _set_task(cfg, [file_task or {}, cli_task])
        _recorded(cfg)
    validate(cfg)
    return cfg


def _recorded(cfg: Config) -> None:
    """A relaunch: the task completes its keys with what the run recorded in its config.yaml (Task.recorded)."""
    try:
        run = yaml.safe_load((cfg.run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):  # no run yet (or no readable record): nothing to complete
        return
    section = run.get("task") if isinstance(run, dict) else None
    if isinstance(section, dict) and section.get("name") == cfg.task_name:
        cfg.task_class.recorded(cfg.task, section)


def make_run_dir(run_dir: Path) -> None:
    """Create the run directory and prove it writable, or raise ConfigError with the fix in one line.
    A volume the pod's user cannot write (an NFS ReadWriteMany PVC ignores the pod's fsGroup; a folder
    made by root on a shared file system) otherwise fails much later, with a traceback from every rank,
    and under torchrun as a crash it would restart."""
    probe = run_dir / f".writable.{socket.gethostname()}.{os.getpid()}"
    if file := next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None):
        raise ConfigError(f"the run directory {run_dir} cannot be made: {file} is a file, not a folder; choose another "
                          f"with run.dir=...")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.touch()  # mkdir succeeds on an existing folder without checking it is writable
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"the run directory {run_dir} is not writable by uid {os.getuid()} gid {os.getgid()} "
            f"({e.strerror or e}): chown/chmod it for that uid (on Kubernetes: the pod's fsGroup, which most NFS "
            f"ReadWriteMany volumes ignore, or an initContainer that chowns it), or choose another with run.dir=..."
        ) from None


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def wandb_tags(w: WandbConfig) -> list[str]:
    return [t.strip() for t in w.tags.split(",") if t.strip()]


def _validate_observability(cfg: Config) -> None:
    lg, w, p = cfg.log, cfg.log.wandb, cfg.profile
    _require(lg.straggler_threshold >= 1,
             f"log.straggler_threshold must be >= 1 (slowest / fastest rank), got {lg.straggler_threshold}")
    if w.mode != "disabled":
        bad = set("/\\#?%:") & set(w.project)
        _require(bool(w.project.strip()) and not bad,
                 f"log.wandb.project must be a non-empty name without / \\ # ? % :, got {w.project!r}")
        long = [t for t in wandb_tags(w) if len(t) > 64]
        _require(not long, f"log.wandb.tags: a tag is at most 64 characters, got {long[0]!r}" if long else "")
    _require(p.wait >= 0 and p.warmup >= 0, f"profile.wait and profile.warmup must be >= 0, got {p.wait}, {p.warmup}")
    _require(p.active >= 1, f"profile.active must be >= 1, got {p.active}")


def _batch_split_error(batch: int, world_size: int) -> str:
    """The one line for a global batch that does not split evenly over the ranks, with the nearest fixes."""
    below = max(w for w in range(1, world_size) if batch % w == 0)
    above = next((w for w in range(world_size + 1, 2 * batch + 1) if batch % w == 0), None)
    worlds = f"{below} or {above} ranks" if above else f"{below} ranks"
    lower, higher = batch // world_size * world_size, (batch // world_size + 1) * world_size
    batches = f"{lower} or {higher}" if lower else f"{higher}"
    return (f"train.global_batch_size={batch} does not split evenly over {world_size} ranks (each rank takes an "
            f"equal share of every step): run {worlds}, or set train.global_batch_size={batches} "
            f"(a multiple of {world_size})")


def shard_ranks(cfg: Config, world_size: int, per_node: int) -> int:
    """The ranks each parameter is spread over: none but its own under DDP, every rank under FSDP, a group of
    dist.shard_size (0: a node's `per_node`) under HSDP, whose world holds world_size / that many replicas."""
    strategy = cfg.dist.strategy
    return 1 if strategy == "ddp" else world_size if strategy == "fsdp" else cfg.dist.shard_size or per_node


def _shard_split_error(shard: int, world_size: int, per_node: bool) -> str:
    """The one line for HSDP groups that do not split the world, with the group sizes that do."""
    size = f"0 (the ranks of a node, {shard} here)" if per_node else f"{shard}"
    fits = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0)
    return (f"dist.shard_size={size} does not divide the {world_size} ranks (dist.strategy=hsdp shards the model "
            f"within groups of that many ranks, a replica per group): run a multiple of {shard} ranks, or set "
            f"dist.shard_size to one of {fits}")


def validate(cfg: Config, world_size: int | None = None, per_node: int | None = None) -> None:
    """Range checks; with world_size, also the batch arithmetic of that world, and with per_node (the ranks of a
    node) or a set dist.shard_size, HSDP's groups in it."""
    t, d, o, c = cfg.train, cfg.data, cfg.optim, cfg.checkpoint
    _require(t.steps > 0, f"train.steps must be > 0, got {t.steps}")
    _require(t.micro_batch_size > 0, f"train.micro_batch_size must be > 0, got {t.micro_batch_size}")
    _require(t.global_batch_size > 0, f"train.global_batch_size must be > 0, got {t.global_batch_size}")
    _require(t.log_every > 0, f"train.log_every must be > 0, got {t.log_every}")
    _require(t.eval_every >= 0, f"train.eval_every must be >= 0, got {t.eval_every}")
    _require(t.grad_clip >= 0, f"train.grad_clip must be >= 0, got {t.grad_clip}")
    _require(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    _require(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _require(0 <= o.momentum < 1, f"optim.momentum must be in [0, 1), got {o.momentum}")
    _require(not (o.fused is True and o.name == "sgd" and o.momentum > 0 and cfg.train.precision == "fp16"),
             "optim.fused=true with SGD's momentum and train.precision=fp16: torch's fused SGD updates its momentum on "
             "the steps fp16's loss scaling skips (the loss turns NaN after the first overflow); set optim.fused=auto "
             "(which does not fuse it there) or use train.precision=bf16")
    _require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _require(d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
    _require(d.prefetch_factor > 0, f"data.prefetch_factor must be > 0, got {d.prefetch_factor}")
    _require(cfg.dist.timeout_s > 0, f"dist.timeout_s must be > 0, got {cfg.dist.timeout_s}")
    _require(cfg.dist.bucket_cap_mb > 0, f"dist.bucket_cap_mb must be > 0, got {cfg.dist.bucket_cap_mb}")
    for key in ("static_graph", "find_unused_parameters"):
        _require(cfg.dist.strategy == "ddp" or not getattr(cfg.dist, key),
                 f"dist.{key} is a DDP option: it has no meaning with dist.strategy={cfg.dist.strategy}")
    _require(cfg.dist.shard_size >= 0,
             f"dist.shard_size must be >= 0 (0: the ranks of a node), got {cfg.dist.shard_size}")
    _require(cfg.dist.strategy == "hsdp" or not cfg.dist.shard_size,
             f"dist.shard_size is an HSDP option: it has no meaning with dist.strategy={cfg.dist.strategy}")
    _require(c.every >= 0, f"checkpoint.every must be >= 0, got {c.every}")
    _require(c.keep >= 2, f"checkpoint.keep must be >= 2, got {c.keep}")
    _require(c.keep_every >= 0, f"checkpoint.keep_every must be >= 0, got {c.keep_every}")
    _require(c.threads >= 1, f"checkpoint.threads must be >= 1, got {c.threads}")
    _require(c.memory_every >= 0, f"checkpoint.memory_every must be >= 0 (0: off), got {c.memory_every}")
    _require(bool(cfg.run.name) and "/" not in cfg.run.name,
             f"run.name must be a non-empty name without '/', got {cfg.run.name!r}")
    _validate_observability(cfg)
    if cfg.task_class is not None:
        cfg.task_class(cfg.task, cfg.seed).check()
        from train.task import Task

        _require(not t.activation_checkpointing or cfg.task_class.blocks is not Task.blocks,
                 f"train.activation_checkpointing: task {cfg.task_name} names no blocks to recompute "
                 "(define its blocks(model): see train/task.py)")
    if world_size is not None:
        if t.global_batch_size % world_size:
            raise ConfigError(_batch_split_error(t.global_batch_size, world_size))
        if cfg.dist.strategy == "hsdp" and (cfg.dist.shard_size or per_node):
            shard = shard_ranks(cfg, world_size, per_node or 0)
            if world_size % shard:
                raise ConfigError(_shard_split_error(shard, world_size, not cfg.dist.shard_size))
