"""The one place a torchrun command line is built.

Every launcher (Makefile, sbatch, PyTorchJob, compose, the image's entrypoint) runs
    python -m train.launch [launcher options] [--] [training arguments]
Each launcher option falls back to an environment variable, its own name first and then the `PET_*`
one that torchrun and the Kubeflow operator use (e.g. --nnodes: NNODES, then PET_NNODES). The
training arguments are checked before torchrun starts, so a bad config fails once, in one line.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping

from train import config
from train.config import ConfigError

EXIT_USAGE = 2

# option -> (its environment variables, default)
OPTIONS = {
    "nnodes": (("NNODES", "PET_NNODES"), "1"),
    "nproc_per_node": (("NPROC_PER_NODE", "PET_NPROC_PER_NODE"), "auto"),
    "node_rank": (("NODE_RANK", "PET_NODE_RANK"), None),
    "rdzv_endpoint": (("RDZV_ENDPOINT", "PET_RDZV_ENDPOINT"), None),
    "rdzv_id": (("RDZV_ID", "PET_RDZV_ID"), "train"),
    "max_restarts": (("MAX_RESTARTS", "PET_MAX_RESTARTS"), "0"),
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m train.launch", description=__doc__.splitlines()[0])
    p.add_argument("--nnodes", help="N or MIN:MAX (elastic)")
    p.add_argument("--nproc-per-node", help="processes per node: a number, or auto (one per GPU, else 2)")
    p.add_argument("--node-rank", help="this node's rank (static rendezvous only)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (omit for one node)")
    p.add_argument("--rdzv-id", help="job id shared by all nodes; keep it across restarts")
    p.add_argument("--max-restarts", help="times torchrun restarts the workers after a failure")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    args, rest = p.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    return args, rest


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str | None]:
    """Each option from the command line, else its environment variables, else its default."""
    out = {}
    for name, (names, default) in OPTIONS.items():
        value = getattr(args, name)
        if value is None:
            value = next((env[n] for n in names if env.get(n)), default)
        out[name] = value
    return out


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_command(opts: dict[str, str | None], train_args: list[str]) -> list[str]:
    nproc = opts["nproc_per_node"]
    if nproc == "auto":
        nproc = str(_gpus() or 2)
    if not str(nproc).isdigit() or int(nproc) < 1:
        raise ConfigError(f"--nproc-per-node must be a positive number or auto, got {nproc!r}")
    nnodes = opts["nnodes"]
    bounds = nnodes.split(":")
    if not (1 <= len(bounds) <= 2 and all(b.isdigit() and int(b) > 0 for b in bounds)
            and int(bounds[0]) <= int(bounds[-1])):
        raise ConfigError(f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got {nnodes!r}")
    if not str(opts["max_restarts"]).isdigit():
        raise ConfigError(f"--max-restarts must be a number >= 0, got {opts['max_restarts']!r}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={opts['max_restarts']}"]
    if opts["rdzv_endpoint"]:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={opts['rdzv_endpoint']}", f"--rdzv-id={opts['rdzv_id']}"]
        if opts["node_rank"] is not None:
            cmd.append(f"--node-rank={opts['node_rank']}")
    elif bounds[-1] == "1":
        cmd.append("--standalone")  # one node: a private rendezvous on a free local port
    else:
        raise ConfigError(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (or RDZV_ENDPOINT)")
    return cmd + ["-m", "train", *train_args]


def _check_training_args(train_args: list[str]) -> None:
    """The same parse `python -m train` does, run once here so a bad config fails before torchrun."""
    from train.__main__ import parse_args as train_parse

    ns = train_parse(train_args)
    config.load(ns.config, ns.overrides)


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    try:
        _check_training_args(train_args)
        cmd = torchrun_command(resolve(args, os.environ), train_args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    proc = subprocess.Popen(cmd)

    def forward(signum, frame):  # torchrun passes SIGTERM/SIGINT on to the workers, which save and stop
        proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
