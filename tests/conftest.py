"""Shared helpers: run the real entry point (single process or torchrun with gloo) on a tiny config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# The default config shrunk to a few CPU seconds: 16x16 images, 256 samples (16 steps per epoch).
# W&B and the end-of-run report are off (3-4 s of every launch); the tests about them turn them on.
TINY = [
    "data.image_size=16", "data.train_samples=256", "data.eval_samples=64", "data.num_workers=0",
    "train.global_batch_size=16", "train.micro_batch_size=8", "train.log_every=1", "train.eval_every=0",
    "train.steps=6", "checkpoint.every=0", "optim.warmup_steps=2", "log.wandb.mode=disabled", "log.report=false",
]
OBSERVED = ["log.wandb.mode=offline", "log.report=true"]  # the defaults TINY turns off

# Variables a launcher would set: tests start from none of them.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


# `python -m train` with a model whose every forward draws from torch's, numpy's and Python's global
# generators (tests/rng_draws.py): a resume that skips or mixes up restoring them changes the weights.
RNG_DRAWS = ("tests/rng_draws.py",)


def train_cmd(run_dir: Path, *overrides: str, nproc: int = 1, tiny: bool = True,
              entry: tuple[str, ...] = ("-m", "train")) -> list[str]:
    args = ["--config", "configs/default.yaml", *(TINY if tiny else []), f"run.dir={run_dir}", *overrides]
    if nproc == 1:
        return [PY, *entry, *args]
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *entry, *args]


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, expect: int | None = 0, timeout: float = 300,
              tiny: bool = True, env: dict | None = None,
              entry: tuple[str, ...] = ("-m", "train")) -> subprocess.CompletedProcess:
    """Run training to the end; assert its exit code (unless expect is None)."""
    proc = subprocess.run(train_cmd(run_dir, *overrides, nproc=nproc, tiny=tiny, entry=entry), cwd=ROOT,
                          env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    if expect is not None:
        assert proc.returncode == expect, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of the training lines. The lines themselves must hold each step once, in order: a dict
    alone would hide a step logged twice (a resume that appends instead of truncating)."""
    lines = [(m["step"], m["loss"]) for m in metrics(run_dir) if "loss" in m]
    steps = [step for step, _ in lines]
    assert steps == sorted(set(steps)), f"metrics.jsonl holds steps twice or out of order: {steps}"
    return dict(lines)


def latest_state(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints"
    return torch.load(ckpt / (ckpt / "latest").read_text().strip(), weights_only=True)


def _on_image(item) -> bool:
    return "image" in getattr(item, "fixturenames", ())


# `make test` runs the suite in two passes: first the tests not marked `serial`, two at a time (pytest-xdist,
# one per core: on 2 cores that pass went from about 15 minutes run one at a time to 11-12), then the
# `serial` ones alone. Serial: a test holding one fixed resource of the machine, or asserting a deadline or a timing
# ratio that a second test's load on the 2 cores would move.
SERIAL_FILES = {
    "test_slurm.py": "one SLURM cluster on fixed ports",
    "test_hosts.py": "real hosts: fixed addresses, a bridge and an iptables rule",
    "test_container.py": "the Docker engine and one compose project",
    "test_stops.py": "stop deadlines",
    "test_elastic.py": "restart, hang and rendezvous deadlines",
    "test_observability.py": "straggler ratios between ranks",
}
SERIAL_FIXTURES = {"make_hosts", "image"}  # real hosts; the image's background build (tests/engine.py)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the serial tests (above). The tests on the project's image run last: its build (minutes from
    cold) runs in the background while the others run (tests/engine.py)."""
    for item in items:
        if item.path.name in SERIAL_FILES or SERIAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serial)
    items.sort(key=_on_image)  # stable: each group keeps its order


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any(map(_on_image, session.items)):
        return
    from tests import engine

    if engine.engine_problem() is None:  # without an engine the image fixture says why, in each test
        engine.start_build()


# Finished runs that several tests start from, made once per session (each launch costs ~5 s of imports
# alone). Tests only read them; a test that changes a run works on its own copy (copy_run).
@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """One process, TINY to its end (6 steps), checkpoints at steps 2, 4 and 6 (keep=3)."""
    run_dir = tmp_path_factory.mktemp("finished_run")
    run_train(run_dir, "checkpoint.every=2", "checkpoint.keep=3")
    return run_dir


@pytest.fixture(scope="session")
def finished_two_ranks(tmp_path_factory) -> Path:
    """Two ranks under torchrun (gloo), TINY to its end (6 steps), checkpoints at steps 2, 4 and 6."""
    run_dir = tmp_path_factory.mktemp("finished_two_ranks")
    run_train(run_dir, "checkpoint.every=2", "checkpoint.keep=3", nproc=2)
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    """A private copy of a finished run to change or continue (its checkpoints name each other relatively)."""
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
    return dst


@pytest.fixture(autouse=True)
def _no_gpu_marker(request):
    if request.node.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture
def make_hosts():
    """make_hosts("n0", "n1") -> real hosts (network namespaces), removed after the test: tests/hosts.py."""
    from tests.hosts import make_hosts_fixture

    yield from make_hosts_fixture()
