"""A Hugging Face causal language model (any transformers AutoModelForCausalLM: Llama, Qwen2, Mistral, GPT-2, ...)
from a local folder, fine-tuned on token shards.

    task:
      name: train.tasks.hf:CausalLM
      path: models/my-model  # config.json, *.safetensors and its tokenizer, on this machine: nothing is downloaded
      data: data/my-text     # shards of its tokenizer: python -m train.prepare TEXT DIR --tokenizer models/my-model
      seq_len: 512

The model is built on the meta device from the folder's config.json (no memory). Under dist.strategy=fsdp or hsdp its
decoder layers (the classes transformers lists in the model's _no_split_modules) are the FSDP units and the blocks that
train.activation_checkpointing recomputes. The trainer gives it its values tensor by tensor with transformers' own
init (init_parameter: drawn from the trainer's generator, and the buffers that no file holds, such as the rotary
embeddings' frequencies, computed), then the folder's weights (init_from: the path; a run's own checkpoints come first:
a resume continues the run). `python -m train.export --format hf` writes the trained model as a folder of the same
architecture: the path's config.json, the trained safetensors and the files the folder has beside (its tokenizer).

task.lora_rank > 0 trains LoRA adapters instead (peft, injected into the meta model: with_adapters): the folder's
weights load into the adapted layers' base_layer and stay frozen (no gradient, no optimizer state, no gradient
reduction under DDP, FSDP or HSDP; a checkpoint holds them once); the adapters are drawn by init_parameter (lora_B
zero: step 0 is the folder's model). The export writes them as peft saves them, or (--merged) merged into the weights.

The data are the GPT task's token shards (train/tasks/shards.py), made with the model's tokenizer (uint32 for a
vocabulary over 65536); every token id is checked against the model's vocabulary. Shards with a loss mask beside them
(python -m train.prepare --chat) train on the assistant's tokens only, conversations packed into windows (task.pack),
each attending to itself alone (position ids restarting at each: transformers' packed sequences). transformers,
safetensors and tokenizers are an optional extra (pip install -r requirements-hf.txt), imported only when a run names
this task; peft too, imported only when a run asks for adapters.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from train.config import ConfigError
from train.hf_format import HFAdapters, HFModel, HFTensor, beside_weights, hf_config
from train.task import Task
from train.tasks import shards
from train.tasks.gpt_model import restarted_positions

KEY = "task.path"


def _transformers():
    """transformers, offline (a local path is never taken for a Hub id: no job waits on the network)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as e:
        raise ConfigError(f"task.name: train.tasks.hf:CausalLM needs transformers ({e}): pip install -r "
                          f"requirements-hf.txt") from None
    transformers.logging.set_verbosity_error()  # its notices on every rank; errors still raise
    return transformers


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


class CausalLM(Task):
    @dataclass
    class Config:
        path: str = ""  # the Hugging Face model folder: config.json, *.safetensors (its tokenizer beside)
        data: str = ""  # shards made with the model's tokenizer: a folder, a .bin file or a glob (*train*, *val*)
        eval_data: str = ""  # shards to evaluate on; empty: those of `data` named *val* (train: *train*)
        format: Literal["auto", "llmc", "nanogpt"] = "auto"  # auto: llm.c's magic (uint16/32), else bare uint16
        seq_len: int = 1024  # tokens per window (at most the model's max_position_embeddings)
        attention: Literal["sdpa", "eager"] = "sdpa"  # transformers' attn_implementation (both deterministic)
        # Masked shards: conversations packed into windows, each attending to itself alone; false: one a window.
        pack: Literal["auto", True, False] = "auto"  # auto: packed, or as the run was where a relaunch finds it
        lora_rank: int = 0  # > 0: LoRA adapters of this rank train (peft), the model's own weights frozen; 0: all train
        lora_alpha: float = 0.0  # the adapters' output is scaled by lora_alpha / lora_rank; 0: the rank (scale 1)
        lora_dropout: float = 0.0  # dropout on the adapters' input (training only)
        lora_targets: str = ""  # the adapted modules' names, comma-separated, or all-linear; "": peft's default

    unit = "tokens"
    relaunch = {"path": "refused", "data": "data", "eval_data": "applied", "format": "data", "seq_len": "data",
                "attention": "applied", "pack": "data", "lora_rank": "refused", "lora_alpha": "refused",
                "lora_dropout": "training", "lora_targets": "refused"}
    legacy = {"pack": False}  # a run recorded before task.pack: its conversations were a window each

    @classmethod
    def recorded(cls, cfg, run: dict) -> None:
        """A relaunch keeps the run's packing (task.pack=auto): a run started unpacked stays so."""
        shards.recorded_pack(cfg, run)

    def __init__(self, cfg, seed: int):
        super().__init__(cfg, seed)
        self._folder: dict | None = None  # config.json, checked
        self._config = None  # transformers' config of it
        self._skeleton: nn.Module | None = None  # a meta model of init_parameter's own

    # ---------------------------------------------------------------- the folder

    def folder_config(self) -> dict:
        """The folder's config.json, checked to describe a model the shards can feed (once): its vocabulary, its
        positions against seq_len, its tokenizer's vocabulary against the model's."""
        if self._folder is None:
            path = Path(self.cfg.path)
            h = hf_config(path, KEY)
            if not isinstance(h.get("model_type"), str):
                raise ConfigError(f"{KEY}: {path}/config.json has no model_type: not a transformers model's config "
                                  f"(save_pretrained writes one)")
            text = h.get("text_config") if isinstance(h.get("text_config"), dict) else {}
            vocab = h.get("vocab_size", text.get("vocab_size"))
            if not isinstance(vocab, int) or vocab <= 0:
                raise ConfigError(f"{KEY}: {path}/config.json has no vocab_size")
            positions = h.get("max_position_embeddings", h.get("n_positions", text.get("max_position_embeddings")))
            if isinstance(positions, int) and self.cfg.seq_len > positions:
                raise ConfigError(f"task.seq_len ({self.cfg.seq_len}) exceeds the {positions} positions of the "
                                  f"model of {path} (max_position_embeddings in its config.json)")
            tokens = tokenizer_size(path)
            if tokens > vocab:
                raise ConfigError(f"{KEY}: {path}/tokenizer.json has a vocabulary of {tokens} tokens, more than the "
                                  f"model's {vocab} (vocab_size in its config.json): its ids from {vocab} on have no "
                                  f"embedding; is it another model's tokenizer?")
            self._folder = h | {"vocab_size": vocab}
        return self._folder

    def vocab_size(self) -> int:
        return self.folder_config()["vocab_size"]

    def hf_config(self):
        """transformers' config of the folder (its model_type known to the installed transformers), once."""
        if self._config is None:
            h, path = self.folder_config(), self.cfg.path
            t = _transformers()
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            if h["model_type"] not in CONFIG_MAPPING:
                raise ConfigError(f"{KEY}: {path}/config.json has model_type {h['model_type']!r}, which transformers "
                                  f"{t.__version__} does not know (a newer transformers, or a model with custom "
                                  f"code, which this task does not run)")
            try:
                config = t.AutoConfig.from_pretrained(path, local_files_only=True)
            except Exception as e:
                raise ConfigError(f"{KEY}: {path}/config.json does not read as a {h['model_type']} config "
                                  f"({_one_line(e)})") from None
            config.use_cache = False  # training: no key/value cache built in every forward
            self._config = config
        return self._config

    # ---------------------------------------------------------------- the task

    def check(self) -> None:
        c = self.cfg
        if not c.path:
            raise ConfigError(f"{KEY}: the Hugging Face model folder to fine-tune (config.json and *.safetensors, "
                              f"copied to this machine) is not set")
        if not c.data:
            raise ConfigError(f"task.data: the token shards to train on are not set (make them with the model's "
                              f"tokenizer: python -m train.prepare TEXT DIR --tokenizer {c.path})")
        if c.seq_len <= 0:
            raise ConfigError(f"task.seq_len must be > 0, got {c.seq_len}")
        self.check_adapters()
        if Path(c.path).exists():  # a folder not copied yet (a config written first) is missing when the run starts
            self.folder_config()

    def datasets(self) -> tuple[Dataset, Dataset]:
        c = self.cfg
        train, val = shards.windows(c.data, c.eval_data, c.format, c.seq_len, self.vocab_size(),
                                    vocab=f"the vocab_size of {c.path}/config.json,",
                                    hint=f"tokenized for another model? make the shards with this one's tokenizer "
                                         f"(python -m train.prepare TEXT DIR --tokenizer {c.path})",
                                    pack=shards.packing(c.pack))
        self.masked = isinstance(train, shards.MaskedWindows)
        self.packed = self.masked and shards.packing(c.pack)
        if self.packed:
            self.check_packing()
        return train, val

    def check_packing(self) -> None:
        """Packed conversations reach the model as position ids that restart at each one (transformers' packed
        sequences: its mask builder finds them and keeps each to itself). A model whose forward does not hand its
        position ids to that mask builder would let them see each other: refused. Checked by running the meta
        model's forward once (no memory, milliseconds), watching for the call."""
        from transformers import masking_utils

        found = masking_utils.find_packed_sequence_indices
        seen = []

        def watch(position_ids):
            seen.append(True)
            return (torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1).cumsum(-1)

        masking_utils.find_packed_sequence_indices = watch
        try:
            x = torch.zeros(1, 4, dtype=torch.long, device="meta")
            self.skeleton()(input_ids=x, position_ids=x, use_cache=False)
            why = "" if seen else "its forward does not hand its position ids to transformers' mask"
        except Exception as e:
            why = f"its forward on the meta device failed ({_one_line(e)})"
        finally:
            masking_utils.find_packed_sequence_indices = found
        if why:
            raise ConfigError(f"task.pack: the {self.hf_config().model_type} model of {self.cfg.path} cannot keep "
                              f"packed conversations apart ({why}): set task.pack=false (a conversation a window)")

    def model(self) -> nn.Module:
        config, t = self.hf_config(), _transformers()
        try:
            with torch.device("meta"):  # no memory: the trainer shards it, then gives it its values
                model = t.AutoModelForCausalLM.from_config(config, attn_implementation=self.cfg.attention,
                                                           dtype=torch.float32)
        except Exception as e:
            if self.cfg.attention == "sdpa" and "scaled_dot_product_attention" in str(e):
                raise ConfigError(f"task.attention: transformers {t.__version__} has no sdpa attention for the "
                                  f"{config.model_type} model of {self.cfg.path}: set task.attention=eager") from None
            raise ConfigError(f"{KEY}: transformers builds no causal language model from {self.cfg.path}/config.json "
                              f"(model_type {config.model_type!r}: {_one_line(e)})") from None
        return self.with_adapters(model)

    def init_from(self) -> str:
        return self.cfg.path

    def skeleton(self) -> nn.Module:
        """A meta model of the task's own, never sharded (fully_shard changes a model's class): once."""
        if self._skeleton is None:
            self._skeleton = self.model()
        return self._skeleton

    def init_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """transformers' own init of the tensor `name` (the model's _init_weights, applied as initialize_weights
        does: to the module holding it, then to each module above), on a meta model of this task's own in which
        `full` stands for that one tensor: the draws that touch other tensors touch meta ones and draw nothing,
        and the draws are from `generator` alone. Buffers too: the rotary embeddings' inv_freq, in no file. An
        adapter's tensor: peft's init (init_adapter)."""
        if init_adapter(name, full, generator):
            return
        owner_name, _, attr = name.rpartition(".")
        chain = [self.skeleton()]
        for part in owner_name.split(".") if owner_name else ():
            chain.append(getattr(chain[-1], part))
        owner = chain[-1]
        store = owner._parameters if attr in owner._parameters else owner._buffers
        was = store[attr]
        blank = _blank(full)
        store[attr] = nn.Parameter(full, requires_grad=False) if store is owner._parameters else full
        pretrained = _transformers().PreTrainedModel
        inits, current = [], None
        for module in chain:  # a sub-model (a PreTrainedModel inside) has its own init, as smart_apply dispatches
            if isinstance(module, pretrained):
                current = module._init_weights
            inits.append((module, current))
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.set_rng_state(generator.get_state())
                for module, init in reversed(inits):  # the module first, then those above (initialize_weights' order)
                    init(module)
                generator.set_state(torch.get_rng_state())
        finally:
            store[attr] = was
        if blank is not None and bool(blank(full).any()):  # transformers' init does not reach it
            if store is owner._buffers:
                raise ConfigError(f"{KEY}: transformers' init of {type(self._skeleton).__name__} does not compute "
                                  f"its buffer {name} (made by its module's constructor): this task cannot build it "
                                  f"on the meta device")
            std = getattr(self.hf_config(), "initializer_range", 0.02) or 0.02
            with torch.no_grad():
                if full.dim() >= 2:
                    full.normal_(0.0, std, generator=generator)
                else:
                    full.fill_(1.0 if attr == "weight" else 0.0)

    def hf_model(self, model: nn.Module) -> HFModel:
        """The folder's own architecture: each parameter and persistent buffer under its own name (the names of
        transformers' state dict are those of its files), a tied weight once (as save_pretrained leaves out
        lm_head.weight), config.json as the folder has it, and the folder's other files (its tokenizer). Files
        that leave out the base model's prefix (transformer., model.) load too, as transformers loads them. With
        adapters: an adapted layer's weight under its own name (peft's base_layer left out), the adapters apart."""
        tensors = {name: HFTensor(name.replace(".base_layer.", ".")) for name, _ in model.named_parameters()
                   if not is_adapter(name)}  # a tied weight once
        for prefix, module in model.named_modules():
            for key, t in module._buffers.items():
                if t is not None and key not in module._non_persistent_buffers_set:
                    tensors[f"{prefix}.{key}" if prefix else key] = HFTensor(f"{prefix}.{key}" if prefix else key)
        folder = Path(self.cfg.path)
        config = {k: v for k, v in self.folder_config().items() if k not in ("dtype", "torch_dtype")}
        files = beside_weights(folder)
        # the files of the base model (GPT-2 as the Hub stores it: wte.weight, h.0...) leave its prefix out
        prefix = getattr(model, "base_model_prefix", "") or ""
        return HFModel(config=config, tensors=tensors, base_prefix=f"{prefix}." if prefix else "", files=files,
                       missing=_renamed_on_load(self.skeleton()), adapters=self.hf_adapters(model))

    def logits(self, model: nn.Module, batch) -> torch.Tensor:
        """transformers' logits of a batch's x; packed (x, y, doc): each conversation's alone, the position ids
        restarting at each, and transformers' mask keeps each to itself (check_packing)."""
        if not self.packed:
            return model(input_ids=batch[0]).logits
        return model(input_ids=batch[0], position_ids=restarted_positions(batch[2])).logits

    masked = False  # whether the shards have loss masks (datasets() says): then count() counts their targets

    packed = False  # whether their conversations are packed (datasets() says): then the model gets their positions

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        # y (batch[1]) is x shifted by one already: no labels for the model (it would shift them again).
        # Masked shards: the sum over the targets that count (count(): the trainer divides by the step's count);
        # others: the mean over the window's targets. Autocast: in fp32.
        return shards.lm_loss(self.logits(model, batch), batch[1], summed=self.masked)

    def count(self, batch) -> torch.Tensor | None:
        """Masked shards: the targets that count (the assistant's); others: None, the per-window mean."""
        return shards.lm_count(batch[1]) if self.masked else None

    def units(self, batch) -> int | None:
        """Masked shards: the tokens that are not padding; others: None (no padding)."""
        return shards.real_tokens(batch)

    def eval_step(self, model: nn.Module, batch) -> dict:
        # averaged per counted token, not per window
        return shards.lm_eval(self.logits(model, batch), batch[1])

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        if "loss" not in means:
            return means
        return {**means, "perplexity": math.exp(min(means["loss"], 700.0))}

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers: the outermost modules of the classes transformers keeps whole on one device
        (the model's _no_split_modules), else model.model.layers, else none."""
        names = set(getattr(model, "_no_split_modules", None) or ())
        found, inside = [], set()
        for module in model.modules():
            if id(module) in inside:
                continue
            if any(c.__name__ in names for c in type(module).__mro__):
                found.append(module)
                inside.update(id(m) for m in module.modules())
        if found:
            return found
        layers = getattr(getattr(model, "model", None), "layers", None)
        return list(layers) if isinstance(layers, nn.ModuleList) else []

    def units_per_sample(self) -> int:
        return self.cfg.seq_len

    # ---------------------------------------------------------------- adapters (LoRA)

    def check_adapters(self) -> None:
        c = self.cfg
        if c.lora_rank < 0:
            raise ConfigError(f"task.lora_rank must be >= 0 (0: no adapters, every weight trains), got {c.lora_rank}")
        if c.lora_alpha < 0:
            raise ConfigError(f"task.lora_alpha must be >= 0 (0: the rank), got {c.lora_alpha}")
        if not 0 <= c.lora_dropout < 1:
            raise ConfigError(f"task.lora_dropout must be in [0, 1), got {c.lora_dropout}")
        if not c.lora_rank:
            for key in ("lora_alpha", "lora_dropout", "lora_targets"):
                if getattr(c, key):
                    raise ConfigError(f"task.{key} is set, and task.lora_rank is 0 (no adapters: every weight "
                                      f"trains): set task.lora_rank (e.g. 8) to train LoRA adapters")

    def lora_config(self):
        """peft's LoraConfig of the task's keys; None without adapters (task.lora_rank 0)."""
        c = self.cfg
        if not c.lora_rank:
            return None
        names = [n.strip() for n in c.lora_targets.split(",") if n.strip()]
        alpha = c.lora_alpha or c.lora_rank
        return _peft().LoraConfig(r=c.lora_rank, lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
                                  lora_dropout=c.lora_dropout, bias="none", task_type="CAUSAL_LM",
                                  target_modules=None if not names else "all-linear" if names == ["all-linear"]
                                  else names)

    def with_adapters(self, model: nn.Module) -> nn.Module:
        """`model` (on meta) with peft's LoRA layers in place of the targeted ones (their weight kept as
        `<layer>.base_layer.weight`, the adapters `<layer>.lora_A.default.weight`, `lora_B`), every other weight
        frozen (requires_grad False: no gradient, no optimizer state, no gradient reduction); as it is without."""
        config = self.lora_config()
        if config is None:
            return model
        if isinstance(config.target_modules, (list, set)):
            modules = [name for name, _ in model.named_modules()]
            for target in sorted(config.target_modules):
                if not any(m == target or m.endswith(f".{target}") for m in modules):
                    raise ConfigError(f"task.lora_targets: the {type(model).__name__} of {self.cfg.path} has no module "
                                      f"named {target} (its linear layers: {', '.join(_linear_names(model))}; or "
                                      f"all-linear)")
        try:
            with torch.device("meta"), warnings.catch_warnings():  # peft's notices (a meta model) on every rank
                warnings.simplefilter("ignore")
                _peft().inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
        except ValueError as e:  # no default targets for this architecture
            raise ConfigError(f"task.lora_targets: peft adapts no module of the {type(model).__name__} of "
                              f"{self.cfg.path} by default ({_one_line(e)}): name them (its linear layers: "
                              f"{', '.join(_linear_names(model))}; or all-linear)") from None
        return model

    def hf_adapters(self, model: nn.Module) -> HFAdapters | None:
        """The adapters of `model` as export writes them (train/hf_format.py); None without."""
        if not self.cfg.lora_rank:
            return None
        names = tuple(name for name, _ in model.named_parameters() if is_adapter(name))
        into: dict[str, list[str]] = {}
        for name in names:
            into.setdefault(f"{name.split('.lora_')[0]}.base_layer.weight", []).append(name)
        targets = ", ".join(dict.fromkeys(k.removesuffix(".base_layer.weight").rpartition(".")[2] for k in into))
        return HFAdapters(tensors=names, into={k: tuple(v) for k, v in into.items()}, merge=self.merge_adapters,
                          save=self.save_adapters,
                          about=f"LoRA adapters of rank {self.cfg.lora_rank} on {targets} ({len(into)} layers)")

    def merge_adapters(self, name: str, weight: torch.Tensor, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
        """The weight `name` (a base layer's) with its adapters' product added, as peft's merge_and_unload adds it:
        its layer's get_delta_weight (B @ A times the scale), computed on a meta model of the task's own whose
        adapter tensors stand for these for the call."""
        skeleton = self.skeleton()
        layer = skeleton.get_submodule(name.removesuffix(".base_layer.weight"))
        places = []
        for key, tensor in adapters.items():
            owner_name, _, attr = key.rpartition(".")
            owner = skeleton.get_submodule(owner_name)
            places.append((owner, attr, owner._parameters[attr]))
            owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
        try:
            with torch.no_grad():
                delta = layer.get_delta_weight("default")
        finally:
            for owner, attr, was in places:
                owner._parameters[attr] = was
        return weight + delta.to(weight.dtype)

    def save_adapters(self, tensors: dict[str, torch.Tensor], out: Path) -> None:
        """The adapters (the model's names -> their values) written as peft's save_pretrained writes them:
        adapter_model.safetensors, adapter_config.json (the base model: task.path) and its README.md, in `out`,
        by a peft model built on meta over the task's architecture."""
        peft, t = _peft(), _transformers()
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = t.AutoModelForCausalLM.from_config(self.hf_config(), attn_implementation=self.cfg.attention,
                                                      dtype=torch.float32)
            model = peft.get_peft_model(base, self.lora_config())
            model.save_pretrained(str(out), state_dict={f"base_model.model.{k}": v for k, v in tensors.items()})


def _peft():
    """peft, for a run with adapters (task.lora_rank > 0) and their export."""
    try:
        import peft
    except ImportError as e:
        raise ConfigError(f"task.lora_rank: LoRA adapters need peft ({e}): pip install -r "
                          f"requirements-hf.txt") from None
    return peft


def is_adapter(name: str) -> bool:
    """Whether the tensor `name` is an adapter's (peft's lora_A, lora_B, ...: trained, in no file of the model)."""
    return any(part.startswith("lora_") for part in name.split("."))


def init_adapter(name: str, full: torch.Tensor, generator: torch.Generator) -> bool:
    """peft's default init of an adapter's tensor (init_lora_weights=True), drawn from `generator`: lora_A as an
    nn.Linear's weight (Kaiming uniform), lora_B zero, so that the adapted model starts as the model itself (an
    embedding's adapter: A zero, B normal). False for a tensor that is no adapter's."""
    parts = name.split(".")
    with torch.no_grad():
        if "lora_A" in parts:
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
        elif "lora_B" in parts or "lora_embedding_A" in parts:
            full.zero_()
        elif "lora_embedding_B" in parts:
            full.normal_(generator=generator)
        elif is_adapter(name):
            raise ConfigError(f"task.lora_targets: peft made {name}, whose init this task does not know (adapt "
                              f"linear or embedding layers)")
        else:
            return False
    return True


def _linear_names(model: nn.Module) -> list[str]:
    """The names of the model's linear layers (the last part of each, once, in order): what LoRA adapts."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":  # GPT-2's
            names.setdefault(name.rpartition(".")[2], None)
    return list(names)


def _renamed_on_load(model: nn.Module) -> str:
    """What a tensor missing from the files means for an architecture whose files transformers renames or fuses as
    it loads them (its conversion mapping: GPT-NeoX's embed_out, Mixtral's and Qwen2-MoE's experts); "" for one
    whose files hold the model's own names."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        transforms = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # another transformers: no mapping to name
        return ""
    if not transforms:
        return ""
    pairs = [f"{', '.join(t.source_patterns)} -> {', '.join(t.target_patterns)}" for t in transforms[:2]]
    return (f"transformers renames or fuses the tensors of {type(model).__name__} as it loads them ({'; '.join(pairs)}"
            f"{'; ...' if len(transforms) > 2 else ''}), and this task reads the files as they are: it does not "
            f"fine-tune this architecture")


def tokenizer_size(folder: Path) -> int:
    """The vocabulary of the folder's tokenizer.json (its added tokens included); 0 where it has none."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return 0
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ConfigError(f"task.name: train.tasks.hf:CausalLM needs tokenizers ({e}): pip install -r "
                          f"requirements-hf.txt") from None
    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:
        raise ConfigError(f"{KEY}: {path} does not read as a tokenizer ({_one_line(e)})") from None


def _blank(full: torch.Tensor):
    """Mark `full` as not yet written (NaN, or an integer type's smallest value) and return the test that finds
    the marks left; None for a type that has no mark (bool)."""
    if full.is_floating_point() or full.is_complex():
        full.fill_(float("nan"))
        return torch.isnan
    if full.dtype == torch.bool:
        return None
    low = torch.iinfo(full.dtype).min
    full.fill_(low)
    return lambda t: t == low
