"""What the template adds to a training step, part by part, in ms per step (2 gloo processes on CPU).

    torchrun --nproc-per-node 2 bench/step_parts.py [lm|resnet]

Times, on rank 0, each piece of train/trainer.py's loop that a bare loop does not have, called the way the
trainer calls it, between real training steps of the task's model (so the ranks arrive at a collective
as they do in training: after DDP's last all-reduce of the step): the stop all-reduce
(StopRequest.agreed), the StepMeter's context managers, RunLog.advance, to_device, the loss-window
bookkeeping, the per-sample RNG seeding of SeededSamples (in the main process here; a loader worker does
it in training), and the loader's hand-over of a batch (next() on the template's DataLoader with one
forkserver worker against the bare loop's batch). Printed, not asserted.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from train import config, optim  # noqa: E402
from train.observe.metrics import StepMeter  # noqa: E402
from train.parallel import data  # noqa: E402

N = 30
BLOCKS = int(os.environ.get("BLOCKS", "6"))


def ms(f, n=N) -> float:
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "lm"
    over = ["task.train_tokens=200000", "task.eval_tokens=8192"] if which == "lm" else ["task.train_samples=1024"]
    cfg = config.load("configs/gpt.yaml" if which == "lm" else "configs/default.yaml", over)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    task = cfg.task_class(cfg.task, cfg.seed)
    train_set, eval_set = task.datasets()
    net = task.model()
    ddp = DDP(net, bucket_cap_mb=25, gradient_as_bucket_view=True)
    opt = optim.build(cfg.optim, net)
    stream, _ = data.loaders(cfg, train_set, eval_set, rank, world, False)
    batches = iter(stream)
    batch = next(batches)

    def step():
        loss = task.loss(ddp, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    out = {}

    def between_steps(name, f, reps=10):
        """f's time right after a real step (ranks as they arrive in training), averaged over reps."""
        total = 0.0
        for _ in range(reps):
            step()
            t = time.perf_counter()
            f()
            total += time.perf_counter() - t
        out[name] = total / reps * 1e3

    def stop_allreduce():
        flag = torch.tensor([0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bool(flag.item())

    dist.barrier()
    out["step (forward, backward, AdamW/SGD step), ms"] = ms(step, 10)
    between_steps("stop all-reduce after a step (StopRequest.agreed)", stop_allreduce)
    dist.barrier()
    out["stop all-reduce, ranks already together"] = ms(stop_allreduce, 200)
    meter = StepMeter(torch.device("cpu"), world, cfg.train.micro_batch_size)

    def meter_calls():
        with meter.waiting_for_data():
            pass
        with meter.computing():
            pass
        meter.step_done()

    out["StepMeter context managers + step_done"] = ms(meter_calls, 2000)
    parts = type("P", (), {"device": torch.device("cpu"), "cfg": cfg})()
    from train.parallel.data import to_device

    out["to_device(batch)"] = ms(lambda: to_device(parts, batch), 2000)
    window = torch.zeros(())

    def bookkeeping():
        optim.set_lr(opt, optim.lr_at(5, 100, cfg.optim))
        total = torch.zeros(())
        loss = torch.tensor(1.0) / 1
        total += loss.detach().float()
        window.add_(total)

    out["set_lr + loss-window tensors"] = ms(bookkeeping, 2000)
    seeded = data.SeededSamples(train_set, cfg.seed)
    b = cfg.train.micro_batch_size
    out[f"dataset[i] x {b} (a micro-batch), bare"] = ms(lambda: [train_set[i] for i in range(b)], 50)
    out[f"SeededSamples[(i, 0)] x {b} (seeding + state restore)"] = ms(lambda: [seeded[(i, 0)] for i in range(b)], 50)
    out[f"SeededSamples._seeded x {b} (seeding only: a worker)"] = ms(
        lambda: [seeded._seeded(i, i) for i in range(b)], 50)
    between_steps("next(batch) from the template's loader (1 forkserver worker), after a step",
                  lambda: next(batches))
    # The stop all-reduce's net cost: blocks of steps alternating without it, with it (synchronous, as
    # StopRequest.agreed), and started asynchronously after a step and read after the next one (one step late).
    pending = [None, torch.zeros(1)]

    def async_stop():
        if pending[0] is not None:
            pending[0].wait()
            bool(pending[1].item())
        pending[1] = torch.tensor([0.0])
        pending[0] = dist.all_reduce(pending[1], op=dist.ReduceOp.MAX, async_op=True)

    variants = {"steps without a stop check": lambda: None, "steps + synchronous stop all-reduce": stop_allreduce,
                "steps + asynchronous stop all-reduce (read one step later)": async_stop}
    per_step = {k: [] for k in variants}
    for _ in range(BLOCKS):
        for name, extra in variants.items():
            dist.barrier()
            t = time.perf_counter()
            for _ in range(4):
                step()
                extra()
            per_step[name].append((time.perf_counter() - t) / 4 * 1e3)
    if pending[0] is not None:
        pending[0].wait()
    for name, v in per_step.items():
        out[f"{name}: median of {BLOCKS} blocks of 4, ms/step"] = statistics.median(v)
    if rank == 0:
        print(f"{which}: ms per call on rank 0 (2 gloo processes, CPU)")
        for k, v in out.items():
            print(f"  {k:<75} {v:8.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
