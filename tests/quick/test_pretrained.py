"""A Hugging Face GPT-2 loads into the built-in GPT with transformers' logits."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

hf_models = pytest.importorskip("tests.hf_models", reason="pip install -r requirements-hf.txt")


LOG = logging.getLogger("test")


def gpt_from(folder: Path, *overrides: str):
    """The built-in GPT task with init_from=folder, its model built on meta and given its values, then the
    folder's weights, in this process (no process group), as the trainer does on one rank."""
    from train import config
    from train.checkpoint import pretrained
    from train.parallel import wrapping

    cfg = config.load("configs/gpt.yaml", [f"task.init_from={folder}", "task.seq_len=32", *overrides])
    task = cfg.task_class(cfg.task, cfg.seed)
    model = task.model()
    assert wrapping.on_meta(model)
    wrapping.materialize(model, task, torch.device("cpu"), cfg.seed)
    pretrained.load(model, task, str(folder), LOG)
    return model.eval()


def test_a_hugging_face_gpt2_loads_into_the_built_in_gpt_with_transformers_logits(tmp_path):
    """nanoGPT's init_from='gpt2', offline: the Conv1D weights transposed, the vocabulary's padding rows (100 of
    the model's 128) left to their initial values. Logits equal transformers' to float32 rounding."""
    folder = hf_models.tiny_gpt2(tmp_path / "gpt2")
    model = gpt_from(folder)
    assert model.transformer.wte.weight.shape == (128, 32)  # padded to a multiple of 64
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)[..., :100]
    theirs = hf_models.logits_of(folder, tokens)
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
