"""A real Docker engine for the container tests: the image built with `make docker-build` from the
project's Dockerfile, unchanged, on a base image stood in from Debian's packages when no registry is
reachable (no Docker Hub from CI or this sandbox).

The stand-in base carries what this sandbox needs and python:slim has: a Python 3.11 with its headers,
and, for pip behind this machine's TLS interception, the machine's CA bundle (PIP_CERT). It is made once
per machine and kept (a second run finds the tag); the image is rebuilt by every session, which Docker's
build cache makes a matter of seconds when nothing changed.

From cold (a fresh CI machine) the base and the build take about 8 minutes, mostly downloading and
unpacking the 6 GB environment. conftest.py starts them in a background thread as soon as the tests are
collected and runs the tests on the image last, so the rest of the suite runs meanwhile; the build runs at
the lowest CPU priority (.ci/run starts the engine under `nice`, debootstrap runs under it here), so it
takes only the cores the tests leave idle."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from tests.conftest import RESNET, ROOT
from tests.multinode import dockerfile_instructions, required

IMAGE_VERSION = next(line.split('"')[1] for line in (ROOT / "pyproject.toml").read_text().splitlines()
                     if line.startswith("version = "))
IMAGE = f"ddp-template:{IMAGE_VERSION}"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# python:slim's interpreter has its headers (Triton's C helper includes Python.h); Debian's needs python3-dev.
DEBIAN_PACKAGES = "python3,python3-venv,python3-dev,python-is-python3,ca-certificates"


# How the tests run the image, as docs/containers.md shows it: a read-only root as user 10001, /tmp writable.
RUN_FLAGS = ["--read-only", "--user", "10001", "--tmpfs", "/tmp:exec,mode=1777", "--shm-size", "1g"]
# The image holds no tests/: the runs that stop, resume and restart train tests/small_task.py (the built-in image
# task with its ResNet at a quarter of the width: steps of milliseconds, saves of 1 MB where ResNet-18's are 90),
# mounted read-only as a user mounts a task file of theirs, its steps paced (conftest.PACED) where a test acts
# on a run mid-way. (The image's own model trains in the compile and doctor runs.)
SMALL_TASK_IN_IMAGE = "/task/small_task.py"
SMALL_TASK_VOLUME = f"{ROOT / 'tests' / 'small_task.py'}:{SMALL_TASK_IN_IMAGE}:ro"  # docker run -v, compose volumes
SMALL_TASK_MOUNT = ["-v", SMALL_TASK_VOLUME]
SMALL_TASK = [*RESNET, f"task.name={SMALL_TASK_IN_IMAGE}:SmallImages"]


def docker(*args: str, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)
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


def engine_problem() -> str | None:
    """Why no engine can be used here, or None."""
    if not shutil.which("docker"):
        return "no docker command (.ci/run installs Debian's docker.io)"
    proc = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        return f"no Docker daemon answers ({proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}); " \
               ".ci/run starts dockerd"
    return None


def base_image() -> str:
    """The base the Dockerfile's stages start FROM (the same one for all)."""
    froms = {rest.split()[0] for word, rest in dockerfile_instructions() if word == "FROM"}
    assert len(froms) == 1, froms
    return froms.pop()


def has_image(name: str) -> bool:
    return docker("image", "inspect", name, check=False).returncode == 0


def make_standin_base(name: str) -> None:
    """Debian bookworm's minimal system + Python, tagged as the Dockerfile's base (about a minute). Whatever
    patch release the tag names (python:3.11.14-...), the stand-in's Python is Debian 12's 3.11.2: the
    same minor, so pip installs the same cp311 wheels."""
    if not shutil.which("debootstrap"):
        required("debootstrap", "not installed (.ci/run installs it): it makes the stand-in base image")
    if os.geteuid() != 0:
        required("root", "debootstrap needs root to make the stand-in base image")
    with tempfile.TemporaryDirectory(prefix="ddp-base.") as tmp:
        rootfs = Path(tmp) / "rootfs"
        proc = subprocess.run(["nice", "-n", "19", "debootstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}",
                               "bookworm", str(rootfs)], capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"debootstrap failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True)
        changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                   'CMD ["python3"]']
        if CA_BUNDLE.exists():  # this machine's trust (TLS interception) for pip inside the build
            shutil.copy(CA_BUNDLE, rootfs / "usr/local/share/ca-bundle.crt")
            changes.append("ENV PIP_CERT=/usr/local/share/ca-bundle.crt")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        args = [a for c in changes for a in ("--change", c)]
        imported = subprocess.run(["docker", "import", *args, "-", name], stdin=tar.stdout, capture_output=True,
                                  text=True, timeout=600)
        tar.wait()
        assert imported.returncode == 0, imported.stderr


def build_image() -> None:
    """`make docker-build`, as a user runs it."""
    proc = subprocess.run(["make", "docker-build", f"IMAGE={IMAGE}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, f"make docker-build failed\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}"


def prepare_image() -> None:
    """The base (pulled, else stood in) and then the image."""
    problem = engine_problem()
    if problem:
        required("a Docker engine", problem)
    base = base_image()
    if not has_image(base):
        try:  # a real registry first (a user's machine), else the stand-in
            docker("pull", base, timeout=600)
        except AssertionError:
            make_standin_base(base)
    build_image()


BUILD_LOCK = Path(tempfile.gettempdir()) / f"ddp-template-image-build.{os.getuid()}.lock"
_build: dict = {}  # the background build: its thread, and the "error" it raised, if any


def start_build() -> None:
    """prepare_image() in a background thread, once per session (the image fixture waits for it)."""
    if "thread" in _build:
        return

    def work() -> None:
        try:
            # One build at a time on this machine: under pytest-xdist each worker is a process of its own,
            # and the second to get here finds the image built (Docker's cache makes that seconds).
            with BUILD_LOCK.open("w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                prepare_image()
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
