"""`python -m train.checkpoint --convert RUN_DIR`: the checkpoints of this project before DCP (format 1: one
step_XXXXXXXX.pt and its .json) converted to today's folders, through a written table of old config keys
(OLD_KEYS). No model is built and nothing the files name is imported; every old checkpoint is checked
before any is written, and each refusal is one line, exit 2.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from train.checkpoint.dcp_io import error_text, split_state
from train.checkpoint.storage import (
    FORMAT,
    OLD_NAME,
    TRAINER,
    file_crc,
    old_checkpoints,
    own_files,
    publish,
    read_manifest,
    write_atomic,
)
from train.config import OneLineParser
from train.errors import UsageError

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
        crc = file_crc(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({error_text(e)}): resume from the checkpoint before it, or copy it "
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
        why = f"it names {named.group(1)}, which is no tensor or plain value" if named else error_text(e)
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
    olds = [p for p in old_checkpoints(directory) if p.name <= latest or not OLD_NAME.match(latest)]
    kept = [directory / p.stem for p in olds if read_manifest(directory / p.stem).get("converted_from") == p.name]
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
        tensors, rest = split_state({"model": dict(state["model"]), "optimizer": optimizer})
        tmp = directory / f".{old.stem}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
        # The step, the data position, each rank's RNG states and loss window, the scaler: as they were
        # (their layout has not changed), so that the resume continues the run bit for bit.
        trainer = {k: v for k, v in state.items() if k not in ("model", "optimizer")} | {
            "format": FORMAT, "rest": rest, "config": _today_config(state["config"], state["model"])}
        write_atomic(tmp / TRAINER, lambda f, t=trainer: torch.save(t, f))
        extra = {"world_size": state["world_size"], "converted_from": old.name}
        done.append(publish(directory, tmp, int(state["step"]), own_files(tmp, 0), extra))
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
    if not old_checkpoints(directory):
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
