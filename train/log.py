"""Everything a run reports: console, per-rank log files, metrics.jsonl, run info, summary.json.

Rank 0 speaks for the job (console progress, metrics, run files); every rank writes its own log
file under <run_dir>/logs/, and the other ranks print only warnings and errors.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from train.config import Config, to_dict
from train.distributed import DistEnv

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class RunLog:
    def __init__(self, run_dir: Path, denv: DistEnv):
        self.run_dir, self.rank, self.is_main = run_dir, denv.rank, denv.rank == 0
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.logger = logging.getLogger(f"train.rank{denv.rank}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.logger.handlers.clear()
        fmt = logging.Formatter(f"%(asctime)s [rank {denv.rank}] %(levelname)s %(message)s", "%H:%M:%S")
        to_file = logging.FileHandler(run_dir / "logs" / f"rank{denv.rank}.log")
        to_file.setFormatter(fmt)
        console = logging.StreamHandler(sys.stdout if self.is_main else sys.stderr)
        console.setFormatter(fmt)
        console.setLevel(logging.INFO if self.is_main else logging.WARNING)
        self.logger.addHandler(to_file)
        self.logger.addHandler(console)
        self.metrics_path = run_dir / "metrics.jsonl"

    def info(self, msg: str) -> None:
        self.logger.info(msg)

    def warning(self, msg: str) -> None:
        self.logger.warning(msg)

    def metrics(self, record: dict) -> None:
        """Append one record to metrics.jsonl (rank 0 only)."""
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def truncate_metrics(self, after_step: int) -> None:
        """Drop records past `after_step`: a resumed run logs those steps again."""
        if self.is_main and self.metrics_path.exists():
            lines = self.metrics_path.read_text().splitlines()
            kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= after_step]
            self.metrics_path.write_text("".join(ln + "\n" for ln in kept))

    def run_info(self, cfg: Config, denv: DistEnv, device: torch.device) -> None:
        """Rank 0 records what ran: the resolved config, library versions, git commit, hardware."""
        if not self.is_main:
            return
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        info = {
            "versions": versions(),
            "git_commit": git_commit(),
            "hardware": hardware(device),
            "world": {"world_size": denv.world_size, "nodes": denv.nodes, "launcher": denv.launcher,
                      "master": f"{denv.master_addr}:{denv.master_port}"},
            "command": sys.argv,
        }
        (self.run_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")

    def summary(self, record: dict) -> None:
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(record, indent=2) + "\n")

    def close(self) -> None:
        for h in list(self.logger.handlers):
            h.close()
            self.logger.removeHandler(h)


def versions() -> dict:
    import torchvision

    v = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
         "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return v


def git_commit() -> str:
    """The commit of this checkout, or $GIT_COMMIT (set in the container image), or 'unknown'."""
    try:
        out = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(PROJECT_ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GIT_COMMIT", "unknown")


def hardware(device: torch.device) -> dict:
    hw = {"host": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
          "device": str(device)}
    if torch.cuda.is_available():
        hw["gpus"] = [{"name": torch.cuda.get_device_name(i),
                       "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                      for i in range(torch.cuda.device_count())]
    return hw
