"""What naming a hung rank costs (train/parallel/hang.py): its set-up on against off, alternated in one run.

    python -m bench.studies.hang_cost [--rounds 5] [--steps 60] [--collectives 2000]

On is what the launcher gives the workers: the flight recorder (TORCH_FR_BUFFER_SIZE=2000) and each rank's
answering thread (blocked on the store); off is TORCH_FR_BUFFER_SIZE=0 and TRAIN_HANG_REPORT=0.
- Per step: `python -m train` with 2 gloo processes on CPU (the default ResNet-18 at 32 px, builtin data),
  on and off in alternating order each round; per round the time per step after the first log window and
  the ratio on/off; reported: min, median and max of the ratios (goal: median <= 1.01).
- Per collective: 2 processes, `--collectives` all-reduces of 1024 floats each, on and off: the flight
  recorder's own cost, in microseconds (a step of DDP runs a few: one per gradient bucket, one buffer
  broadcast).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.common import PY, SMOKE_QUIET, run, spread, torchrun, train_records, write_json
from bench.suite.overhead import per_step

GOAL = 1.01
ON = {"TORCH_FR_BUFFER_SIZE": "2000", "TRAIN_HANG_REPORT": "1"}
OFF = {"TORCH_FR_BUFFER_SIZE": "0", "TRAIN_HANG_REPORT": "0"}

COLLECTIVES = """
import json, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x, n = torch.ones(1024), int(sys.argv[1])
for _ in range(50):
    dist.all_reduce(x)
dist.barrier()
t = time.perf_counter()
for _ in range(n):
    dist.all_reduce(x)
us = (time.perf_counter() - t) / n * 1e6
if dist.get_rank() == 0:
    print(json.dumps({"us": us}))
dist.destroy_process_group()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--collectives", type=int, default=2000)
    p.add_argument("--smoke", action="store_true", help="seconds: tiny images, few steps, one round")
    p.add_argument("--json")
    args = p.parse_args()
    steps, size, first, micro = args.steps, 32, 10, 32
    if args.smoke:
        steps, size, first, micro, args.rounds, args.collectives = 6, 16, 2, 8, 1, 200
    common = [f"train.steps={steps}", "train.eval_every=0", "checkpoint.every=0", f"train.log_every={first}",
              f"task.image_size={size}", "data.num_workers=1", f"train.micro_batch_size={micro}",
              f"train.global_batch_size={2 * micro}", *SMOKE_QUIET]
    times: dict[str, list[float]] = {"on": [], "off": []}
    coll: dict[str, list[float]] = {"on": [], "off": []}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="bench-hang-") as d:
        d = Path(d)
        script = d / "collectives.py"
        script.write_text(COLLECTIVES)
        for r in range(args.rounds):
            for name in (["on", "off"] if r % 2 == 0 else ["off", "on"]):
                env = ON if name == "on" else OFF
                run_dir = d / f"{name}{r}"
                run(torchrun(2, "-m", "train", "--config", "configs/default.yaml", *common, f"run.dir={run_dir}"),
                    **env)
                times[name].append(per_step([(x["step"], x["time"]) for x in train_records(run_dir)], first))
                out = run(torchrun(2, str(script), str(args.collectives)), **env).stdout
                coll[name].append(json.loads(out.strip().splitlines()[-1])["us"])
            ratios.append(times["on"][-1] / times["off"][-1])
            print(f"round {r + 1}: on {times['on'][-1]:.4f} s/step, off {times['off'][-1]:.4f} s/step, ratio "
                  f"{ratios[-1]:.3f}; all-reduce on {coll['on'][-1]:.1f} us, off {coll['off'][-1]:.1f} us", flush=True)
    s = spread(ratios)
    c_on, c_off = spread(coll["on"])["median"], spread(coll["off"])["median"]
    print(f"hang reporting on / off (2 gloo processes, CPU, {args.rounds} rounds, {PY}): step-time ratio min "
          f"{s['min']:.3f}, median {s['median']:.3f}, max {s['max']:.3f} (goal: median <= {GOAL})")
    print(f"flight recorder per all-reduce (1024 floats, median of {args.rounds}): on {c_on:.1f} us, "
          f"off {c_off:.1f} us, difference {c_on - c_off:+.1f} us")
    write_json(args.json, {"hang_cost_ratio": s["median"], "hang_cost_ratio_min": s["min"],
                           "hang_cost_ratio_max": s["max"], "hang_cost_ratios": ratios,
                           "allreduce_us_on": c_on, "allreduce_us_off": c_off, "rounds": args.rounds})


if __name__ == "__main__":
    main()
