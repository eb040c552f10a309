"""A decoder-only transformer (GPT-2), written on torch.nn alone, after nanoGPT's model.py.

Pre-LayerNorm blocks, learned positions, GELU MLPs, attention through F.scaled_dot_product_attention (flash
or memory-efficient kernels where the device has them), token embeddings tied to the output layer, and
GPT-2's initialisation. Nothing in forward() branches on data, so torch.compile traces it in one graph,
and it runs under bf16 autocast as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257  # GPT-2's tokens; the embedding has padded_vocab rows
    block_size: int = 1024  # the longest sequence: the number of learned positions
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms, as GPT-2

    @property
    def padded_vocab(self) -> int:
        """The vocabulary padded to a multiple of 64, as llm.c and nanoGPT do (faster matmuls): GPT-2's 50257
        tokens get 50304 rows. The padding rows are never a target: training drives their logits down."""
        return -(-self.vocab_size // 64) * 64


PRESETS = {
    "gpt2": GPTConfig(),  # GPT-2 small, 124M parameters: the model llm.c and nanoGPT reproduce
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=128),  # ~0.8M: minutes on a CPU
    "nano": GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=64),  # ~30k: for tests
}


def preset(name: str, **overrides) -> GPTConfig:
    """A preset with some fields replaced: preset("tiny", n_layer=6)."""
    return replace(PRESETS[name], **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # query, key, value in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, padded_vocab). The loss is the task's (train/tasks/gpt.py)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.padded_vocab, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        # Weight tying (GPT-2): one matrix embeds the tokens and scores them. Saves vocab x n_embd parameters
        # (38M of GPT-2's 124M) and trains better on small data.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two residual projections to the stream, so their weights
        # get std 0.02 / sqrt(2 * n_layer) to keep the residual stream's variance independent of depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, the tied matrix once. non_embedding: without the position embeddings, as nanoGPT
        counts (the token embeddings stay: they are the output layer's weights too)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        assert T <= self.config.block_size, f"sequence of {T} tokens > block_size {self.config.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def init_parameter(cfg: GPTConfig, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
    """GPT-2's initialisation of one tensor, by its name in GPT, drawing from `generator` only: what the
    constructor does, for a GPT built on the meta device (Task.init_parameter)."""
    if ".ln_" in name:
        nn.init.ones_(full) if name.endswith(".weight") else nn.init.zeros_(full)
    elif name.endswith(".bias"):
        nn.init.zeros_(full)
    else:  # Linear and Embedding weights; the residual projections scaled by depth
        std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
        nn.init.normal_(full, mean=0.0, std=std, generator=generator)
