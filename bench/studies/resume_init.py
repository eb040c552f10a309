"""What a relaunch saves by drawing no random init for what it loads (train/trainer.py: _loaded_whole).

    python -m bench.studies.resume_init [--layers 16] [--embd 1024] [--repeats 3]

The built-in GPT (by default 16 layers, 1024 wide, GPT-2's vocabulary: 254M parameters) is built on the meta
device and given its memory and values as the trainer's build does (wrapping.materialize): a fresh run draws
every tensor (task.init_parameter, on the CPU, as every rank does whatever its shard); a launch that resumes a
checkpoint (or loads init_from) skips the tensors that it then overwrites whole. Both are timed, interleaved,
in this one process; each rank of a launch saves the difference. The draw rate gives the figure at 7B.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--embd", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import torch

    from train import config
    from train.parallel import wrapping

    torch.set_num_threads(1)  # as a rank of python -m train (OMP_NUM_THREADS=1)
    cfg = config.load("configs/gpt.yaml", [f"task.n_layer={args.layers}", f"task.n_embd={args.embd}",
                                           f"task.n_head={args.embd // 64}", "task.vocab_size=50257",
                                           "task.seq_len=1024"])
    task = cfg.task_class(cfg.task, cfg.seed)
    times: dict[str, list[float]] = {"fresh": [], "resume": []}
    for _ in range(args.repeats):
        for kind in times:
            model = task.model()
            skip = set(model.state_dict()) if kind == "resume" else set()  # a resume loads the whole state
            t = time.perf_counter()
            wrapping.materialize(model, task, torch.device("cpu"), cfg.seed, skip=skip)
            times[kind].append(time.perf_counter() - t)
            n = sum(p.numel() for p in model.parameters())
            del model
    fresh, resume = statistics.median(times["fresh"]), statistics.median(times["resume"])
    print(f"model: {n / 1e6:.0f}M parameters ({args.layers} layers, {args.embd} wide, vocabulary 50257), "
          f"{args.repeats} interleaved repeats, medians (all: {', '.join(f'{k} {v}' for k, v in times.items())})")
    print(f"fresh run, every tensor drawn:     {fresh:7.2f} s")
    print(f"resume, nothing drawn it loads:    {resume:7.2f} s")
    print(f"saved per rank and launch:         {fresh - resume:7.2f} s ({n / (fresh - resume) / 1e6:.0f}M parameters/s "
          f"drawn: {7e9 / (n / (fresh - resume)):.0f} s at 7B)")


if __name__ == "__main__":
    main()
