"""The template's overhead against the DDP loop a user writes, alternated in one run.

    python -m bench.suite.overhead [--rounds 5] [--steps 40] [--json OUT] [--runs-dir DIR]

Speed: `python -m train` (logging every 10 steps, a checkpoint at the end) against bench/baselines/resnet.py (the
tutorial loop: torchvision ImageFolder and transforms, DistributedSampler, a plain torchvision ResNet-18,
the same DDP settings), both with 2 gloo processes on CPU, reading the same ImageFolder of 32 px PNG files
with the same batch, workers and transforms. Each round runs both, in alternating order (the first of a
pair warms the page cache for the second). Per round: the time per step after the first log window; the
ratio train/user. Reported: min, median and max of the per-round ratios. The goal (at most 1.02) counts
as met only when the median is below it by more than the spread (max - min): these machines are noisy.

Same math: bench/baselines/resnet.py --same-math (the project's data set, sampler and model in the same loop) with
the arguments of the first round's `python -m train`: are the final weights bitwise equal? (The template adds
no numerical difference.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import PY, SMOKE_QUIET, imagefolder, run, spread, torchrun, train_records, write_json
from train.checkpoint import dcp_io

GOAL = 1.02


def per_step(times: list[tuple[int, float]], first: int) -> float:
    """Seconds per step between the step `first` and the last one."""
    (s0, t0), (s1, t1) = next(x for x in times if x[0] == first), times[-1]
    return (t1 - t0) / (s1 - s0)


def bitwise_equal(bare_dir: Path, ours_dir: Path, args: list[str]) -> bool:
    """The same-math bare loop with the arguments `python -m train` ran with in ours_dir: the same final weights?"""
    run(torchrun(2, "-m", "bench.baselines.resnet", str(bare_dir), "--same-math", *args))
    latest = (ours_dir / "checkpoints" / "latest").read_text().strip()
    a = dcp_io.read_state(ours_dir / "checkpoints" / latest, keys=("model",))["model"]
    b = torch.load(bare_dir / "model.pt", weights_only=True)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="seconds: tiny images, few steps, one round")
    p.add_argument("--json")
    p.add_argument("--runs-dir", help="write the runs here and keep them (default: a temporary folder); "
                   "`python -m bench all --smoke` reads its ImageFolder figures from the first round's python -m train")
    args = p.parse_args()
    steps, size, per_class, first, quiet = args.steps, 32, 128, 10, []
    if args.smoke:
        steps, size, per_class, first, quiet, args.rounds = 4, 16, 8, 2, SMOKE_QUIET, 1
    # The smoke's loaders load in the main process: a loader worker of the tutorial loop outlives its rank's
    # os._exit by seconds (it holds the output pipe until its watchdog sees the parent gone), and the smoke
    # checks that the script runs, not its figures.
    micro, workers, lr = (32, 1, 0.03) if not args.smoke else (8, 0, 0.03)
    common = [f"train.steps={steps}", "train.eval_every=0", "checkpoint.every=0", f"train.log_every={first}",
              f"task.image_size={size}", f"data.num_workers={workers}", f"optim.lr={lr}",
              f"train.micro_batch_size={micro}", f"train.global_batch_size={2 * micro}", *quiet]
    ours_t, user_t, ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as d:
        d = Path(args.runs_dir or d)
        d.mkdir(parents=True, exist_ok=True)
        folder = imagefolder(d / "imgs", per_class, size=size)
        for r in range(args.rounds):
            user_dir, ours_dir = d / f"user{r}", d / f"ours{r}"
            data = ["task.data=imagefolder", f"task.path={folder}"]
            commands = {"user": torchrun(2, "-m", "bench.baselines.resnet", str(user_dir), *common, *data),
                        "train": torchrun(2, "-m", "train", "--config", "configs/default.yaml", *common, *data,
                                          f"run.dir={ours_dir}")}
            for name in (["user", "train"] if r % 2 == 0 else ["train", "user"]):
                run(commands[name])
            user = json.loads((user_dir / "times.json").read_text())["times"]
            user_t.append(per_step(list(enumerate(user, start=1)), first))
            ours_t.append(per_step([(rec["step"], rec["time"]) for rec in train_records(ours_dir)], first))
            ratios.append(ours_t[-1] / user_t[-1])
            print(f"round {r + 1}: user loop {user_t[-1]:.4f} s/step, python -m train {ours_t[-1]:.4f} s/step, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        equal = bitwise_equal(d / "bare", d / "ours0", [*common, "task.data=imagefolder", f"task.path={folder}"])
    s = spread(ratios)
    met = GOAL - s["median"] > s["max"] - s["min"]
    print(f"python -m train / the user's DDP loop (2 gloo processes, CPU, {args.rounds} rounds): step-time ratio "
          f"min {s['min']:.3f}, median {s['median']:.3f}, max {s['max']:.3f}; goal <= {GOAL} by more than the "
          f"spread: {'met' if met else 'NOT met'}")
    print(f"final weights bitwise equal to the same math in a hand-written loop: {equal} (goal: yes)")
    write_json(args.json, {"overhead_ratio": s["median"], "overhead_ratio_min": s["min"],
                           "overhead_ratio_max": s["max"], "overhead_goal_met": met, "overhead_ratios": ratios,
                           "user_s_per_step": statistics.median(user_t), "train_s_per_step": statistics.median(ours_t),
                           "bitwise_equal": equal, "rounds": args.rounds, "python": PY})


if __name__ == "__main__":
    main()
