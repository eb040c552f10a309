"""The template's overhead against a bare DDP loop, alternated in one run.

    python bench/overhead.py [--rounds 3] [--steps 40] [--json OUT]

Both run with 2 gloo processes on CPU, the default config (ResNet-18, built-in data, global batch 64):
`python -m train` (logging every 10 steps, a checkpoint at the end) and bench/bare_ddp.py. Reports the
median time per step over the steps after the first log window, their ratio (goal: at most 1.02),
and whether the final weights are bitwise equal (goal: yes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from _util import PY, SMOKE_QUIET, run, torchrun, train_records, write_json


def per_step(times: list[tuple[int, float]], first: int) -> float:
    """Seconds per step between the step `first` and the last one."""
    (s0, t0), (s1, t1) = next(x for x in times if x[0] == first), times[-1]
    return (t1 - t0) / (s1 - s0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="seconds: tiny images, few steps, one round")
    p.add_argument("--json")
    args = p.parse_args()
    common = [f"train.steps={args.steps}", "train.eval_every=0", "checkpoint.every=0"]
    first = 10
    if args.smoke:
        common = ["train.steps=6", "train.eval_every=0", "checkpoint.every=0", "data.num_workers=0",
                  "data.image_size=16", "data.train_samples=256", "data.eval_samples=32", "train.log_every=2",
                  *SMOKE_QUIET]
        args.rounds, first = 1, 2
    ours_t, bare_t, equal = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as d:
        for r in range(args.rounds):
            bare_dir, ours_dir = Path(d) / f"bare{r}", Path(d) / f"ours{r}"
            run(torchrun(2, "bench/bare_ddp.py", str(bare_dir), *common))
            run(torchrun(2, "-m", "train", "--config", "configs/default.yaml", *common, f"run.dir={ours_dir}"))
            bare_times = list(enumerate(json.loads((bare_dir / "times.json").read_text()), start=1))
            ours_times = [(rec["step"], rec["time"]) for rec in train_records(ours_dir)]
            bare_t.append(per_step(bare_times, first))
            ours_t.append(per_step(ours_times, first))
            latest = (ours_dir / "checkpoints" / "latest").read_text().strip()
            a = torch.load(ours_dir / "checkpoints" / latest, weights_only=True)["model"]
            b = torch.load(bare_dir / "model.pt", weights_only=True)
            equal.append(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))
            print(f"round {r + 1}: bare {bare_t[-1]:.4f} s/step, train {ours_t[-1]:.4f} s/step, "
                  f"bitwise equal: {equal[-1]}", flush=True)
    ratio = statistics.median(ours_t) / statistics.median(bare_t)
    print(f"python -m train vs bare DDP loop (2 gloo processes, CPU): median step-time ratio {ratio:.3f} "
          f"(goal <= 1.02), final weights bitwise equal: {all(equal)} (goal: yes)")
    write_json(args.json, {"overhead_ratio": ratio, "bare_s_per_step": statistics.median(bare_t),
                           "train_s_per_step": statistics.median(ours_t), "bitwise_equal": all(equal),
                           "rounds": args.rounds, "python": PY})


if __name__ == "__main__":
    main()
