"""`python -m train`, except that the model's every forward draws from torch's, numpy's and Python's global
random generators and lets the draws scale its input slightly.

Training itself draws nothing from them (augmentation and sampling have generators of their own), so
without this a resume that forgot to restore them, or restored another rank's, would still be bitwise
exact and the checkpoint's RNG states would go untested. With it, every such mistake changes the weights.

    torchrun --nproc-per-node 2 tests/rng_draws.py --config configs/default.yaml key=value ...
"""

import random
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from train import task_loader  # noqa: E402

_load_class = task_loader.load_class


def _draw(module, args):
    noise = torch.rand(()).item() + float(np.random.rand()) + random.random()
    return (args[0] * (1 + 1e-2 * noise),)


def load_class(spec: str):
    """The run's task (whichever task.name says), its model() patched to add the draws."""
    cls = _load_class(spec)
    build = cls.model
    if getattr(build, "draws", False):  # loaded before in this process: patched once
        return cls

    def model(self):
        net = build(self)
        net.register_forward_pre_hook(_draw)
        return net

    model.draws = True
    cls.model = model
    return cls


task_loader.load_class = load_class  # train.config imports it when it loads the config
runpy.run_module("train", run_name="__main__", alter_sys=True)
