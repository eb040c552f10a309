"""What the image (Dockerfile) holds. Without an engine: lint, the packages it installs, its conventions, what
the build is sent. In the image built by a real Docker engine (tests/engine.py, `make docker-build`): CUDA torch,
a compiler and the verbs libraries, the doctor's transport row. `docker run` and `docker stop`/`start` with it,
torch.compile compiling with the image's compiler: tests/systems/test_container.py; compose, several nodes:
tests/systems/test_compose.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests import engine
from tests.conftest import RESNET as TINY  # the image holds no tests/: the built-in model, at TINY's sizes
from tests.conftest import ROOT
from tests.engine import RUN_FLAGS, docker
from tests.multinode import tool
from tests.quick.test_image import _requirements

# The engine's fixtures: the image built by make docker-build, a fresh volume
image, volume = engine.image, engine.volume


@pytest.mark.parametrize("path", ["Dockerfile", "tasks/Dockerfile"])
def test_dockerfile_passes_hadolint(path):
    proc = subprocess.run([tool("hadolint"), "--no-color", path], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_make_docker_build_refuses_a_config_whose_task_file_the_image_leaves_out(tmp_path):
    """A config in tasks/ (or configs/) naming my_task.py at the project root: `make docker-build` stops in one
    line before it builds, naming the config, the file and tasks/; with the file in tasks/ the check passes."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "tasks").mkdir()
    shutil.copy(ROOT / "examples" / "regression.py", tmp_path / "my_task.py")
    (tmp_path / "tasks" / "my.yaml").write_text("task:\n  name: my_task.py:Regression  # the README's step 1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("IMAGE", "MAKEFLAGS")}
    proc = subprocess.run(["make", "docker-build"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: tasks/my.yaml: task.name names my_task.py, which the image leaves out (.dockerignore "
                      "is an allow-list): move it to tasks/ and name it tasks/my_task.py"], proc.stderr
    assert "docker build" not in proc.stdout, "it built anyway"
    (tmp_path / "my_task.py").rename(tmp_path / "tasks" / "my_task.py")
    (tmp_path / "tasks" / "my.yaml").write_text("task:\n  name: tasks/my_task.py:Regression\n")
    proc = subprocess.run(["make", "docker-context-check"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    # The project's own configs pass it (the image the tests build went through it).
    assert subprocess.run(["make", "docker-context-check"], cwd=ROOT, env=env, timeout=60).returncode == 0


def test_the_image_has_cuda_torch_a_compiler_and_the_verbs_libraries(image):
    probe = ("import ctypes, os, shutil, sysconfig, torch; ctypes.CDLL('libibverbs.so.1'); "
             "print(torch.__version__, torch.version.cuda, shutil.which('gcc'), shutil.which('g++'), "
             "os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))")
    proc = docker("run", "--rm", *RUN_FLAGS, "--entrypoint", "python", image, "-c", probe, timeout=300)
    version, cuda, gcc, gxx, headers = proc.stdout.split()
    pin = next(r for r in _requirements(ROOT / "requirements.txt") if r.startswith("torch=="))
    assert version.split("+")[0] == pin.split("==")[1], version
    assert cuda.startswith("13."), f"pip installed a CPU-only torch ({version}, cuda {cuda})"
    assert gcc != "None" and gxx != "None" and headers == "True", proc.stdout
    env = json.loads(docker("image", "inspect", "-f", "{{json .Config.Env}}", image).stdout)
    assert "NVIDIA_VISIBLE_DEVICES=all" in env


def test_the_doctor_in_the_image_reports_the_transport(image, volume):
    proc = docker("run", "--rm", *RUN_FLAGS, "-v", f"{volume}:/runs", image, "--doctor", "--nproc-per-node", "1",
                  "--", "--config", "configs/default.yaml", *TINY, "run.dir=/runs/d", timeout=600)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("transport "))
    # CPU: gloo over sockets, said so; the verbs library NCCL needs for InfiniBand/RoCE is in the image.
    assert "gloo: TCP sockets" in row and "libibverbs loads" in row and "RDMA devices: none" in row, row
