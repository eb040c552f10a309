"""`python -m train --config configs/X.yaml key.sub=value ...`: the one way to start training.

Data flows one way: CLI -> config -> distributed setup -> model/optimizer/loaders -> resume -> fit ->
checkpoint -> teardown. Config errors are found before torch is even imported: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from train import config
from train.config import ConfigError

EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML file (default: configs/default.yaml)", default="configs/default.yaml")
    p.add_argument("--check", action="store_true", help="validate the config, print it resolved, and exit")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    return p.parse_args(argv)


def _mark_usage_error(run_dir: Path, error: str) -> None:
    """Under torchrun, which would restart the workers on any failure: tell the launcher (train/launch.py)
    that this one is a usage error, so it stops torchrun instead of letting it retry (every rank writes
    the same marker; the last rename wins)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".USAGE_ERROR.{os.getpid()}"
        tmp.write_text(json.dumps({"time": time.time(), "error": error}))
        os.replace(tmp, run_dir / "USAGE_ERROR")
    except OSError:
        pass  # the launcher then sees an ordinary failure


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = None
    try:
        cfg = config.load(args.config, args.overrides)
        from train import distributed  # imports torch: only once the config is known to be good

        denv = distributed.detect()
        config.validate(cfg, denv.world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        if cfg is not None and os.environ.get("TORCHELASTIC_RUN_ID"):
            _mark_usage_error(cfg.run_dir, str(e))
        return EXIT_USAGE
    if args.check:
        import yaml

        print(yaml.safe_dump(config.to_dict(cfg), sort_keys=False), end="")
        return 0
    from train import trainer

    return trainer.run(cfg, denv)


if __name__ == "__main__":
    code = main()
    if "train.distributed" in sys.modules:  # a process group existed: see exit_process() for why not sys.exit
        sys.modules["train.distributed"].exit_process(code)
    sys.exit(code)
