"""A causal language model: GPT-2 (train/tasks/gpt_model.py) on token shards, or on a corpus generated from the seed.

    task:
      name: train.tasks.gpt:LanguageModel
      data: data/fineweb10B        # llm.c's or nanoGPT's .bin shards: *train*.bin trains, *val*.bin evaluates
      model: gpt2                  # the 124M preset, to compare with llm.c and nanoGPT
      seq_len: 1024
      init_from: models/gpt2       # optional: a local Hugging Face GPT-2 folder (its sizes replace the preset's,
                                   # recorded in the task's keys: the run resumes after the folder moved)

The model is built on the meta device and initialized shard by shard (init_parameter): the same seed gives
the same weights under DDP and FSDP, on any number of ranks. A Hugging Face GPT-2 folder (transformers'
GPT2LMHeadModel: config.json and safetensors) loads into it (hf_model: the same names, Conv1D weights
transposed, the vocabulary's padding rows left out), and `python -m train.export --format hf` writes one (with
the init_from folder's tokenizer and generation_config.json, where the run started from one).

`python -m train.prepare` makes shards from text files (and conversations: a loss mask beside the shards, read as
shards.MaskedWindows, makes a step's loss the sum over all its counted tokens over their number: count()).
Conversations are packed into windows (task.pack), each attending to itself alone with its positions from 0; with
task.doc_mask, pretraining documents are kept apart the same way, split at the end-of-text token (task.eot_id).
Throughput is counted in tokens that are not padding, evaluation logs the loss per token and its perplexity, and MFU
on GPUs uses nanoGPT's FLOP count (flops_per_sample).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset

from train.config import ConfigError
from train.hf_format import HFModel, HFTensor, beside_weights, hf_config, is_hf_folder
from train.task import Task
from train.tasks import gpt_model, shards
from train.tasks.gpt_model import GPT, PRESETS, GPTConfig, preset

# The built-in corpus: a random order-2 Markov chain over 64 tokens. Each token b has 8 possible successors,
# and each pair (a, b) uses 3 of those with random probabilities; with probability 0.05 the next token is
# uniform instead (every state stays reachable). A model that learns which tokens follow b gets the loss
# from ~4.07 nats (the unigram entropy) to ~2.1; one that also attends to a, the token before, to ~1.2.
BUILTIN_VOCAB, CANDIDATES, BRANCH, NOISE = 64, 8, 3, 0.05
STREAMS, CHUNK_STEPS = 256, 4096  # the corpus is runs of the chain of 4096 tokens (builtin_tokens)
# GPT-2's Conv1D layers: stored (in, out) in Hugging Face files, where nn.Linear has (out, in)
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# The sizes a Hugging Face GPT-2 folder's config.json gives the model (recorded in the task's keys)
SIZES = ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")
# What GPT-2's config.json may set that changes what the model computes, with the built-in GPT's values
COMPUTES = {"layer_norm_epsilon": 1e-5, "scale_attn_weights": True}
GPT2_EOT = 50256  # GPT-2's <|endoftext|>: llm.c's and nanoGPT's shards start each document with it
HF_TASK = "train it with task.name=train.tasks.hf:CausalLM, which computes what transformers does"


class LanguageModel(Task):
    @dataclass
    class Config:
        data: str = "builtin"  # builtin, or llm.c/nanoGPT shards: a folder, a .bin file or a glob
        eval_data: str = ""  # shards to evaluate on; empty: those of `data` named *val* (train: *train*)
        format: Literal["auto", "llmc", "nanogpt"] = "auto"  # auto: llm.c's magic (uint16/32), else bare uint16
        model: Literal["gpt2", "tiny", "nano"] = "tiny"  # a preset of train/tasks/gpt_model.py
        seq_len: int = 0  # tokens per window; 0: the preset's block size (gpt2 1024, tiny 128, nano 64)
        n_layer: int = 0  # 0: the preset's
        n_head: int = 0  # 0: the preset's
        n_embd: int = 0  # 0: the preset's
        vocab_size: int = 0  # 0: the preset's for shards (gpt2 50257, tiny/nano 256 bytes); builtin: 64
        n_positions: int = 0  # learned positions (the longest window); 0: seq_len, else the preset's block size
        dropout: float = 0.0  # dropout probability in the blocks (0: none)
        train_tokens: int = 2_000_000  # builtin data only
        eval_tokens: int = 65_536  # builtin data only
        init_from: str = ""  # the first step's weights: a local Hugging Face GPT-2 folder, or a run's checkpoint
        # Masked shards: conversations packed into windows, each attending to itself alone; false: one a window.
        pack: Literal["auto", True, False] = "auto"  # auto: packed, or as the run was where a relaunch finds it
        doc_mask: bool = False  # other shards: attention within a document (split at eot_id), positions restarted
        eot_id: int = -1  # the token doc_mask splits at; -1: init_from's eos_token_id, else GPT-2's 50256

    unit = "tokens"
    relaunch = {"data": "data", "eval_data": "applied", "format": "data", "model": "refused", "seq_len": "refused",
                "n_layer": "refused", "n_head": "refused", "n_embd": "refused", "vocab_size": "refused",
                "n_positions": "refused", "dropout": "training", "train_tokens": "data", "eval_tokens": "applied",
                "init_from": "applied",  # init_from: the first step's weights only (a relaunch resumes its own)
                "pack": "data", "doc_mask": "training", "eot_id": "training"}
    legacy = {"pack": False}  # a run recorded before task.pack: its conversations were a window each

    def gpt_config(self) -> GPTConfig:
        """The model's GPTConfig: the preset with the overrides that are set; with init_from a Hugging Face folder,
        the folder's sizes, written into the task's keys (so the run's config.yaml and checkpoints record them:
        a relaunch or an export after the folder moved builds the same model)."""
        c = self.cfg
        if self._hf_folder():
            h = self._hf_config()
            c.vocab_size = c.vocab_size or h["vocab_size"]
            c.n_layer, c.n_head, c.n_embd, c.n_positions = h["n_layer"], h["n_head"], h["n_embd"], h["n_positions"]
        base = PRESETS[c.model]
        vocab = c.vocab_size or (BUILTIN_VOCAB if c.data == "builtin" else base.vocab_size)
        return preset(c.model, n_layer=c.n_layer or base.n_layer, n_head=c.n_head or base.n_head,
                      n_embd=c.n_embd or base.n_embd, vocab_size=vocab,
                      block_size=c.n_positions or c.seq_len or base.block_size, dropout=c.dropout)

    def seq_len(self) -> int:
        """Tokens per window: task.seq_len, else the model's block size."""
        return self.cfg.seq_len or self.gpt_config().block_size

    def _hf_folder(self) -> bool:
        """Whether init_from names a Hugging Face folder (an empty init_from names none: not the working
        directory)."""
        return bool(self.cfg.init_from) and is_hf_folder(Path(self.cfg.init_from))

    @classmethod
    def recorded(cls, cfg, run: dict) -> None:
        """A relaunch whose init_from folder is no longer there (moved, deleted): the sizes the run read from it
        at its first launch, from the run's config.yaml, so that it resumes (its weights are its checkpoints')."""
        if cfg.init_from and run.get("init_from") == cfg.init_from and not is_hf_folder(Path(cfg.init_from)):
            for key in SIZES:
                if not getattr(cfg, key) and isinstance(run.get(key), int):
                    setattr(cfg, key, run[key])
        shards.recorded_pack(cfg, run)  # a run started unpacked stays so

    def _hf_config(self) -> dict:
        """The init_from folder's config.json, checked to be a GPT-2 that computes what this GPT does (once)."""
        if getattr(self, "_hf", None) is None:
            folder = self.cfg.init_from
            h = hf_config(Path(folder))
            if h.get("model_type") != "gpt2":
                raise ConfigError(f"task.init_from: {folder} holds a {h.get('model_type', 'model')} "
                                  f"({', '.join(h.get('architectures') or ['no architectures'])}), and the built-in "
                                  f"GPT loads GPT-2 folders: train it with task.name=train.tasks.hf:CausalLM")
            missing = [k for k in SIZES if k not in h]
            if missing:
                raise ConfigError(f"task.init_from: {folder}/config.json has no {', '.join(missing)}")
            other = HF_TASK
            if h.get("tie_word_embeddings", True) is False:
                raise ConfigError(f"task.init_from: {folder} is a GPT-2 with an output layer of its own "
                                  f"(tie_word_embeddings: false, its lm_head.weight), and the built-in GPT ties it "
                                  f"to the embedding: {other}")
            if h.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh") or h.get(
                    "n_inner") not in (None, 4 * h["n_embd"]) or h.get("scale_attn_by_inverse_layer_idx"):
                raise ConfigError(f"task.init_from: {folder} is a GPT-2 variant the built-in GPT is not "
                                  f"(activation, n_inner or attention scaling): {other}")
            differs = [f"{k}: {json.dumps(h[k])}" for k, ours in COMPUTES.items() if k in h and h[k] != ours]
            if differs:
                raise ConfigError(f"task.init_from: {folder} is a GPT-2 that computes otherwise than the built-in GPT "
                                  f"({', '.join(differs)}; the built-in GPT has "
                                  f"{', '.join(f'{k}: {json.dumps(COMPUTES[k])}' for k in COMPUTES)}): {other}")
            for key in ("n_layer", "n_head", "n_embd", "n_positions"):
                if getattr(self.cfg, key) not in (0, h[key]):
                    raise ConfigError(f"task.{key}: the model's sizes come from task.init_from's config.json "
                                      f"({key}={h[key]}); leave task.{key} unset")
            self._hf = h
        return self._hf

    def check(self) -> None:
        c = self.cfg
        for key in ("seq_len", "n_layer", "n_head", "n_embd", "vocab_size"):
            if getattr(c, key) < 0:
                raise ConfigError(f"task.{key} must be >= 0 (0: the preset's), got {getattr(c, key)}")
        g = self.gpt_config()
        if c.seq_len > g.block_size:
            raise ConfigError(f"task.seq_len ({c.seq_len}) exceeds the model's {g.block_size} positions "
                              f"(task.n_positions: the n_positions of task.init_from's config.json where it is set)")
        if g.n_embd % g.n_head:
            raise ConfigError(f"task.n_embd ({g.n_embd}) must be a multiple of task.n_head ({g.n_head})")
        if not 0 <= c.dropout < 1:
            raise ConfigError(f"task.dropout must be in [0, 1), got {c.dropout}")
        if c.data == "builtin":
            if g.vocab_size < BUILTIN_VOCAB:
                raise ConfigError(f"task.vocab_size: the builtin corpus has {BUILTIN_VOCAB} tokens, got {g.vocab_size}")
            for key in ("train_tokens", "eval_tokens"):
                if getattr(c, key) <= self.seq_len():
                    raise ConfigError(f"task.{key} must be > seq_len ({self.seq_len()}), got {getattr(c, key)}")
        if c.eval_data and c.data == "builtin":
            raise ConfigError("task.eval_data is for shards; the builtin corpus has its own evaluation split")
        if c.doc_mask and not 0 <= self.eot_id() < g.vocab_size:
            raise ConfigError(f"task.eot_id: token {self.eot_id()} is not in the model's vocabulary of {g.vocab_size} "
                              f"(task.doc_mask splits documents at it): set task.eot_id to the shards' end-of-text "
                              f"token")

    def eot_id(self) -> int:
        """The end-of-text token task.doc_mask splits documents at: task.eot_id, else the init_from folder's
        eos_token_id, else GPT-2's 50256."""
        if self.cfg.eot_id >= 0:
            return self.cfg.eot_id
        eos = self._hf_config().get("eos_token_id") if self._hf_folder() else None
        return eos if isinstance(eos, int) else GPT2_EOT

    def datasets(self) -> tuple[Dataset, Dataset]:
        c, g, T = self.cfg, self.gpt_config(), self.seq_len()
        if c.data == "builtin":
            train = shards.Shard.of_array(builtin_tokens(self.seed, c.train_tokens, "train"), "builtin:train")
            val = shards.Shard.of_array(builtin_tokens(self.seed, c.eval_tokens, "val"), "builtin:val")
            return shards.TokenWindows([train], T), shards.TokenWindows([val], T)
        train, val = shards.windows(c.data, c.eval_data, c.format, T, g.vocab_size, pack=shards.packing(c.pack))
        self.masked = isinstance(train, shards.MaskedWindows)
        self.packed = self.masked and shards.packing(c.pack)
        return train, val

    def model(self) -> nn.Module:
        with torch.device("meta"):  # no memory: the trainer shards it first, then gives it its values
            return GPT(self.gpt_config())

    def init_parameter(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        gpt_model.init_parameter(self.gpt_config(), name, full, generator)

    def hf_model(self, model: nn.Module) -> HFModel | None:
        """GPT2LMHeadModel: the same names (the tied lm_head stored once, as the embedding), the Conv1D
        weights transposed, the embedding's first vocab_size rows (its padding is not stored)."""
        g = self.gpt_config()
        if not g.bias:
            return None  # GPT-2's files have biases
        tensors = {}
        for name, _ in model.named_parameters():  # the tied lm_head.weight is transformer.wte.weight's
            rows = g.vocab_size if name == "transformer.wte.weight" and g.padded_vocab != g.vocab_size else 0
            tensors[name] = HFTensor(name, transposed=name.endswith(CONV1D), rows=rows)
        config = {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": g.vocab_size,
            "n_positions": g.block_size, "n_embd": g.n_embd, "n_layer": g.n_layer, "n_head": g.n_head,
            "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": g.dropout, "embd_pdrop": g.dropout, "attn_pdrop": g.dropout, "tie_word_embeddings": True,
            "bos_token_id": g.vocab_size - 1, "eos_token_id": g.vocab_size - 1,  # GPT-2's <|endoftext|>: the last
        }
        files: tuple[str, ...] = ()
        if self._hf_folder():  # the folder's own words where it has them (token ids, ...), and its tokenizer
            config = self._hf_config() | {k: config[k] for k in ("architectures", "vocab_size", "resid_pdrop",
                                                                  "embd_pdrop", "attn_pdrop", "tie_word_embeddings")}
            files = beside_weights(Path(self.cfg.init_from))
        return HFModel(config=config, tensors=tensors, base_prefix="transformer.", files=files)

    masked = False  # whether the shards have loss masks (datasets() says): then count() counts their targets
    packed = False  # whether their conversations are packed (datasets() says): then the model gets their ids

    def logits(self, model: nn.Module, batch) -> torch.Tensor:
        """The model's logits of a batch: (x, y) of TokenWindows, (x, y, doc) of MaskedWindows. Documents apart in
        attention: packed conversations (their ids), pretraining documents with task.doc_mask (split at eot_id)."""
        x = batch[0]
        if self.packed:
            return model(x, batch[2])
        if self.cfg.doc_mask and not self.masked:
            return model(x, shards.doc_ids(x, self.eot_id()))
        return model(x)  # computes what it always did

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        # Masked shards: the sum over the targets that count (count(): the trainer divides by the step's count).
        # Others: the mean over the window's targets, as ever. Autocast: in fp32.
        return shards.lm_loss(self.logits(model, batch), batch[1], summed=self.masked)

    def count(self, batch) -> torch.Tensor | None:
        """Masked shards: the targets that count (the assistant's); others: None, the per-window mean, as ever
        (every window counts all its seq_len targets: the same mean up to rounding, and the same bits as before)."""
        return shards.lm_count(batch[1]) if self.masked else None

    def units(self, batch) -> int | None:
        """Masked shards: the tokens that are not padding; others: None (no padding)."""
        return shards.real_tokens(batch)

    def eval_step(self, model: nn.Module, batch) -> dict:
        return shards.lm_eval(self.logits(model, batch), batch[1])  # averaged per counted token, not per window

    def summarize(self, means: dict[str, float]) -> dict[str, float]:
        if "loss" not in means:
            return means
        return {**means, "perplexity": math.exp(min(means["loss"], 700.0))}  # exp(710) overflows a float

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.transformer.h)

    def units_per_sample(self) -> int:
        return self.seq_len()

    def flops_per_sample(self, model: nn.Module) -> float:
        """nanoGPT's estimate_mfu (the PaLM paper's appendix B count), per window of T tokens:
        T * (6N + 12 * n_layer * n_embd * T), N the parameters without the position embeddings (the tied
        token embeddings count, as the output layer's matmul). Counted on `model`, whatever wraps it. The meter
        counts it a token that is not padding (units()); attention as over the full causal window, a document
        mask or not (the FLOPs it skips count as done)."""
        g, T = self.gpt_config(), self.seq_len()
        n = sum(p.numel() for p in model.parameters()) - g.block_size * g.n_embd
        return float(T * (6 * n + 12 * g.n_layer * g.n_embd * T))


def builtin_chain(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The Markov chain of the built-in corpus: successors (64, 64, 3) and their probabilities, for each
    pair (a, b) of previous tokens. From the seed only, so every rank has the same."""
    rng = np.random.default_rng([seed, 0x6C6D])
    candidates = np.stack([rng.choice(BUILTIN_VOCAB, CANDIDATES, replace=False) for _ in range(BUILTIN_VOCAB)])
    pick = np.argsort(rng.random((BUILTIN_VOCAB, BUILTIN_VOCAB, CANDIDATES)), axis=2)[:, :, :BRANCH]
    successors = candidates[np.arange(BUILTIN_VOCAB)[None, :, None], pick]  # b's candidates, for every a
    probs = rng.dirichlet(np.ones(BRANCH), size=(BUILTIN_VOCAB, BUILTIN_VOCAB))
    return successors, probs


def builtin_tokens(seed: int, n: int, split: Literal["train", "val"]) -> np.ndarray:
    """n tokens of the built-in corpus (uint16). The splits are different runs of the same
    chain. Made of chunks of STREAMS runs of CHUNK_STEPS tokens, generated side by side (numpy steps all the
    runs at once) and laid end to end; chunk k comes from (seed, split, k), so a longer corpus only adds
    chunks: builtin_tokens(seed, m, split) starts with builtin_tokens(seed, n, split) for m > n."""
    successors, probs = builtin_chain(seed)
    cdf = np.cumsum(probs, axis=2)[:, :, :-1]
    chunks = []
    for chunk in range(-(-n // (STREAMS * CHUNK_STEPS))):
        rng = np.random.default_rng([seed, 0x6C6D, 1 if split == "train" else 2, chunk])
        out = np.empty((CHUNK_STEPS, STREAMS), dtype=np.uint16)
        a, b = rng.integers(BUILTIN_VOCAB, size=(2, STREAMS))
        for t in range(CHUNK_STEPS):
            k = (rng.random(STREAMS)[:, None] > cdf[a, b]).sum(1)  # inverse CDF: which of the 3 successors
            noise = rng.random(STREAMS) < NOISE
            c = np.where(noise, rng.integers(BUILTIN_VOCAB, size=STREAMS), successors[a, b, k])
            out[t] = c
            a, b = b, c
        chunks.append(out.T.reshape(-1))
    return np.concatenate(chunks)[:n]


@dataclass(frozen=True)
class Entropies:
    """Of the built-in corpus, in nats per token, exact (from the chain's stationary distribution)."""

    unigram: float  # the best loss without context: a model that learned nothing but token frequencies
    bigram: float  # given the previous token
    rate: float  # given the previous two: the lowest loss any model can reach


def builtin_entropy(seed: int) -> Entropies:
    V = BUILTIN_VOCAB
    successors, probs = builtin_chain(seed)
    P = np.full((V, V, V), NOISE / V)  # P[a, b, c] = p(next = c | a, b)
    np.add.at(P, (np.arange(V)[:, None, None], np.arange(V)[None, :, None], successors), (1 - NOISE) * probs)
    pair = np.full((V, V), 1.0 / V**2)  # p(a, b), iterated to the stationary distribution
    for _ in range(200):
        pair = np.einsum("ab,abc->bc", pair, P)
    unigram = pair.sum(0)
    following = np.einsum("ab,abc->bc", pair, P)  # p(b, c)
    return Entropies(unigram=float(-(unigram * np.log(unigram)).sum()),
                     bigram=float(-(following * np.log(following / following.sum(1, keepdims=True))).sum()),
                     rate=float(-(pair[:, :, None] * P * np.log(P)).sum()))
