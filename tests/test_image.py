"""What the image (Dockerfile) holds. Without an engine: lint, the packages it installs, its conventions, what
the build is sent. In the image built by a real Docker engine (tests/engine.py, `make docker-build`): CUDA torch,
a compiler and the verbs libraries, the doctor's transport row. `docker run` and `docker stop`/`start` with it,
torch.compile compiling with the image's compiler: tests/test_container.py; compose, several nodes:
tests/test_compose.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from tests import engine
from tests.conftest import RESNET as TINY  # the image holds no tests/: the built-in model, at TINY's sizes
from tests.conftest import ROOT
from tests.engine import RUN_FLAGS, docker
from tests.image_build import IMAGE_VERSION as VERSION
from tests.image_build import dockerfile_instructions
from tests.multinode import final_stage, image_exec, tool, workdir

# The engine's fixtures: the image built by make docker-build, a fresh volume
image, volume = engine.image, engine.volume


def _requirements(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


# ------------------------------------------------------------------------------------------- Dockerfile

@pytest.mark.parametrize("path", ["Dockerfile", "tasks/Dockerfile"])
def test_dockerfile_passes_hadolint(path):
    proc = subprocess.run([tool("hadolint"), "--no-color", path], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_task_dockerfile_builds_on_the_tag_make_builds_and_trains_tasks_my_yaml():
    """tasks/Dockerfile (an image of the user's, FROM the template's): its default base is the tag `make
    docker-build` makes, it copies its folder to the template's tasks/, and its CMD trains tasks/my.yaml."""
    steps = dockerfile_instructions(ROOT / "tasks" / "Dockerfile")
    assert ("ARG", f"BASE=ddp-template:{VERSION}") in steps and steps[1] == ("FROM", "${BASE}"), steps
    assert ("COPY", f". {workdir()}/tasks/") in steps, "into the template's WORKDIR's tasks/"
    assert json.loads(dict(steps)["CMD"]) == ["--config", "tasks/my.yaml"]
    assert not {"ENTRYPOINT", "USER", "WORKDIR"} & set(dict(steps)), "the template's entrypoint, user and folder"


REQUIREMENTS = ("requirements.txt", "requirements-hf.txt")  # what the image installs: the runtime, the HF trio


def test_the_image_installs_the_requirements_ci_installs_and_tests():
    steps = dockerfile_instructions()
    installs = [rest for word, rest in steps if word == "RUN" and "pip install" in rest]
    assert installs, "the Dockerfile installs nothing with pip"
    for run in installs:
        for command in re.split(r"&&|;", run):
            if "pip install" not in command:
                continue
            words = command.split()
            packages = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
            # Only requirement files, and only those CI installs: no package named in the Dockerfile.
            assert all(p.endswith(REQUIREMENTS) for p in packages), command
            assert "-r" in words or "--requirement" in words, command
    copies = [rest.split() for word, rest in steps if word == "COPY" and "requirements" in rest]
    assert copies and all(set(c[:-1]) <= {*REQUIREMENTS, "/tmp/"} for c in copies), copies
    # CI (make test) installs the same files: requirements-dev.txt includes the runtime's, the dev target adds
    # the Hugging Face trio's, the venv target installs the runtime's alone (make train-local needs no more).
    assert "-r requirements.txt" in _requirements(ROOT / "requirements-dev.txt")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"pip install .*-r requirements\.txt", makefile)
    assert re.search(r"pip install .*-r requirements-hf\.txt", makefile)
    # Every requirement is pinned, and the versions the tests run with are those pins.
    for file in REQUIREMENTS:
        for req in _requirements(ROOT / file):
            name, sep, version = req.partition("==")
            assert sep and re.fullmatch(r"[\w.+-]+", version), f"{file}: not pinned exactly: {req}"
            tested = metadata.version(name).split("+")[0]
            assert tested == version, f"{name}: tested {tested}, pin {req}"


def test_image_conventions():
    steps = dockerfile_instructions()
    froms = [rest.split()[0] for word, rest in steps if word == "FROM"]
    for base in froms:  # every base image pinned to an exact release tag (or a digest)
        assert "@sha256:" in base or re.search(r":\d+\.\d+\.\d+[\w.-]*$", base), base
    # One stage, the environment installed in place: a stage copying it (COPY --from) doubled a cold build's
    # time and CPU (the Dockerfile's figures), which CI pays in the middle of the suite.
    assert len(froms) == 1 and not any(w == "COPY" and rest.startswith("--from") for w, rest in steps), froms
    installs = [rest for word, rest in steps if word == "RUN" and "pip install" in rest]
    assert installs and all("--no-cache-dir" in rest for rest in installs), installs
    final = final_stage(steps)
    users = [rest for word, rest in final if word == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]), f"a numeric non-root USER, got {users}"
    assert image_exec("ENTRYPOINT") == ["python", "-m", "train.launch"]
    copies = [rest.split() for word, rest in final if word == "COPY" and not rest.startswith("--from")]
    assert {c[0].rstrip("/") for c in copies} >= {"train", "configs"}
    assert workdir().startswith("/")

    env = {}
    for word, rest in final:
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", rest)))
    assert env.get("PYTHONUNBUFFERED") == "1"
    for name in ("HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR", "TRITON_CACHE_DIR"):
        assert env.get(name, "").startswith("/tmp"), f"{name} must be writable with a read-only root: {env.get(name)}"
    # NCCL: nothing debug-level and nothing specific to one network left on.
    assert env.get("NCCL_DEBUG", "WARN") in ("WARN", "VERSION"), env.get("NCCL_DEBUG")
    for name in env:
        assert not re.match(r"NCCL_(DEBUG_|.*IFNAME|.*_DISABLE|.*HCA|.*TRACE)", name), name
        assert name == "NVIDIA_VISIBLE_DEVICES" or "VISIBLE_DEVICES" not in name, name
    # enroot/pyxis (and a default nvidia runtime) inject the driver only when the image asks for it;
    # --gpus and the device plugin override "all" with the GPUs they grant.
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    assert set(env.get("NVIDIA_DRIVER_CAPABILITIES", "").split(",")) >= {"compute", "utility"}
    # No secrets baked in.
    for word, rest in steps:
        if word in ("ENV", "ARG", "LABEL"):
            assert not re.search(r"(KEY|TOKEN|PASSWORD|SECRET|CREDENTIAL)\w*=", rest, re.I), rest
    labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', " ".join(
        rest for word, rest in final if word == "LABEL")))
    assert {"org.opencontainers.image.version", "org.opencontainers.image.source"} <= labels.keys()
    args = dict(re.findall(r"^(\w+)=(\S+)$", "\n".join(rest for word, rest in final if word == "ARG"), re.M))
    assert args.get("VERSION") == VERSION, "the image's version label defaults to pyproject's version"


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


def test_dockerignore_sends_only_what_the_image_copies():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "an allow-list: nothing else (.git, .venv, runs, .env) reaches the build"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = {rest.split()[0].rstrip("/") for word, rest in dockerfile_instructions()
              if word == "COPY" and not rest.startswith("--from")}
    assert copied <= allowed, copied - allowed
    assert not any(re.search(r"\.env|secret|\.git$|\.venv|runs", a) for a in allowed), allowed


# ------------------------------------------------------------------------------------------- the image

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
