"""Everything a run reports: console, progress bar, per-rank log files, metrics.jsonl, Weights & Biases,
run info, summary.json and the end-of-run report.

Rank 0 speaks for the job (console progress, metrics, tracker, run files); every rank writes its own
log file under <run_dir>/logs/, and the other ranks print only warnings and errors. All the
"am I rank 0?" decisions of reporting are made here.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import netrc
import os
import platform
import secrets
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch
import yaml

from train.checkpoint.storage import write_atomic
from train.config import Config, ConfigError, LogConfig, make_run_dir, to_dict, wandb_tags
from train.parallel.distributed import DistEnv

PROJECT_ROOT = Path(__file__).resolve().parent.parent
STRAGGLER_REPEAT = 10  # log steps between two straggler warnings


class _Console(logging.Handler):
    """Rank 0's console while a progress bar is shown: lines go above the bar; per-step lines are
    left to the bar (they still reach the log file)."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "progress", False):
            return
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stdout)


class RunLog:
    def __init__(self, run_dir: Path, denv: DistEnv, cfg: Config | None = None, unit: str = "samples"):
        self.run_dir, self.rank, self.is_main = run_dir, denv.rank, denv.rank == 0
        self.unit = unit  # the task's unit of throughput: the console shows <unit>/s
        self.lcfg = cfg.log if cfg is not None else LogConfig()
        self.total_steps = cfg.train.steps if cfg is not None else None
        self.every = cfg.train.log_every if cfg is not None else 1  # a log step every train.log_every steps
        self._tracker: Tracker | None = None
        self._starting: threading.Thread | None = None  # W&B's start, under way
        self.bar = None
        self._windows, self._quiet_until = 0, 0
        make_run_dir(run_dir)
        (run_dir / "logs").mkdir(exist_ok=True)
        self.logger = logging.getLogger(f"train.rank{denv.rank}")
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False
        self.logger.handlers.clear()
        fmt = logging.Formatter(f"%(asctime)s [rank {denv.rank}] %(levelname)s %(message)s", "%H:%M:%S")
        to_file = logging.FileHandler(run_dir / "logs" / f"rank{denv.rank}.log")
        to_file.setFormatter(logging.Formatter(  # files: the full date and milliseconds, to line up ranks
            f"%(asctime)s.%(msecs)03d [rank {denv.rank}] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        self.console = logging.StreamHandler(sys.stdout if self.is_main else sys.stderr)
        self.console.setFormatter(fmt)
        self.console.setLevel(logging.INFO if self.is_main else logging.WARNING)
        self.logger.addHandler(to_file)
        self.logger.addHandler(self.console)
        self.file = to_file
        self.metrics_path = run_dir / "metrics.jsonl"
        self.last_train_loss = float("nan")  # rank 0: the last logged training loss (summary.json)

    def info(self, msg: str) -> None:
        self.logger.info(msg)

    def warning(self, msg: str) -> None:
        self.logger.warning(msg)

    def to_file(self, msg: str) -> None:
        """An error into this rank's log file only (a traceback that the console's one line points to)."""
        self.file.handle(self.logger.makeRecord(self.logger.name, logging.ERROR, __file__, 0, msg, None, None))

    def metrics(self, record: dict) -> None:
        """Append one record to metrics.jsonl (rank 0 only), whatever the tracker."""
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record | {"time": round(time.time(), 3)}) + "\n")

    # ---- training progress
    def due(self, step: int) -> bool:
        """Whether step `step` is a log step: every train.log_every steps, and the run's last."""
        return step % self.every == 0 or step == self.total_steps

    def advance(self, step: int) -> None:
        """After every optimizer step: moves rank 0's progress bar, if it has one."""
        if not self.is_main:
            return
        if self.bar is None and self._wants_bar():
            from tqdm import tqdm

            try:  # a terminal of unknown size (0 x 0: `script`, `docker run -t`) would hide the bar
                size = os.get_terminal_size(sys.stdout.fileno())
                shape = {"dynamic_ncols": True} if size.columns and size.lines else {}
            except (OSError, ValueError):
                shape = {}
            # The bar counts the steps of this process: its rate and ETA are not skewed by a resume.
            self.bar = tqdm(total=self.total_steps, initial=step - 1, unit="step", file=sys.stdout,
                            smoothing=0.1, **(shape or {"ncols": 100, "nrows": 24}))
            handler = _Console()
            handler.setFormatter(self.console.formatter)
            self.logger.removeHandler(self.console)
            self.logger.addHandler(handler)
            self.console = handler
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def _wants_bar(self) -> bool:
        p = self.lcfg.progress_bar
        return self.total_steps is not None and (p == "always" or (p == "auto" and sys.stdout.isatty()))

    def train(self, record: dict) -> None:
        """A log step: metrics.jsonl, the tracker, the console (or the bar), a straggler warning."""
        self._windows += 1
        if not self.is_main:
            return
        self.last_train_loss = record["loss"]
        self.metrics(record)
        if self.tracker is not None:
            self.tracker.log(record)
        r = record
        speed = f"{r.get(f'{self.unit}_per_s', r['samples_per_s']):.1f} {self.unit}/s"
        line = (f"step {r['step']}/{self.total_steps} epoch {r['epoch']} loss {r['loss']:.4f} lr {r['lr']:.4g} "
                f"{speed}, {r['step_time_s']:.3f} s/step, "
                f"data wait {r.get('data_wait_share', 0):.0%}")
        if "padding_share" in r:
            line += f", padding {r['padding_share']:.1%}"
        if len(r.get("samples_per_s_rank", ())) > 1:
            line += f", slowest rank {r['slowest_rank']} x{r['straggler_ratio']:.2f}"
        if "peak_mem_gib" in r:
            line += f", peak mem {r['peak_mem_gib']:.1f} GiB"
        if "mfu" in r:
            line += f", MFU {r['mfu']:.1%}"
        self.logger.info(line, extra={"progress": True})
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {r['loss']:.4f}, {speed}")
        self._check_straggler(r)

    def _check_straggler(self, r: dict) -> None:
        ratio = r.get("straggler_ratio", 1.0)
        # The first window of a process holds its start-up (loader workers, allocator, autotuning).
        if ratio <= self.lcfg.straggler_threshold or self._windows < 2 or self._windows < self._quiet_until:
            return
        self._quiet_until = self._windows + STRAGGLER_REPEAT
        from train.parallel.hang import host_of  # the hosts of all ranks, all-gathered at start

        rank = r["slowest_rank"]
        self.warning(f"straggler: rank {rank} on {host_of(rank)} needs {ratio:.2f}x the time of the fastest rank "
                     f"(log.straggler_threshold={self.lcfg.straggler_threshold:g}) at step {r['step']}; "
                     f"it waits {r.get('slowest_data_wait_share', 0):.0%} of its steps for data; "
                     f"quiet for the next {STRAGGLER_REPEAT} log steps")

    def eval(self, record: dict) -> None:
        if self.is_main:
            self.metrics(record)
            if self.tracker is not None:
                self.tracker.log(record)
            metrics = " ".join(f"{k[5:]} {v:.4f}" for k, v in record.items() if k.startswith("eval_"))
            self.info(f"eval step {record['step']}: {metrics}")

    # ---- experiment tracker
    def start_tracker(self, cfg: Config, ckpt, resumed: bool) -> None:
        """Rank 0 starts the W&B run: the checkpoint's run id when this run directory is resumed (the
        same W&B run continues), else a new one; the id goes into every later checkpoint."""
        if not self.is_main or cfg.log.wandb.mode == "disabled":
            return
        run_id = ckpt.tracker_id if resumed and ckpt.resumed_own else None
        if resumed and ckpt.tracker_id and run_id is None:
            self.info(f"resumed from another run's checkpoint ({ckpt.resumed_from}): a new W&B run, not "
                      f"{ckpt.tracker_id}")
        run_id = run_id or new_run_id()
        ckpt.tracker_id = run_id  # into the checkpoints from now on (None again if W&B does not start)

        def start() -> None:
            self._tracker = Tracker.start(cfg, run_id, self)
            if self._tracker is None:
                ckpt.tracker_id = None

        # W&B starts (about a second: its import, its service process) while the first step runs; the first use of
        # the tracker waits for it
        self._starting = threading.Thread(target=start, name="wandb-start", daemon=True)
        self._starting.start()

    @property
    def tracker(self) -> Tracker | None:
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        return self._tracker

    @tracker.setter
    def tracker(self, tracker: Tracker | None) -> None:
        self._tracker = tracker

    def finish(self, summary: dict) -> None:
        """The end of a complete run: summary.json, the tracker's summary, report.png and report.txt."""
        if not self.is_main:
            return
        self._close_bar()
        if self.tracker is not None:
            summary = summary | {"wandb_run_id": self.tracker.run_id}
        self.summary(summary)
        if self.tracker is not None:
            self.tracker.finish(summary, exit_code=0)
            self.tracker = None
        if self.lcfg.report:
            try:
                from train.observe import report_writer

                t = time.perf_counter()
                png, text = report_writer.write(self.run_dir)
                for line in text.splitlines():
                    self.info(line)
                self.info(f"report: {png} ({time.perf_counter() - t:.1f} s)")
            except Exception as e:  # the run is done and saved: a failed plot must not fail it
                self.warning(f"report not written ({type(e).__name__}: {e}); "
                             f"try: python -m train.report {self.run_dir}")

    def truncate_metrics(self, after_step: int) -> None:
        """Drop records past `after_step`: a resumed run logs those steps again (a run from step 0: every record,
        an earlier attempt's that saved nothing). A line cut short by a killed process goes too."""
        if self.is_main and self.metrics_path.exists():
            kept = []
            for ln in self.metrics_path.read_text().splitlines():
                try:
                    r = json.loads(ln)
                except ValueError:
                    continue
                if isinstance(r, dict) and after_step > 0 and r.get("step", 0) <= after_step:
                    kept.append((ln, r))
            text = "".join(ln + "\n" for ln, _ in kept).encode()
            write_atomic(self.metrics_path, lambda f: f.write(text))  # a kill now leaves the old file
            self.last_train_loss = next((r["loss"] for _, r in reversed(kept) if "loss" in r), float("nan"))

    def completed(self, step: int) -> bool:
        """Whether this run directory holds a finished run at `step` (its summary.json), as rank 0 reads
        it; every rank learns the verdict. A run stopped during its last step or its final evaluation
        has no summary yet: the relaunch finishes it."""
        verdict = [False]
        if self.is_main:
            try:
                verdict = [json.loads((self.run_dir / "summary.json").read_text()).get("steps") == step]
            except (OSError, ValueError):
                pass
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.broadcast_object_list(verdict, src=0)
        return verdict[0]

    def evaluated(self, step: int) -> bool:
        """Whether metrics.jsonl already holds the evaluation of `step`, as rank 0 reads it; every rank learns
        the verdict. A checkpoint is saved before its step's evaluation: resumed after that evaluation was
        logged (a crash in the next step, or a stop there that ends with this save), it is not run again."""
        verdict = [False]
        if self.is_main and self.metrics_path.exists():
            records = (json.loads(ln) for ln in self.metrics_path.read_text().splitlines() if ln.strip())
            verdict = [any(r.get("step") == step and "eval_loss" in r for r in records)]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.broadcast_object_list(verdict, src=0)
        return verdict[0]

    def run_info(self, cfg: Config, denv: DistEnv, device: torch.device) -> None:
        """Rank 0 records what ran: the resolved config, library versions, git commit, hardware, the command and
        the directory it was launched in."""
        if not self.is_main:
            return
        info = {
            "versions": versions(),
            "git_commit": git_commit(),
            "hardware": hardware(device),
            "world": {"world_size": denv.world_size, "nodes": denv.nodes, "launcher": denv.launcher,
                      "master": f"{denv.master_addr}:{denv.master_port}"},
            "command": sys.argv,
            # the folder the config's relative paths (kept as typed) start at: train.export protects them from it
            "cwd": os.getcwd(),
        }
        # run_info.json first: a folder holding it holds a run (resume.check_fresh_start), whatever follows
        (self.run_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    def summary(self, record: dict) -> None:
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(record, indent=2) + "\n")

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self, exit_code: int = 1) -> None:
        """Idempotent. A tracker still open here ends with exit_code (1: the run failed)."""
        self._close_bar()
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.finish(None, exit_code=exit_code)
        for h in list(self.logger.handlers):
            h.close()
            self.logger.removeHandler(h)


def versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": _version("torchvision"),
         "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return v


def _version(package: str) -> str | None:
    """An installed package's version, from its metadata: importing torchvision for its __version__ would cost
    rank 0 about a second of CPU (it imports torch._dynamo) in a run whose task (a language model) never uses it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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


# ---------------------------------------------------------------- Weights & Biases (rank 0)

def new_run_id() -> str:
    """A W&B run id, made here so that the checkpoint can carry it before W&B is even imported."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_credentials_problem(cfg: Config) -> str | None:
    """Online mode needs an API key (WANDB_API_KEY, or `wandb login`'s ~/.netrc entry): the one line
    to print when there is none. Looked up the way wandb does, without importing it."""
    if cfg.log.wandb.mode != "online":
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    url = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    try:
        auth = netrc.netrc(os.environ.get("NETRC") or None)
        if auth.authenticators(url.netloc) or auth.authenticators(url.hostname or ""):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    return (f"log.wandb.mode=online but no W&B API key is set for {url.netloc}: export WANDB_API_KEY (or run "
            f"`wandb login` once), or train with log.wandb.mode=offline and `wandb sync` the run later")


def check_tracker(cfg: Config, rank: int) -> None:
    """Before anything is written: rank 0 (the one that logs) checks the tracker's credentials and
    every rank learns the verdict, so that all of them stop together with the same one line."""
    verdict = [wandb_credentials_problem(cfg) if rank == 0 else None]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise ConfigError(verdict[0])


def _wandb_key(key: str) -> str:
    if key == "step":
        return key
    if key.startswith("eval_"):
        return "eval/" + key.removeprefix("eval_")
    if key in ("loss", "lr", "epoch") or key.startswith("lr_"):  # lr_<group>: a task's group's rate
        return "train/" + key
    return "perf/" + key


class Tracker:
    """One W&B run, on rank 0. Offline by default: the run's files go to <run_dir>/wandb/ and
    `wandb sync` uploads them later. Our step is W&B's x-axis (define_metric), so a resumed run that
    logs its last steps again adds points instead of being refused for going back in W&B's own step."""

    def __init__(self, run, run_id: str, runlog: RunLog):
        self.run, self.run_id, self.runlog = run, run_id, runlog

    @classmethod
    def start(cls, cfg: Config, run_id: str, log: RunLog) -> Tracker | None:
        w = cfg.log.wandb
        t = time.perf_counter()
        os.environ.setdefault("WANDB_SILENT", "true")  # this process only (rank 0): we print our own lines
        try:
            import wandb
        except ImportError:
            log.warning("log.wandb.mode is not disabled but wandb is not installed: pip install -r requirements.txt")
            return None
        settings = wandb.Settings(console="off", silent=True, allow_val_change=True)
        if w.mode == "online":  # meanwhile the other ranks wait in their next collective, up to dist.timeout_s:
            # an unreachable server must send this rank offline before they give up on it
            wanted = float(os.environ.get("WANDB_INIT_TIMEOUT") or wandb.Settings().init_timeout)
            settings.init_timeout = min(wanted, cfg.dist.timeout_s / 3)
        kwargs = dict(project=w.project, entity=w.entity or None, group=w.group or None,
                      tags=wandb_tags(w) or None, name=cfg.run.name, id=run_id, resume="allow",
                      dir=str(cfg.run_dir), config=to_dict(cfg), settings=settings)
        try:
            run = wandb.init(mode=w.mode, **kwargs)
        except Exception as e:
            if w.mode != "online":
                log.warning(f"wandb did not start ({type(e).__name__}: {e}); metrics.jsonl only")
                return None
            # A key but no service (network down, server unreachable): keep training, record offline.
            log.warning(f"wandb online did not start ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                        f"recording offline instead: `wandb sync` the run later")
            wandb.teardown()  # forget the failed attempt, whose run id is the one to record under
            try:
                run = wandb.init(mode="offline", **kwargs)
            except Exception as e2:
                log.warning(f"wandb did not start offline either ({type(e2).__name__}: {e2}); metrics.jsonl only")
                return None
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        elapsed = time.perf_counter() - t
        if run.offline:
            pieces = cfg.run_dir / "wandb" / f"offline-run-*-{run_id}"
            log.info(f"wandb: offline run {run_id} in {cfg.run_dir / 'wandb'} ({elapsed:.1f} s); "
                     f"upload with: wandb sync {pieces}")
        else:
            log.info(f"wandb: run {run_id} at {run.url} ({elapsed:.1f} s)")
        return cls(run, run_id, log)

    def log(self, record: dict) -> None:
        data = {}
        for k, v in record.items():
            if isinstance(v, list):  # per-rank values: their extremes
                if v:
                    data[_wandb_key(k) + "_min"], data[_wandb_key(k) + "_max"] = min(v), max(v)
            else:
                data[_wandb_key(k)] = v
        try:
            self.run.log(data)
        except Exception as e:  # the tracker must never stop training; metrics.jsonl has everything
            self.runlog.warning(f"wandb.log failed ({type(e).__name__}: {e}); no more W&B logging in this run")
            self.runlog.tracker = None

    def finish(self, summary: dict | None, exit_code: int) -> None:
        try:
            if summary:
                self.run.summary.update({k: v for k, v in summary.items() if k != "step"})
            self.run.finish(exit_code=exit_code)
        except Exception as e:
            self.runlog.warning(f"wandb did not finish cleanly ({type(e).__name__}: {e})")
