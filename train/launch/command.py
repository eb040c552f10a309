"""The one place a torchrun command line is built: the launcher's options (each falls back to its environment
variables), the training arguments checked before torchrun starts a worker, and the workers' environment.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from train import config
from train.errors import EXIT_REQUEUE, EXIT_USAGE, ConfigError
from train.launch.rendezvous import check_conf, split_endpoint

# The launcher's own code for "stopped after a checkpoint, relaunch me" where a scheduler needs another one
# (3-255): the PyTorchJob's restartPolicy ExitCode retries only 128-255 (k8s/pytorchjob.yaml sets 143).
REQUEUE_CODE_VAR = "REQUEUE_EXIT_CODE"
# The launcher's code for a usage error where a restart policy cannot tell it from a failure: Docker's
# `restart: on-failure` restarts every exit but 0, so docker-compose.yml sets 0 (its line then says so).
USAGE_CODE_VAR = "USAGE_EXIT_CODE"
# A scheduler's grace period (SIGTERM to SIGKILL) is the stop budget plus this: torchrun's and the launcher's
# own exit after the workers' save (the launcher waits up to the budget + 5 s for them). The k8s manifests'
# terminationGracePeriodSeconds are STOP_TIMEOUT + GRACE_MARGIN_S (tests/systems/test_k8s.py).
GRACE_MARGIN_S = 20

# option -> (its environment variables, default)
OPTIONS = {
    "nnodes": (("NNODES", "PET_NNODES"), "1"),
    "nproc_per_node": (("NPROC_PER_NODE", "PET_NPROC_PER_NODE"), "auto"),
    "node_rank": (("NODE_RANK", "PET_NODE_RANK"), None),
    "rdzv_endpoint": (("RDZV_ENDPOINT", "PET_RDZV_ENDPOINT"), None),
    "rdzv_id": (("RDZV_ID", "PET_RDZV_ID"), "train"),
    "rdzv_conf": (("RDZV_CONF", "PET_RDZV_CONF"), ""),
    "max_restarts": (("MAX_RESTARTS", "PET_MAX_RESTARTS"), "0"),
    # torchrun's --shutdown-timeout: it reads PET_SHUTDOWN_TIMEOUT and TORCH_ELASTIC_SHUTDOWN_TIMEOUT too
    "stop_timeout": (("STOP_TIMEOUT", "PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"), "30"),
    # launches in a row that fail without advancing the checkpoint step, after which the launcher exits 2
    "max_failed_launches": (("MAX_FAILED_LAUNCHES",), "3"),
}


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m train.launch", description=(
        "Start training on this node through torchrun: the one place its command line is built. Each option falls "
        "back to its environment variable (NNODES, NPROC_PER_NODE, RDZV_ENDPOINT, ...: docs/launcher.md). "
        "Usage: python -m train.launch [OPTIONS] -- --config configs/X.yaml key.sub=value ..."))
    p.add_argument("--nnodes", help="N or MIN:MAX (elastic)")
    p.add_argument("--nproc-per-node", help="processes per node: a number, or auto (one per GPU, else 2)")
    p.add_argument("--node-rank", help="this node's rank (ignored by c10d, which assigns ranks)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (omit for one node)")
    p.add_argument("--rdzv-id", help="job id shared by all nodes; keep it across restarts")
    p.add_argument("--rdzv-conf", help="extra rendezvous settings, e.g. join_timeout=600,last_call_timeout=30")
    p.add_argument("--max-restarts", help="times torchrun restarts the workers after a failure")
    p.add_argument("--stop-timeout", help="stop budget, seconds: after a stop signal the workers finish their "
                   "step and save within it, or are killed (default 30; keep it below the scheduler's grace "
                   "period)")
    p.add_argument("--max-failed-launches", help="after this many launches in a row that fail without advancing "
                   "the checkpoint step (a bad node, data that crashes a worker), exit 2 instead of 1 or 75 so "
                   "that the scheduler stops retrying (default 3; 0: never)")
    p.add_argument("--doctor", action="store_true", default=None,
                   help="run the preflight doctor on the same world first (also LAUNCH_DOCTOR=1)")
    p.add_argument("--debug", action="store_true", default=None,
                   help="verbose NCCL and torch.distributed logs into the run directory (also LAUNCH_DEBUG=1)")
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
    if not out["rdzv_endpoint"] and out["nnodes"] != "1":
        for addr, port in (("MASTER_ADDR", "MASTER_PORT"), ("PET_MASTER_ADDR", "PET_MASTER_PORT")):
            if env.get(addr) and env.get(port):
                host = env[addr]
                if ":" in host and not host.startswith("["):  # an IPv6 address
                    host = f"[{host}]"
                out["rdzv_endpoint"] = f"{host}:{env[port]}"
                break
    return out


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_command(opts: dict[str, str | None], train_args: list[str], module: str = "train") -> list[str]:
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
    if not str(opts.get("max_failed_launches", "0")).isdigit():
        raise ConfigError(f"--max-failed-launches (MAX_FAILED_LAUNCHES) must be a number >= 0 (0: never stop), "
                          f"got {opts['max_failed_launches']!r}")
    if not str(opts["stop_timeout"]).isdigit() or int(opts["stop_timeout"]) < 1:
        raise ConfigError(f"--stop-timeout (STOP_TIMEOUT) must be a whole number of seconds >= 1, "
                          f"got {opts['stop_timeout']!r}")
    # torchrun (torch.distributed.run) in a process that checks the training arguments first: torchrun.py
    cmd = [sys.executable, "-m", "train.launch.torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={opts['max_restarts']}", f"--shutdown-timeout={opts['stop_timeout']}"]
    endpoint = opts["rdzv_endpoint"]
    check_conf(opts["rdzv_conf"])
    if endpoint:
        split_endpoint(endpoint)
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={opts['rdzv_id']}"]
        if opts.get("local_addr"):
            cmd.append(f"--local-addr={opts['local_addr']}")
    elif bounds[-1] == "1":
        cmd.append("--standalone")  # one node: a private rendezvous on a free local port
    else:
        raise ConfigError(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (or RDZV_ENDPOINT, or "
                          "MASTER_ADDR and MASTER_PORT)")
    if opts["rdzv_conf"]:  # torchrun applies it under --standalone too (to its local c10d rendezvous)
        cmd.append(f"--rdzv-conf={opts['rdzv_conf']}")
    return cmd + ["-m", module, *train_args]


def check_training_args(train_args: list[str], task: bool = True) -> config.Config:
    """The same parse `python -m train` does, run once before torchrun starts the workers so that a bad config
    fails once; task=False leaves the task's keys to torchrun's process (torchrun.py)."""
    ns = config.parse_args(train_args)
    cfg = config.load(ns.config, ns.overrides, task)
    if task:  # a relaunch that changes what its rules refuse: refused before anything is queued
        from train import relaunch

        relaunch.check_record(cfg)
    return cfg


def check_world(cfg: config.Config, cmd: list[str]) -> None:
    """The batch arithmetic (and HSDP's groups) of the world torchrun will start, when its size is fixed (--nnodes=N,
    or MIN:MAX with MIN == MAX): a usage error found here, once, instead of by every worker."""
    flags = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
    bounds = flags["nnodes"].split(":")
    if bounds[0] == bounds[-1]:
        per_node = int(flags["nproc-per-node"])
        config.validate(cfg, int(bounds[0]) * per_node, per_node)


def requeue_exit_code(env: Mapping[str, str]) -> int:
    """The code the launcher exits with for "stopped after a checkpoint": REQUEUE_EXIT_CODE, or 75."""
    value = env.get(REQUEUE_CODE_VAR, "").strip()
    if not value:
        return EXIT_REQUEUE
    if not value.isdigit() or not 3 <= int(value) <= 255:
        raise ConfigError(f"{REQUEUE_CODE_VAR} must be an exit code from 3 to 255 (0, 1 and 2 mean done, failed "
                          f"and usage error), got {value!r}")
    return int(value)


def usage_exit_code(env: Mapping[str, str]) -> int:
    """The code the launcher exits with for a usage error: USAGE_EXIT_CODE, or 2."""
    value = env.get(USAGE_CODE_VAR, "").strip()
    if not value:
        return EXIT_USAGE
    requeue = requeue_exit_code(env)
    if not value.isdigit() or int(value) > 255 or int(value) in (1, requeue):
        raise ConfigError(f"{USAGE_CODE_VAR} must be an exit code from 0 to 255 other than 1 and {requeue} (failed "
                          f"and stopped after a checkpoint: both restarted), got {value!r}")
    return int(value)


def usage_line(line: str, env: Mapping[str, str]) -> str:
    """A usage error's one line; where USAGE_EXIT_CODE maps its exit, the line says so (it stays the last)."""
    try:
        code = usage_exit_code(env)
    except ConfigError:  # (the launcher refused the value first thing: that line is the one said)
        return line
    if code == EXIT_USAGE:
        return line
    return f"{line}; exit {code} in place of {EXIT_USAGE} ({USAGE_CODE_VAR}={code}): not restarted"


def worker_env(env: Mapping[str, str], run_dir: Path, debug: bool) -> dict[str, str]:
    """The environment torchrun and the workers get. Variables already set win over these defaults."""
    out = dict(env)
    defaults = {
        # torch 2.14's agent shares its rendezvous store with the workers without a per-round prefix, so
        # a restarted or re-formed group reads the dead group's addresses and fails to connect. A store
        # per round (hosted by the new rank 0) avoids that.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # NCCL flight recorder: the last collectives of every rank, dumped when one times out.
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run_dir.resolve() / "flight_recorder" / "rank_"),
    }
    if debug:
        defaults |= {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,COLL,NET",
                     "NCCL_DEBUG_FILE": str(run_dir.resolve() / "logs" / "nccl.%h.%p.log"),
                     "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_CPP_LOG_LEVEL": "INFO",
                     "LOGLEVEL": "INFO"}
    for key, value in defaults.items():
        out.setdefault(key, value)
    return out
