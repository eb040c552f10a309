"""The project's image for the container tests: built with `make docker-build` from the Dockerfile, unchanged,
on its base image pulled, or else stood in from Debian's packages when no registry is reachable (no Docker Hub
from CI or this sandbox). Python's standard library only, so that it runs before the project's venv exists:

    python3 tests/image_build.py       # .ci/run: in the background, while pip installs the venv

tests/engine.py builds it the same way in a background thread when the tests start; one build at a time on a
machine (a lock), so tests started during this script's build wait for it and then find the image built
(Docker's build cache makes that a matter of seconds).

The stand-in base carries what this sandbox needs and python:slim has: a Python 3.11 with its headers, and, for
pip behind this machine's TLS interception, the machine's CA bundle (PIP_CERT). It is made once per machine and
kept (a second run finds the tag). From cold (a fresh CI machine) the base and the build take about 8 minutes,
mostly downloading and unpacking the 6 GB environment, at the lowest CPU priority (.ci/run starts the engine
under `nice`, debootstrap runs under it here): they take only the cores the rest leaves idle."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
IMAGE_VERSION = next(line.split('"')[1] for line in (ROOT / "pyproject.toml").read_text().splitlines()
                     if line.startswith("version = "))
IMAGE = f"ddp-template:{IMAGE_VERSION}"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# python:slim's interpreter has its headers (Triton's C helper includes Python.h); Debian's needs python3-dev.
DEBIAN_PACKAGES = "python3,python3-venv,python3-dev,python-is-python3,ca-certificates"
BUILD_LOCK = Path(tempfile.gettempdir()) / f"ddp-template-image-build.{os.getuid()}.lock"


class Missing(Exception):
    """A prerequisite this machine lacks (the tests skip with it, or fail under CI)."""

    def __init__(self, what: str, reason: str):
        super().__init__(f"{what}: {reason}")
        self.what, self.reason = what, reason


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def run_docker(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)


def engine_problem() -> str | None:
    """Why no engine can be used here, or None."""
    if not shutil.which("docker"):
        return "no docker command (.ci/run installs Debian's docker.io)"
    proc = run_docker("info", "--format", "{{.ServerVersion}}", timeout=60)
    if proc.returncode != 0:
        return f"no Docker daemon answers ({proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}); " \
               ".ci/run starts dockerd"
    return None


def base_image() -> str:
    """The base the Dockerfile's stages start FROM (the same one for all)."""
    froms = {rest.split()[0] for word, rest in dockerfile_instructions() if word == "FROM"}
    if len(froms) != 1:
        raise RuntimeError(f"the Dockerfile's stages start from {sorted(froms)}, not one base")
    return froms.pop()


def has_image(name: str) -> bool:
    return run_docker("image", "inspect", name).returncode == 0


def make_standin_base(name: str) -> None:
    """Debian bookworm's minimal system + Python, tagged as the Dockerfile's base (about a minute). Whatever
    patch release the tag names (python:3.11.14-...), the stand-in's Python is Debian 12's 3.11.2: the
    same minor, so pip installs the same cp311 wheels."""
    if not shutil.which("debootstrap"):
        raise Missing("debootstrap", "not installed (.ci/run installs it): it makes the stand-in base image")
    if os.geteuid() != 0:
        raise Missing("root", "debootstrap needs root to make the stand-in base image")
    with tempfile.TemporaryDirectory(prefix="ddp-base.") as tmp:
        rootfs = Path(tmp) / "rootfs"
        proc = subprocess.run(["nice", "-n", "19", "debootstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}",
                               "bookworm", str(rootfs)], capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"debootstrap failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True)
        changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                   'CMD ["python3"]']
        if CA_BUNDLE.exists():  # this machine's trust (TLS interception) for pip inside the build
            shutil.copy(CA_BUNDLE, rootfs / "usr/local/share/ca-bundle.crt")
            changes.append("ENV PIP_CERT=/usr/local/share/ca-bundle.crt")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        args = [a for c in changes for a in ("--change", c)]
        imported = run_docker("import", *args, "-", name, stdin=tar.stdout, timeout=600)
        tar.wait()
        if imported.returncode != 0:
            raise RuntimeError(f"docker import of the stand-in base failed: {imported.stderr}")


def build_image() -> None:
    """`make docker-build`, as a user runs it."""
    proc = subprocess.run(["make", "docker-build", f"IMAGE={IMAGE}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"make docker-build failed\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")


def prepare_image() -> None:
    """The base (pulled, else stood in) and then the image, one build at a time on this machine."""
    problem = engine_problem()
    if problem:
        raise Missing("a Docker engine", problem)
    with BUILD_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        base = base_image()
        if not has_image(base):  # a real registry first (a user's machine), else the stand-in
            if run_docker("pull", base, timeout=600).returncode != 0:
                make_standin_base(base)
        build_image()


def main() -> int:
    start = time.time()
    try:
        prepare_image()
    except (Missing, RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"error: {IMAGE} not built: {e}", file=sys.stderr)
        return 1
    print(f"built {IMAGE} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
