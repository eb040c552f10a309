"""A decoder-only transformer (GPT-2), written on torch.nn alone, after nanoGPT's model.py.

Pre-LayerNorm blocks, learned positions, GELU MLPs, attention through F.scaled_dot_product_attention (flash
or memory-efficient kernels where the device has them), token embeddings tied to the output layer, and
GPT-2's initialisation. Nothing in forward() branches on data, so torch.compile traces it in one graph,
and it runs under bf16 autocast as it is.

Documents apart: forward(idx, doc) with each position's document id (packed conversations, or pretraining
documents split at an end-of-text token) attends within a document only and restarts the positions at each one,
so that a document's logits are those it has alone. The mask is FlexAttention's block mask under torch.compile
(blocks no document reaches are skipped), else causal SDPA on each document alone (its own length's work, not the
window's; the spans are read on the host). Without doc, forward computes what it always did (causal SDPA over the
window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
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

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        """mask: None (causal over the window), each window's document lengths (document_spans), or a FlexAttention
        BlockMask."""
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        dropout = self.dropout if self.training else 0.0
        if isinstance(mask, list):  # each document alone, causal: the work of its own length, not the window's
            # All windows' documents in a row: (B * T, nh, hs) views of c_attn's output split at each document (views
            # backward too: squeeze, not [0], whose backward fills zeros and copies). The CPU kernel writes each
            # output as (L, nh, hs): one cat makes c_proj's input, no stack over the windows nor transposed copy.
            sizes = [n for spans in mask for n in spans]
            y = torch.cat([F.scaled_dot_product_attention(
                qd.transpose(0, 1)[None], kd.transpose(0, 1)[None], vd.transpose(0, 1)[None], dropout_p=dropout,
                is_causal=True).squeeze(0).transpose(0, 1)
                for qd, kd, vd in zip(*(t.reshape(B * T, nh, hs).split(sizes) for t in (q, k, v)), strict=True)])
            return self.resid_dropout(self.c_proj(y.view(B, T, C)))
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(q, k, v, block_mask=mask)
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

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
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

    def forward(self, idx: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """doc: (B, T) document ids (a document: consecutive positions of one id): attention within a document
        only, positions restarting at each; None: causal over the whole window."""
        T = idx.shape[1]
        assert T <= self.config.block_size, f"sequence of {T} tokens > block_size {self.config.block_size}"
        mask = None
        if doc is None:
            pos = torch.arange(T, dtype=torch.long, device=idx.device)
        else:
            pos = restarted_positions(doc)
            flex = torch.compiler.is_compiling() and not (self.training and self.config.dropout)  # flex: no dropout
            mask = block_mask(doc) if flex else document_spans(doc)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, mask)
        return self.lm_head(self.transformer.ln_f(x))


def restarted_positions(doc: torch.Tensor) -> torch.Tensor:
    """Each position's index within its document (0 where a document starts): (B, T) from (B, T) document ids."""
    index = torch.arange(doc.shape[1], device=doc.device).expand_as(doc)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return index - torch.where(starts, index, 0).cummax(1).values


def document_spans(doc: torch.Tensor) -> list[list[int]]:
    """Each window's documents as their lengths, in order, read from the ids on the host (on a GPU, a wait for them:
    a compiled model takes FlexAttention's path, which needs none). Padding is a document of its own."""
    d = doc.cpu().numpy()
    T = d.shape[1]
    return [np.diff([0, *(np.flatnonzero(row[1:] != row[:-1]) + 1).tolist(), T]).tolist() for row in d]


def block_mask(doc: torch.Tensor):
    """FlexAttention's BlockMask: a query sees the keys of its document up to itself (under torch.compile: the blocks
    a query's document does not reach are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    return create_block_mask(same_document, doc.shape[0], None, doc.shape[1], doc.shape[1], device=doc.device)


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
