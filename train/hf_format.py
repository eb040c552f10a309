"""A model as Hugging Face stores it: which of a task's tensors is which in the safetensors files (HFModel,
HFTensor, given by Task.hf_model; HFAdapters, the adapters trained over it), and what a model folder holds. Read by
init_from (train/checkpoint/pretrained.py) and written by `python -m train.export --format hf`."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from train.errors import ConfigError, missing_path

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HFTensor:
    """Where one of the model's tensors is in a Hugging Face safetensors checkpoint."""

    name: str  # its key in the files
    transposed: bool = False  # stored transposed: GPT-2's Conv1D keeps (in, out) where nn.Linear has (out, in)
    rows: int = 0  # only its first `rows` rows are stored (a vocabulary padded for speed); 0: every row


@dataclass(frozen=True)
class HFAdapters:
    """Adapters (LoRA) trained over a frozen model: their tensors are in none of the model's files. `python -m
    train.export --format hf` writes them as their library saves them, or (--merged) merged into the weights."""

    tensors: tuple[str, ...]  # the model's adapter tensors
    into: dict[str, tuple[str, ...]]  # an adapted weight's name (the model's) -> the adapter tensors merged into it
    merge: Callable[[str, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]  # (name, weight, adapters) -> merged
    save: Callable[[dict[str, torch.Tensor], Path], None]  # the adapters' values -> their library's folder at the path
    about: str = ""  # what they are, for export's line: "LoRA adapters of rank 8 on q_proj, v_proj (4 layers)"


@dataclass
class HFModel:
    """A task's model as a Hugging Face model: config.json (what transformers builds it from) and, for each of the
    model's parameters and persistent buffers, where it is in the files. A tensor left out is not stored (a
    tied weight: lm_head.weight, the embedding's). `base_prefix`: the prefix that files of the base model
    leave out (GPT2Model's files name transformer.wte.weight wte.weight), tried where a name is missing."""

    config: dict
    tensors: dict[str, HFTensor]
    base_prefix: str = ""
    files: tuple[str, ...] = ()  # other files export writes beside (the tokenizer of the folder it came from)
    missing: str = ""  # why a tensor may be missing from a folder of this architecture, where the task knows
    adapters: HFAdapters | None = None  # adapters trained over the model (LoRA), not in its files


# What a model folder holds that an export does not copy: the weights (written anew) and config.json (the task's).
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
NOT_COPIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}


def beside_weights(folder: Path) -> tuple[str, ...]:
    """The files of a Hugging Face folder that an export of a model trained from it copies: its tokenizer, its
    generation_config.json, its README; not its weights nor its config.json (written anew)."""
    return tuple(str(p) for p in sorted(folder.iterdir()) if p.is_file() and not p.name.startswith(".")
                 and p.name not in NOT_COPIED and not p.name.endswith(WEIGHTS))


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder: config.json, or safetensors files (refused later without config.json)."""
    return path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.safetensors")))


def hf_config(folder: Path, key: str = "task.init_from") -> dict:
    """A Hugging Face folder's config.json, or a ConfigError naming what is missing."""
    if not folder.exists():
        raise missing_path(key, folder, "a Hugging Face model folder, copied to this machine: nothing is downloaded")
    if not folder.is_dir():
        raise ConfigError(f"{key}: {folder} is not a folder (a Hugging Face model folder, copied to this machine: "
                          f"nothing is downloaded)")
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"{key}: {folder} has no config.json: a Hugging Face model folder holds config.json and "
                          f"*.safetensors, as save_pretrained writes them")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path} does not read as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{key}: {path} is not a JSON object")
    quantized = config.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "") if isinstance(quantized, dict) else ""
        raise ConfigError(f"{key}: {folder} holds a quantized model ({method or 'quantization_config'} in its "
                          f"config.json), whose weights mean nothing without their scales: train from the "
                          f"unquantized model's folder (bf16 or fp32 safetensors)")
    return config
