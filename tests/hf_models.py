"""Tiny random Hugging Face models, saved by the tests themselves with save_pretrained: nothing is downloaded.
transformers is imported only here, and only by the tests that need it (pip install -r requirements-hf.txt)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install -r requirements-hf.txt")


def tiny_gpt2(folder: Path, vocab: int = 100, positions: int = 64, seed: int = 0) -> Path:
    """A GPT2LMHeadModel of 2 layers, 2 heads, width 32: config.json and model.safetensors in `folder`."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=vocab, n_positions=positions,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1,
                                     eos_token_id=vocab - 1)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def logits_of(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """What transformers computes for `tokens` (B, T) with the model of `folder`, in fp32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits
