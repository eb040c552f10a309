"""The template's overhead on the language model against a nanoGPT-style DDP loop, alternated in one run.

    python -m bench.suite.lm_overhead [--rounds 7] [--steps 60] [--json OUT]

Speed: `python -m train --config configs/gpt.yaml` (the tiny GPT, 0.8M parameters, 128-token windows,
micro-batch 16 on each of 2 ranks, AdamW, clipping; logging every 10 steps, W&B and the report off, no
checkpoint but the final one, evaluation only at the end) against bench/baselines/gpt.py (nanoGPT's loop: its
own np.memmap data path and random windows, the same GPT from train/tasks/gpt_model.py, the same overrides of
configs/gpt.yaml, so the same hyper-parameters, and DDP settings), both with 2 gloo processes on CPU, reading the
same tokens (the built-in corpus written once as nanoGPT's train.bin and val.bin).
Each round runs both, in alternating order.

Per round, each loop's time per step: the median over the log windows of 10 steps after the first window
(each window holds one log step; start-up, the first window and what follows the last step, the final
checkpoint and evaluation, are out), from metrics.jsonl's timestamps and from the bare loop's wall clock
after each step. Also the mean over the whole span (steps 11..N). Reported: min, median and max of the
per-round ratios template/bare; the goal (at most 1.02) counts as met only when the median is below it by
more than the spread (max - min).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench.common import PY, SMOKE_QUIET, run, spread, torchrun, train_records, write_json

GOAL = 1.02


def windows(times: dict[int, float], first: int, every: int, last: int) -> tuple[float, float]:
    """(median over windows of `every` steps, mean over the span) of seconds per step, from step `first`."""
    marks = list(range(first, last + 1, every))
    per_window = [(times[b] - times[a]) / (b - a) for a, b in zip(marks, marks[1:], strict=False)]
    return statistics.median(per_window), (times[marks[-1]] - times[first]) / (marks[-1] - first)


def corpus(folder: Path, train_tokens: int, eval_tokens: int) -> Path:
    """The built-in corpus of configs/gpt.yaml (seed 0), as nanoGPT's train.bin and val.bin."""
    from train.tasks.gpt import builtin_tokens

    folder.mkdir(parents=True)
    builtin_tokens(0, train_tokens, "train").astype(np.uint16).tofile(folder / "train.bin")
    builtin_tokens(0, eval_tokens, "val").astype(np.uint16).tofile(folder / "val.bin")
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--smoke", action="store_true", help="seconds: the nano GPT, few steps, one round")
    p.add_argument("--json")
    args = p.parse_args()
    steps, every, model, seq, quiet = args.steps, 10, "tiny", 128, ["log.wandb.mode=disabled", "log.report=false"]
    if args.smoke:
        steps, every, model, seq, args.rounds = 4, 2, "nano", 64, 1
        quiet = SMOKE_QUIET
    micro, lr, vocab = 16, 3e-3, 64
    ours_t, bare_t, ratios, span_ratios = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-lm-") as d:
        d = Path(d)
        data = corpus(d / "tokens", 1_000_000 if not args.smoke else 50_000, 16_384 if not args.smoke else 4096)
        for r in range(args.rounds):
            bare_dir, ours_dir = d / f"bare{r}", d / f"ours{r}"
            common = [f"task.data={data}", "task.format=nanogpt", f"task.model={model}", f"task.vocab_size={vocab}",
                      f"task.seq_len={seq}", f"optim.lr={lr}", f"train.steps={steps}",
                      f"train.micro_batch_size={micro}", f"train.global_batch_size={2 * micro}",
                      f"train.log_every={every}", "train.eval_every=0", "checkpoint.every=0", *quiet]
            commands = {"bare": torchrun(2, "-m", "bench.baselines.gpt", str(bare_dir), f"--data={data}", *common),
                        "train": torchrun(2, "-m", "train", "--config", "configs/gpt.yaml", *common,
                                          f"run.dir={ours_dir}")}
            for name in (["bare", "train"] if r % 2 == 0 else ["train", "bare"]):
                run(commands[name])
            bare = dict(enumerate(json.loads((bare_dir / "times.json").read_text())["times"], start=1))
            ours = {rec["step"]: rec["time"] for rec in train_records(ours_dir)}
            (b, b_span), (o, o_span) = windows(bare, every, every, steps), windows(ours, every, every, steps)
            bare_t.append(b)
            ours_t.append(o)
            ratios.append(o / b)
            span_ratios.append(o_span / b_span)
            print(f"round {r + 1}: bare nanoGPT loop {b:.4f} s/step, python -m train {o:.4f} s/step, ratio "
                  f"{ratios[-1]:.3f} (whole span: {b_span:.4f}, {o_span:.4f}, ratio {span_ratios[-1]:.3f})",
                  flush=True)
    s, sp = spread(ratios), spread(span_ratios)
    met = GOAL - s["median"] > s["max"] - s["min"]
    print(f"python -m train / the bare nanoGPT loop, LM (2 gloo processes, CPU, {args.rounds} rounds): step-time "
          f"ratio min {s['min']:.3f}, median {s['median']:.3f}, max {s['max']:.3f}; goal <= {GOAL} by more than "
          f"the spread: {'met' if met else 'NOT met'} (whole-span means: min {sp['min']:.3f}, median "
          f"{sp['median']:.3f}, max {sp['max']:.3f})")
    write_json(args.json, {"lm_overhead_ratio": s["median"], "lm_overhead_ratio_min": s["min"],
                           "lm_overhead_ratio_max": s["max"], "lm_overhead_goal_met": met,
                           "lm_overhead_span_ratio": sp["median"], "lm_overhead_ratios": ratios,
                           "lm_bare_s_per_step": statistics.median(bare_t),
                           "lm_train_s_per_step": statistics.median(ours_t), "lm_rounds": args.rounds,
                           "python": PY})


if __name__ == "__main__":
    main()
