"""What the image holds, read without an engine: its Dockerfiles, requirements and context."""
from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

from tests.conftest import ROOT
from tests.image_build import IMAGE_VERSION as VERSION
from tests.image_build import dockerfile_instructions
from tests.multinode import final_stage, image_exec, workdir


def _requirements(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


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


def test_dockerignore_sends_only_what_the_image_copies():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "an allow-list: nothing else (.git, .venv, runs, .env) reaches the build"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = {rest.split()[0].rstrip("/") for word, rest in dockerfile_instructions()
              if word == "COPY" and not rest.startswith("--from")}
    assert copied <= allowed, copied - allowed
    assert not any(re.search(r"\.env|secret|\.git$|\.venv|runs", a) for a in allowed), allowed
