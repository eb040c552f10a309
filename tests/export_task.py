"""The built-in GPT with an integer buffer (transformer.counts: [70000, 3, 65537], which bf16 or fp16 would round),
stored in its Hugging Face files as a model_type transformers does not know (so that the export checks the task's
own keys only); $EXPORT_BREAK makes its export misdescribe the model (tests/processes/test_export_hf.py): `config`, a
config.json of one layer more than the files; `model`, a model of one layer more than the checkpoint holds."""

import dataclasses
import os

import torch

from train.hf_format import HFTensor
from train.tasks.gpt import LanguageModel

COUNTS = [70000, 3, 65537]


class Counted(LanguageModel):
    def gpt_config(self):
        g = super().gpt_config()
        return dataclasses.replace(g, n_layer=g.n_layer + 1) if os.environ.get("EXPORT_BREAK") == "model" else g

    def model(self):
        model = super().model()
        model.transformer.register_buffer("counts", torch.zeros(3, dtype=torch.int64, device="meta"))
        return model

    def init_parameter(self, name, full, generator):
        if name == "transformer.counts":
            full.copy_(torch.tensor(COUNTS))
        else:
            super().init_parameter(name, full, generator)

    def hf_model(self, model):
        hf = super().hf_model(model)
        if os.environ.get("EXPORT_BREAK") == "config":  # GPT-2 as transformers knows it, described one layer deeper
            hf.config["n_layer"] += 1
            return hf
        hf.tensors["transformer.counts"] = HFTensor("transformer.counts")
        hf.config["model_type"] = "gpt2-counted"
        return hf
