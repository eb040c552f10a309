"""The image (Dockerfile) and docker compose, checked without a Docker engine: lint, schema, the packages
the image installs, and the compose nodes' commands run as local processes that train together."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, clean_env, summary
from tests.multinode import (
    Addresses,
    Node,
    dockerfile_instructions,
    final_stage,
    image_exec,
    local_argv,
    map_paths,
    quoted,
    required,
    run_nodes,
    tiny,
    workdir,
)

COMPOSE = ROOT / "docker-compose.yml"
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        required(name, "not installed: make dev (requirements-dev.txt) installs it")
    return found


def _interpolate(value, env: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}, over a loaded file."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            name, op, default = m[1], m[2], m[3] or ""
            if op == ":-":
                return env.get(name) or default
            return env.get(name, default if op == "-" else "")

        return re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", sub, value)
    return value


def _compose(env: dict[str, str] | None = None) -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


def _requirements(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


# ------------------------------------------------------------------------------------------- Dockerfile

def test_dockerfile_passes_hadolint():
    proc = subprocess.run([_tool("hadolint"), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


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
            # Only requirement files, and only the one CI installs: no package named in the Dockerfile.
            assert all(p.endswith("requirements.txt") for p in packages), command
            assert "-r" in words or "--requirement" in words, command
    copies = [rest.split() for word, rest in steps if word == "COPY" and "requirements" in rest]
    assert copies and all(c[0] == "requirements.txt" for c in copies), copies
    # CI (make test) installs the same file: requirements-dev.txt includes it, the venv target installs it.
    assert "-r requirements.txt" in _requirements(ROOT / "requirements-dev.txt")
    assert re.search(r"pip install .*-r requirements\.txt", (ROOT / "Makefile").read_text())
    # Every runtime requirement is pinned, and the versions the tests run with are those pins.
    for req in _requirements(ROOT / "requirements.txt"):
        name, sep, version = req.partition("==")
        assert sep and re.fullmatch(r"[\w.+-]+", version), f"not pinned exactly: {req}"
        assert metadata.version(name).split("+")[0] == version, f"{name}: tested {metadata.version(name)}, pin {req}"


def test_image_conventions():
    steps = dockerfile_instructions()
    froms = [rest.split()[0] for word, rest in steps if word == "FROM"]
    for image in froms:  # every base image pinned to an exact release tag (or a digest)
        assert "@sha256:" in image or re.search(r":\d+\.\d+\.\d+[\w.-]*$", image), image
    assert len(froms) >= 2, "multi-stage: the runtime stage copies a built environment"
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
        assert "VISIBLE_DEVICES" not in name, "the device plugin or --gpus chooses the GPUs"
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


@pytest.mark.parametrize("args", [["--config", "configs/default.yaml", "train.steps=3", "run.name=x"],
                                  ["--", "--config", "configs/default.yaml", "train.steps=3", "run.name=x"]])
def test_docker_run_arguments_reach_training(args):
    """`docker run IMAGE --config ... key=value`: the entrypoint passes them to `python -m train`."""
    argv = local_argv([*image_exec("ENTRYPOINT"), "--dry-run", *args])
    proc = subprocess.run(argv, cwd=ROOT, env=clean_env(NPROC_PER_NODE="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    torchrun = [line for line in proc.stderr.splitlines() if line.startswith("+ ")][-1]
    assert torchrun.endswith("-m train --config configs/default.yaml train.steps=3 run.name=x"), torchrun
    # The default CMD is a valid training command too.
    cmd = local_argv([*image_exec("ENTRYPOINT"), "--dry-run", *image_exec("CMD")])
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(NPROC_PER_NODE="1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_make_targets_build_and_run_what_the_manifests_name():
    env = {k: v for k, v in os.environ.items() if k not in ("IMAGE", "PROFILE", "COMPOSE", "MAKEFLAGS")}
    proc = subprocess.run(["make", "-n", "docker-build", "compose-up", "compose-down"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    image = f"ddp-template:{VERSION}"
    assert re.search(rf"docker build .*-t {re.escape(image)}", out), out
    assert f"VERSION={VERSION}" in out
    assert re.search(r"docker compose .*--profile gpu.* up", out), out
    assert re.search(r"docker compose .* down", out), out
    # The tag make builds is the one compose and the PyTorchJob run.
    assert {s["image"] for s in _compose()["services"].values()} == {image}
    k8s_images = {c["image"] for doc in yaml.safe_load_all((ROOT / "k8s" / "pytorchjob.yaml").read_text())
                  for r in doc["spec"]["pytorchReplicaSpecs"].values() for c in r["template"]["spec"]["containers"]}
    assert k8s_images == {image}


# ---------------------------------------------------------------------------------------- docker compose

def test_compose_file_validates_against_the_compose_spec():
    proc = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _profile(name: str) -> dict[str, dict]:
    return {n: s for n, s in _compose()["services"].items() if name in s.get("profiles", [])}


def test_compose_topology():
    compose = _compose()
    gpu, cpu = _profile("gpu"), _profile("cpu")
    assert set(compose["services"]) == set(gpu) | set(cpu), "every service is a node of one variant"
    assert len(gpu) == len(cpu) >= 2
    for nodes, has_gpus in ((gpu, True), (cpu, False)):
        first = next(iter(nodes))
        commands = set()
        for name, s in nodes.items():
            env = s["environment"]
            assert env["RDZV_ENDPOINT"].split(":")[0] == first, "c10d rendezvous at the first node's service"
            assert env["NNODES"].split(":")[-1] == str(len(nodes))
            assert s.get("restart") in ("on-failure", "always", "unless-stopped") or s.get("deploy", {}).get(
                "restart_policy"), f"{name}: a killed node must come back"
            assert s.get("shm_size") or s.get("ipc") == "host", name
            if s.get("read_only"):  # as on Kubernetes; the image keeps HOME and its caches in /tmp
                assert any(t.split(":")[0] == "/tmp" for t in s.get("tmpfs", [])), name
            assert any(v.split(":")[1] == "/runs" for v in s["volumes"]), "the shared run volume"
            devices = s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
            assert bool(devices) == has_gpus, name
            assert all("gpu" in d["capabilities"] for d in devices)
            commands.add(tuple(s["command"]))
        assert len(commands) == 1, "every node runs the same training command"
    assert {tuple(s["command"]) for s in gpu.values()} == {tuple(s["command"]) for s in cpu.values()}
    named = [v.split(":")[0] for s in compose["services"].values() for v in s["volumes"]]
    assert set(named) <= set(compose.get("volumes", {})), "a named volume, shared by the nodes"


def compose_nodes(profile: str, tmp: Path) -> tuple[list[Node], dict[str, Path]]:
    """The profile's services as local processes: the image's entrypoint + the service's command (+ TINY),
    the service's environment, its volumes as folders under tmp (a named volume is one folder for all)."""
    compose = _compose()
    services = _profile(profile)
    addresses = Addresses(list(services))
    nodes, volumes = [], {}
    for name, s in services.items():
        mounts = {}
        for spec in s.get("volumes", []):
            source, target = spec.split(":")[:2]
            assert source in compose.get("volumes", {}), f"{name}: {spec} is not a named volume"
            mounts[target] = volumes.setdefault(source, tmp / "volumes" / source)
            mounts[target].mkdir(parents=True, exist_ok=True)
        entrypoint = s.get("entrypoint") or image_exec("ENTRYPOINT")
        command = s.get("command", image_exec("CMD"))
        command = command if isinstance(command, list) else command.split()
        argv = local_argv([map_paths(addresses(a), mounts) for a in [*entrypoint, *command]])
        env = clean_env(**{k: map_paths(addresses(str(v)), mounts) for k, v in s.get("environment", {}).items()})
        nodes.append(Node(name, tiny(argv), env, tmp / f"{name}.log"))
    return nodes, volumes


def test_compose_cpu_nodes_train_together(tmp_path):
    nodes, volumes = compose_nodes("cpu", tmp_path)
    assert len(nodes) == 2
    for node in nodes:
        print(f"{node.name}: {quoted(node.argv)}")
    results = run_nodes(nodes)
    for name, (code, log) in results.items():
        assert code == 0, f"{name} exited {code}\n{log[-4000:]}"
    run_dir = volumes["runs"] / "compose"
    s = summary(run_dir)
    assert s["world_size"] == 2 and s["steps"] == 6, s
    assert s["ranks_in_sync"], s
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert json.loads((run_dir / "run_info.json").read_text())
