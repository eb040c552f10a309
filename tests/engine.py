"""A real Docker engine for the container tests: the image built with `make docker-build` from the
project's Dockerfile, unchanged (tests/image_build.py, which .ci/run starts before the venv installs), and the
fixtures that run it.

conftest.py starts the build in a background thread as soon as the tests are collected (it waits for one that
is already under way, then finds the image built) and runs the tests on the image last, so the rest of the
suite runs meanwhile."""

from __future__ import annotations

import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from tests.conftest import RESNET, ROOT
from tests.image_build import IMAGE, Missing, prepare_image, run_docker
from tests.multinode import required

# How the tests run the image, as docs/containers.md shows it: a read-only root as user 10001, /tmp writable.
RUN_FLAGS = ["--read-only", "--user", "10001", "--tmpfs", "/tmp:exec,mode=1777", "--shm-size", "1g"]
# The image holds no tests/: the runs that stop, resume and restart train tests/small_task.py (the built-in image
# task with its ResNet at a quarter of the width: steps of milliseconds, saves of 1 MB where ResNet-18's are 90),
# mounted read-only into the image's tasks/ as docs/containers.md ("Your own task") mounts a task file of a user's,
# and named by the path a user writes (tasks/...), its steps paced (conftest.PACED) where a test acts on a run
# mid-way. (The image's own models train in the doctor's run, the ResNet, and the compile run, the GPT.)
TASKS_IN_IMAGE = "/app/tasks"  # the image's WORKDIR + tasks/: what `docker run -v "$PWD/tasks:/app/tasks:ro"` mounts
SMALL_TASK_VOLUME = f"{ROOT / 'tests' / 'small_task.py'}:{TASKS_IN_IMAGE}/small_task.py:ro"  # docker run -v
SMALL_TASK_MOUNT = ["-v", SMALL_TASK_VOLUME]
SMALL_TASK_NAME = "tasks/small_task.py:SmallImages"
SMALL_TASK = [*RESNET, f"task.name={SMALL_TASK_NAME}"]


def docker(*args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = run_docker(*args, timeout=timeout, **kw)
    if check:
        assert proc.returncode == 0, f"docker {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-3000:]}" \
                                     f"\n{proc.stderr[-3000:]}"
    return proc


def volume_path(name: str) -> Path:
    """Where a named volume's files are on this machine (the tests run as root next to the engine)."""
    return Path(docker("volume", "inspect", "-f", "{{.Mountpoint}}", name).stdout.strip())


def state(container: str) -> tuple[str, int, int]:
    out = docker("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}} {{.RestartCount}}", container).stdout
    status, code, restarts = out.split()
    return status, int(code), int(restarts)


def logs(container: str) -> str:
    proc = docker("logs", "--tail", "60", container, check=False)
    return proc.stdout + proc.stderr


_build: dict = {}  # the background build: its thread, and the "error" it raised, if any


def start_build() -> None:
    """prepare_image() in a background thread, once per session (the image fixture waits for it)."""
    if "thread" in _build:
        return

    def work() -> None:
        try:
            # One build at a time on this machine (a lock): under pytest-xdist each worker is a process of its
            # own, and the second to get here finds the image built (Docker's cache makes that seconds).
            try:
                prepare_image()
            except Missing as e:
                required(e.what, e.reason)
        except BaseException as e:  # pytest's skip and fail too: the fixture raises them in the test
            _build["error"] = e

    _build["thread"] = threading.Thread(target=work, name="docker-build", daemon=True)
    _build["thread"].start()


@pytest.fixture(scope="session")
def image() -> str:
    """The project's image, built on this machine's engine (skipped, with the reason, without one)."""
    start_build()  # already running when conftest started it at collection
    _build["thread"].join()
    if "error" in _build:
        raise _build["error"]
    return IMAGE


@pytest.fixture
def volume():
    """A fresh named volume for the runs (removed afterwards)."""
    name = f"ddp-test-{uuid.uuid4().hex[:8]}"
    docker("volume", "create", name)
    yield name
    docker("volume", "rm", "-f", name, check=False)


@pytest.fixture
def containers():
    """Names for containers a test creates; each is removed afterwards."""
    made: list[str] = []

    def new(prefix: str = "ddp-test") -> str:
        made.append(f"{prefix}-{uuid.uuid4().hex[:8]}")
        return made[-1]

    yield new
    for name in made:
        docker("rm", "-f", "-v", name, check=False)
