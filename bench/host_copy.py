"""The host copy of an asynchronous save (checkpoint.async: DCP's DefaultStager.stage, as the writer thread runs it),
with the stager reused against a fresh one each save: what a torch whose stager cannot be reused (2.11:
dcp_io.stager_reusable) costs. ResNet-50's weights and one state tensor per parameter (~195 MiB), one process, one
thread, interleaved, medians of 7.

    python bench/host_copy.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

from train.checkpoint.dcp_io import stager_reusable  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    model = torchvision.models.resnet50()
    state = {"model": model.state_dict(),
             "optimizer": {k: torch.randn_like(p) for k, p in model.named_parameters()}}
    options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                             use_non_blocking_copy=False)

    def timed(stager: DefaultStager) -> float:
        t = time.perf_counter()
        stager.stage(state)
        return time.perf_counter() - t

    reusable = stager_reusable()
    kept = DefaultStager(options)
    timed(kept)  # its first copy allocates the host memory
    fresh, reused = [], []
    for _ in range(7):
        fresh.append(timed(DefaultStager(options)))
        if reusable:
            reused.append(timed(kept))
    line = f"torch {torch.__version__}: a fresh stager each save {statistics.median(fresh) * 1e3:.0f} ms"
    print(line + (f", one reused {statistics.median(reused) * 1e3:.0f} ms" if reused else
                  " (this torch's stager cannot be reused)"))


if __name__ == "__main__":
    main()
