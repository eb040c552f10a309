"""`python -m train --config configs/X.yaml key.sub=value ...`: the one way to start training.

Data flows one way: CLI -> config -> distributed setup -> model/optimizer/loaders -> resume -> fit ->
checkpoint -> teardown. Config errors are found before any process group exists: one line, exit 2 (the task.name
module is imported to check its keys).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

from train import config
from train.config import parse_args
from train.errors import EXIT_USAGE, LAUNCH_ID_VAR, ConfigError, say
from train.startup import STANDBY_VAR, frozen_imports, stand_by
from train.stops import markers, signals
from train.supported import check_torch

USAGE_WAIT_S = 60  # how long a worker with a usage error waits for the launcher to end it


def _mark_usage_error(run_dir: Path, error: str) -> bool:
    """Under the launcher (train/launch/launcher.py), which would otherwise see torchrun restart the workers as after
    a crash: tell it that this one is a usage error, so it stops torchrun and says the line, once, as its last
    (.launch/<its launch id>.USAGE_ERROR; the ranks of one node write the same one, the last rename wins).
    Whether it was written: where not, this rank says its line itself."""
    try:
        launch = os.environ[LAUNCH_ID_VAR]
        markers.write(run_dir, "USAGE_ERROR", {"time": time.time(), "error": error, "launch_id": launch})
    except OSError:
        return False  # the launcher then sees an ordinary failure
    return True


def _to_rank_log(run_dir: Path, rank: int, error: str) -> None:
    """The rank's error into its log file (<run_dir>/logs/rank<N>.log, as train/observe/log.py writes it), where the
    launcher, not the rank, says it on the console."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        with open(run_dir / "logs" / f"rank{rank}.log", "a") as f:
            f.write(f"{stamp} [rank {rank}] ERROR {error}\n")
    except OSError:
        pass  # the launcher's line is the one the user reads


def _wait_for_the_launcher() -> None:
    """After the USAGE_ERROR marker: wait for the launcher to stop torchrun (it polls twice a second); exiting now
    would let torchrun restart this worker, which would fail the same way (--max-restarts times)."""
    if (distributed := sys.modules.get("train.parallel.distributed")) is not None:
        # The error may have come at a batch: that loader's workers end now, not killed with this process by the
        # launcher (their queues' semaphores would be reported as leaked).
        distributed.release_loader_workers()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    if signals.received():
        return  # it came already (for another rank's marker, say), taken by the trainer's handler: no wait
    time.sleep(USAGE_WAIT_S)


def main(argv: list[str] | None = None) -> int:
    """Usage errors, whether found in the config or by the trainer (data, devices, checkpoints, tracker),
    end here: exit 2 and one line, said by this process, or under the launcher a marker (so that torchrun does not
    retry them) whose line the launcher says once for every rank, this rank's line going to its log file."""
    args = parse_args(argv)
    cfg = denv = None
    try:
        # A torch outside the supported range: refused, or one warning (the launcher's, else rank 0's)
        if (warning := check_torch()) and not os.environ.get(LAUNCH_ID_VAR) and os.environ.get("RANK", "0") == "0":
            say(warning)
        cfg = config.load(args.config, args.overrides)
        markers.forget_earlier_rounds(cfg.run_dir)
        with frozen_imports():  # torch: only once the config is known to be good
            from train.parallel import distributed

        denv = distributed.detect()
        config.validate(cfg, denv.world_size, denv.local_world_size)
        if args.check:
            import yaml

            from train import relaunch

            relaunch.check_record(cfg)  # a relaunch's changes, as the launcher and train.submit check them

            print(yaml.safe_dump(config.to_dict(cfg), sort_keys=False), end="")
            return 0
        with frozen_imports():
            from train import trainer

        return trainer.run(cfg, denv)
    except ConfigError as e:
        error = e.line()  # one raised in a loader worker comes back with the worker's traceback: not shown
        prefix = f"[rank {denv.rank}] " if denv is not None and denv.world_size > 1 else ""
        line = f"{prefix}error: {error}"
    # Out of the except block the traceback is let go, and with it the frames that held a loader's iterator: its
    # workers end now, not killed with this process by the launcher (their queues' semaphores left behind).
    if cfg is None or not os.environ.get(LAUNCH_ID_VAR):
        say(line)  # alone, or under a bare torchrun or srun: each rank says it
        return EXIT_USAGE
    # Under the launcher, its last line says it, once (docs/launcher.md): every rank saying it too would show it
    # once per rank more. The rank's own line goes to its log file first (the launcher may stop it at once).
    rank = denv.rank if denv is not None else int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else 0
    _to_rank_log(cfg.run_dir, rank, error)
    if not _mark_usage_error(cfg.run_dir, error):
        say(line)
        return EXIT_USAGE
    _wait_for_the_launcher()
    return EXIT_USAGE


def _preload() -> None:
    """What a worker imports before it trains (torch, the task's module, the trainer), for a standby to have done
    before its round (train/launch/standby.py)."""
    args = parse_args(sys.argv[1:])
    config.load(args.config, args.overrides)
    from train import trainer  # noqa: F401


if __name__ == "__main__":
    if STANDBY_VAR in os.environ:
        stand_by(_preload)
    try:
        code = main()
    except (Exception, KeyboardInterrupt):
        if "train.parallel.distributed" not in sys.modules:
            raise
        # A failure nobody explained (a bug in a model or data set, say): its traceback, and exit 1 at once.
        # Not through the interpreter's exit: multiprocessing's would join the loader workers, which ignore
        # the SIGTERM it sends them (stop signals are the training process's), and wait forever.
        traceback.print_exc()
        code = 1
    if "train.parallel.distributed" in sys.modules:  # a process group existed: see exit_process() for why not sys.exit
        sys.modules["train.parallel.distributed"].exit_process(code)
    sys.exit(code)
