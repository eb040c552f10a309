"""The built-in images at ResNet-50's size through the trainer's loader: what the workers deliver, uint8 pixels
(ArrayDataset today: ImageClassification.pixels normalizes them on the device) against float32 ones normalized in
the workers (what ArrayDataset did before; on an H200 ResNet-50 at 224 px then waited for data 60% of its steps).

    python -m bench.studies.image_loader [--size 224] [--batch 256] [--workers 2] [--batches 12] [--json OUT]
    python -m bench.studies.image_loader --smoke        # seconds: tiny sizes, a check of the script

The loader alone (no model): images/s and the bytes of a batch, for each pipeline, the two alternated in rounds
(min/median/max over rounds: this machine is shared); the first batch of each loader (worker start) is not timed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import write_json
from train import config
from train.parallel import data
from train.tasks import image


class FloatPixels(torch.utils.data.Dataset):
    """ArrayDataset's samples as it made them before: float32, scaled and normalized in the worker."""

    def __init__(self, base: image.ArrayDataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        x, y = self.base[index]
        return (x.float().div_(255) - 0.5) / 0.25, y


def images_per_s(dataset, cfg, batches: int) -> tuple[float, int]:
    stream, _ = data.loaders(cfg, dataset, dataset, 0, 1, torch.cuda.is_available())
    it = iter(stream)
    x, _ = next(it)  # the workers' start
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - t
    del it
    return batches * cfg.train.micro_batch_size / seconds, x.numel() * x.element_size()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    if args.smoke:
        args.size, args.batch, args.workers, args.batches, args.rounds = 32, 16, 1, 2, 1
    n = args.batch * (args.batches + 2)
    cfg = config.load("configs/default.yaml", [f"train.global_batch_size={args.batch}",
                                               f"train.micro_batch_size={args.batch}",
                                               f"data.num_workers={args.workers}"])
    images, labels = image.builtin(n, 10, args.size, 0, "train")
    uint8 = image.ArrayDataset(images, labels, augment=True)
    pipelines = {"uint8": uint8, "float32": FloatPixels(uint8)}
    rates: dict[str, list[float]] = {k: [] for k in pipelines}
    nbytes = {}
    for _ in range(args.rounds):
        for name, ds in pipelines.items():
            rate, nbytes[name] = images_per_s(ds, cfg, args.batches)
            rates[name].append(rate)
    fig: dict = {"size": args.size, "batch": args.batch, "workers": args.workers}
    for name, r in rates.items():
        fig[f"{name}_images_per_s"] = statistics.median(r)
        fig[f"{name}_batch_mib"] = nbytes[name] / 2**20
        print(f"{name:8s} {statistics.median(r):8.0f} images/s (min {min(r):.0f}, max {max(r):.0f}), "
              f"a batch {nbytes[name] / 2**20:.1f} MiB")
    ratios = [a / b for a, b in zip(rates["uint8"], rates["float32"], strict=True)]
    fig["uint8_over_float32"] = statistics.median(ratios)
    print(f"uint8 / float32: {fig['uint8_over_float32']:.2f} (per round: {', '.join(f'{x:.2f}' for x in ratios)}), "
          f"{args.workers} workers, {args.size} px, batches of {args.batch}")
    write_json(args.json, fig)


if __name__ == "__main__":
    main()
