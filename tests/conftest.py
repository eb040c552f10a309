"""Shared helpers: run the real entry point (single process or torchrun with gloo) on a tiny config.

The tests come in tiers, a folder each, by what they need:
    tests/quick/    nothing but this process (it refuses to start one): `make test-quick`, a minute or two
    tests/processes/     training processes on this machine: python -m train, torchrun with gloo ranks, the launcher
    tests/systems/  an outside system: SLURM's daemons, a Docker engine, real hosts (network namespaces)
Tests that need a CUDA GPU carry the `gpu` marker in any tier and skip without one (`make gpu-check` runs them).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# A suite started under nohup (or by any parent that ignores SIGHUP) would pass the "ignore" on to every process a
# test starts, across fork and exec, and the tests that send a hang-up would see runs that ignore it (the
# template honours an inherited ignore: ../shared/notes/signals-under-nohup.md). The suite starts its processes
# with the default; the nohup test itself starts its launch under nohup.
signal.signal(signal.SIGHUP, signal.SIG_DFL)
PY = sys.executable

# The default config shrunk to a few CPU seconds: 16x16 images, 256 samples (16 steps per epoch).
# W&B and the end-of-run report are off (3-4 s of every launch); the tests about them turn them on.
RESNET = [
    "task.image_size=16", "task.train_samples=256", "task.eval_samples=64", "data.num_workers=0",
    "train.global_batch_size=16", "train.micro_batch_size=8", "train.log_every=1", "train.eval_every=0",
    "train.steps=6", "checkpoint.every=0", "optim.warmup_steps=2", "log.wandb.mode=disabled", "log.report=false",
]
# The same with the ResNet at a quarter of the width, 0.7M parameters (tests/small_task.py): what most tests
# train. RESNET (the built-in ResNet-18) is for the tests about that model itself and for runs inside the image
# (which holds no tests/); BUILT_IN after TINY brings it back where a test needs its size (slow saves).
SMALL_TASK = f"task.name={ROOT / 'tests' / 'small_task.py'}:SmallImages"
BUILT_IN = "task.name=train.tasks.image:ImageClassification"  # after TINY: ResNet-18 again, at TINY's sizes
TINY = [*RESNET, SMALL_TASK]
# A step of at least 0.15 s of wall time (about a ResNet-18 step's), a sleep that takes no CPU: for the runs a
# test acts on mid-way (tests/small_task.py).
PACED = ["task.step_delay_s=0.15"]


def pacing(overrides) -> list[str]:
    """PACED for a run of TINY's task; nothing where the overrides bring a task of their own (task.name=...),
    which has no such setting and is paced by its own size."""
    return [] if any(o.startswith("task.name=") for o in overrides) else PACED

OBSERVED = ["log.wandb.mode=offline", "log.report=true"]  # the defaults TINY turns off

# The same CPU kernels on every x86-64 machine, for the runs whose numbers are compared with tests/golden.json: ATen's
# plain C++ kernels (no AVX2 or AVX-512 variants), oneDNN's SSE4.1 ones and MKL's bit-reproducible path on any
# vendor's CPU (its AVX2 setting falls back to the machine's own choice on AMD). Each vector width sums in its own
# order: the ResNet-18 golden run's losses on an AVX2-only AMD EPYC and on the file's machine were 1e-5 apart at step
# 2 and 2e-2 at step 6, and its plain kernels against its AVX2 ones 2e-5 at step 1 (batch norm over 8 samples
# amplifies each difference, at any learning rate tried: 3e-3 to 3e-2).
SAME_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"}

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


def after_import(tmp_path: Path, module: str, patch: str) -> dict:
    """An environment whose PYTHONPATH holds a sitecustomize.py that, in every process of the launch, runs
    `patch` (the body of `def _patch(module):`) right after `module` is first imported."""
    return after_imports(tmp_path, {module: patch})


def after_imports(tmp_path: Path, patches: dict[str, str]) -> dict:
    """after_import for several modules at once: {module: its patch}, each run right after its module is first
    imported, in the one sitecustomize.py (in tmp_path/site) every process of the launch runs."""
    folder = tmp_path / "site"
    folder.mkdir()
    code = ("import importlib.abc, importlib.machinery, sys\n"
            "class _After(importlib.abc.MetaPathFinder):\n"
            "    def __init__(self, module, patch):\n"
            "        self.module, self.patch = module, patch\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name != self.module:\n"
            "            return None\n"
            "        sys.meta_path.remove(self)\n"
            "        spec = importlib.machinery.PathFinder.find_spec(name, path)\n"
            "        run = spec.loader.exec_module\n"
            "        def exec_module(mod):\n"
            "            run(mod)\n"
            "            self.patch(mod)\n"
            "        spec.loader.exec_module = exec_module\n"
            "        return spec\n")
    for i, (module, patch) in enumerate(patches.items()):
        code += (f"def _patch_{i}(module):\n" + "".join(f"    {line}\n" for line in patch.strip().splitlines())
                 + f"sys.meta_path.insert(0, _After({module!r}, _patch_{i}))\n")
    (folder / "sitecustomize.py").write_text(code)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
    return env


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
    """The checkpoint `latest` names, as one dict (dcp_io.read_state: checked, read in this process)."""
    from train.checkpoint.dcp_io import read_state

    ckpt = run_dir / "checkpoints"
    return read_state(ckpt / (ckpt / "latest").read_text().strip())


def assert_same_state(a: dict, b: dict, where: str = "") -> None:
    """Two checkpoints (read_state) hold bitwise the same weights and optimizer state."""
    assert a["model"].keys() == b["model"].keys()
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), f"{where}model {k} differs"
    for i, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optimizer"]["state"][i][k]), f"{where}optimizer state {i}.{k} differs"


def assert_same_training(reference: Path, run: Path) -> None:
    """The newest checkpoints of two runs hold bitwise the same weights and optimizer state, and the runs
    logged the same loss at the same steps: what a resume promises against an uninterrupted run."""
    a, b = latest_state(reference), latest_state(run)
    assert a["step"] == b["step"], (a["step"], b["step"])
    assert_same_state(a, b, "against the uninterrupted run: ")
    losses = [(m["step"], m["loss"]) for m in metrics(run) if "loss" in m]
    assert losses == [(m["step"], m["loss"]) for m in metrics(reference) if "loss" in m]


# No batch statistics (a batch split over ranks is then the same batch), and a gentle lr so that float rounding
# differences are not amplified by a chaotic start.
GROUPNORM = ["task.norm=group", "optim.lr=0.005"]


def assert_trained_alike(a: dict, b: dict, rtol: float = 0.05, atol: float = 0.0, model: list = TINY) -> None:
    """Two model state dicts (the ResNet with GROUPNORM and the CIFAR stem: images of 8-64 px) trained the same:
    each tensor differs by less than rtol of how far training moved it from the initial weights (plus atol, an
    absolute slack on the norm of the difference). Float rounding differs with the batch split (CPU kernels
    pick other algorithms for other batch sizes; seen: up to 0.6% after 6 steps), while a wrong average (a
    sum, a rank's own gradient, a missed micro-batch) or weights not restored by a resume move them
    differently by tens of percent. `model`: the overrides that chose the runs' task (TINY or RESNET). Tensors of
    a GPU run's checkpoint load onto the GPU: they are compared on the CPU, where the initial weights are made."""
    from train import config

    cfg = config.load("configs/default.yaml", [*model, *GROUPNORM])  # the model of the runs compared
    torch.manual_seed(cfg.seed)  # as the trainer does before it builds the model
    init = cfg.task_class(cfg.task, cfg.seed).model().state_dict()
    assert a.keys() == b.keys() == init.keys()
    for k in a:
        if a[k].is_floating_point():
            ak, bk = a[k].cpu(), b[k].cpu()
            moved = (ak - init[k]).norm()
            assert moved > 0 and (ak - bk).norm() <= rtol * moved + atol, f"{k} differs"


# `make test` runs the files three at a time on two cores (pytest-xdist's --dist loadfile): a file's tests run in
# order on one worker, so a file that holds one resource of the machine (test_slurm's cluster) never shares it,
# and the tests that mostly wait (stop budgets, restarts, rendezvous and SLURM's scheduling: with one worker a core,
# a fifth of the CPU stayed idle) overlap the ones that compute. Real hosts carry random names, addresses and
# bridges (tests/hosts.py), so several files can use them at once.
def _uses_image(item) -> bool:
    return "image" in getattr(item, "fixturenames", ())


# The image's files in the order they are handed out, the longest first (test_container.py compiles kernels), so
# that the worker that runs two of them ends with the shortest and neither waits idle for the other. A new one
# goes last.
IMAGE_FILES = ("test_container.py", "test_compose.py", "test_image.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The files with tests on the project's image run last: its build (minutes from cold) runs in the
    background while the others run (tests/engine.py). There are three (IMAGE_FILES: their containers, volumes
    and compose projects have names of their own), so that at the end the workers run the image's tests
    together, rather than one alone for minutes while the others have nothing left."""
    image_files = {item.path for item in items if _uses_image(item)}

    def order(item) -> tuple[bool, bool, int, str]:
        """The quick tier first (seconds), then runs' and systems' files mixed by name, so that the ones that mostly
        wait (SLURM, real hosts) overlap the ones that compute, and the image's last."""
        quick = item.path.parent.name == "quick"
        if item.path not in image_files:
            return not quick, False, 0, item.path.name
        name = item.path.name
        return True, True, IMAGE_FILES.index(name) if name in IMAGE_FILES else len(IMAGE_FILES), name

    items.sort(key=order)  # stable: a file's tests keep their order


@pytest.hookimpl(optionalhook=True)  # (a run without xdist: -p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, except at the end: xdist hands a worker its next file as soon as the worker has two tests
    or fewer left, so one worker took both image files (two tests from its current file's end) while the other
    finished its last file and then had nothing to do for minutes. While no more files remain than there are
    workers, a file goes to a worker that has run out of tests (its last test waits only for the next file's
    first, a message away). xdist's LoadFileScheduling and its attributes, pinned in requirements-dev.txt."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LastFilesToIdleWorkers(LoadFileScheduling):
        def _reschedule(self, node):
            if 0 < len(self.workqueue) <= len(self.nodes) and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return LastFilesToIdleWorkers(config, log)


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any(map(_uses_image, session.items)):
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # one worker builds in the background; another one's image fixture waits for it (engine.py)
    from tests import engine, image_build

    if image_build.engine_problem() is None:  # without an engine the image fixture says why, in each test
        engine.start_build()


# Finished runs that several tests start from, made once per session (each launch costs ~5 s of imports
# alone). Tests only read them; a test that changes a run works on its own copy (copy_run).
def session_run(tmp_path_factory, name: str, *overrides: str, nproc: int = 1, tiny: bool = True,
                env: dict | None = None) -> Path:
    """A run to its end, made once per test session: under pytest-xdist by the first worker that needs it, in
    the session's temporary folder that all the workers share, while the others wait for it (a lock)."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # the workers' own folders are popen-gw0, popen-gw1, ...
    run_dir = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        if not (run_dir / "summary.json").exists():  # written last: a run that failed half-way is made again
            shutil.rmtree(run_dir, ignore_errors=True)
            run_train(run_dir, *overrides, nproc=nproc, tiny=tiny, env=env)
    return run_dir


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """One process, TINY to its end (6 steps), checkpoints at steps 2, 4 and 6 (keep=3)."""
    return session_run(tmp_path_factory, "finished_run", "checkpoint.every=2", "checkpoint.keep=3")


@pytest.fixture(scope="session")
def finished_two_ranks(tmp_path_factory) -> Path:
    """Two ranks under torchrun (gloo), TINY to its end (6 steps), checkpoints at steps 2, 4 and 6, each followed by
    an evaluation."""
    return session_run(tmp_path_factory, "finished_two_ranks", "checkpoint.every=2", "checkpoint.keep=3",
                       "train.eval_every=2", nproc=2)


@pytest.fixture(scope="session")
def finished_16_steps(tmp_path_factory) -> Path:
    """Two ranks under torchrun, TINY for 16 steps (an epoch) uninterrupted, a checkpoint at the end: what the runs
    stopped, killed or requeued on the way must end equal to (test_elastic.py, test_slurm.py: their pacing, periodic
    saves and collective timeouts change no number)."""
    return session_run(tmp_path_factory, "finished_16_steps", "train.steps=16", nproc=2)


@pytest.fixture(scope="session")
def finished_resnet18(tmp_path_factory) -> Path:
    """finished_two_ranks with the built-in ResNet-18 (RESNET: TINY's sizes, torchvision's model): the golden
    numbers (tests/processes/test_golden.py: on SAME_KERNELS), and the weights the export writes
    (tests/processes/test_checkpoint_format.py)."""
    return session_run(tmp_path_factory, "finished_resnet18", *RESNET, "checkpoint.every=2", "checkpoint.keep=3",
                       "train.eval_every=2", nproc=2, tiny=False, env=clean_env(**SAME_KERNELS))


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
