"""`python -m train --config configs/X.yaml key.sub=value ...`: the one way to start training.

Data flows one way: CLI -> config -> distributed setup -> model/optimizer/loaders -> resume -> fit ->
checkpoint -> teardown (always, in `finally`).
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from train import config, data, distributed, model, optim, trainer
from train.checkpoint import EXIT_REQUEUE, Checkpointer
from train.config import ConfigError
from train.log import RunLog

EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML file (configs/default.yaml if omitted)", default="configs/default.yaml")
    p.add_argument("--check", action="store_true", help="validate the config, print it resolved, and exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    return p.parse_args(argv)


def configure_torch(cfg: config.Config) -> None:
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
    torch.backends.cudnn.allow_tf32 = cfg.train.tf32
    torch.backends.cudnn.benchmark = not cfg.train.deterministic
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)


def build(cfg: config.Config, denv: distributed.DistEnv, device: torch.device) -> trainer.Parts:
    stream, eval_loader, num_classes = data.loaders(cfg, denv.rank, denv.world_size, device.type == "cuda")
    log = RunLog(cfg.run_dir, denv)  # only now: a config or data error leaves nothing behind
    raw = model.build(cfg.model, num_classes, cfg.data.image_size).to(device)
    if cfg.train.channels_last:
        raw = raw.to(memory_format=torch.channels_last)
    ddp = DDP(raw, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=cfg.dist.bucket_cap_mb, gradient_as_bucket_view=cfg.dist.gradient_as_bucket_view,
              static_graph=cfg.dist.static_graph, find_unused_parameters=cfg.dist.find_unused_parameters)
    step_model = torch.compile(ddp) if cfg.train.compile else ddp
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    return trainer.Parts(cfg=cfg, device=device, world_size=denv.world_size, raw=raw, ddp=ddp,
                         step_model=step_model, optimizer=optim.build(cfg.optim, raw), scaler=scaler,
                         stream=stream, eval_loader=eval_loader, log=log)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = config.load(args.config, args.overrides)
        denv = distributed.detect()
        config.validate(cfg, denv.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.check:
        import yaml

        print(yaml.safe_dump(config.to_dict(cfg), sort_keys=False), end="")
        return 0

    configure_torch(cfg)
    parts = ckpt = None
    try:
        device = distributed.setup(denv, cfg.dist.backend, cfg.dist.timeout_s)
        parts = build(cfg, denv, device)
        log = parts.log
        ckpt = Checkpointer(cfg, denv.rank, denv.world_size, log)
        ckpt.install_signal_handler()
        if ckpt.resume(parts):  # a mismatched checkpoint raises here, before anything is written
            log.truncate_metrics(parts.step)
        log.run_info(cfg, denv, device)
        if parts.step >= cfg.train.steps:
            log.info(f"run {cfg.run_dir} is already complete at step {parts.step}; nothing to do")
            return 0
        log.info(f"world size {denv.world_size} ({denv.launcher}), device {device}, "
                 f"{cfg.accum_steps(denv.world_size)} micro-step(s) of {cfg.train.micro_batch_size} per rank, "
                 f"run dir {cfg.run_dir}")
        summary = trainer.fit(parts, ckpt)
        ckpt.wait()
        if summary is None:
            return EXIT_REQUEUE
        log.summary(summary)
        log.info(f"done: {summary['steps']} steps, eval accuracy {summary['eval_accuracy']:.4f}, "
                 f"{summary['samples_per_s']:.1f} samples/s, {summary['wall_s']:.1f} s")
        return 0
    except ConfigError as e:
        prefix = f"[rank {denv.rank}] " if denv.world_size > 1 else ""
        print(f"{prefix}error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if ckpt is not None:
            ckpt.wait()  # an asynchronous save in flight is finished, never abandoned
        if parts is not None:
            parts.log.close()
        distributed.teardown()


if __name__ == "__main__":
    sys.exit(main())
