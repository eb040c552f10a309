"""The image (Dockerfile) and docker compose. Without an engine: lint, schemas, the packages the image
installs, Compose v1's own check of the file. With a real Docker engine (tests/engine.py builds the image
with `make docker-build`): `docker run` read-only as user 10001, `docker stop`/`docker start` resuming
bitwise, torch.compile and the doctor inside the image, and the compose cpu profile's two nodes started in
either order and one of them killed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from tests import engine
from tests.conftest import RESNET as TINY  # the image holds no tests/: the built-in model, at TINY's sizes
from tests.conftest import ROOT, assert_same_training, latest_state, summary
from tests.engine import docker
from tests.multinode import dockerfile_instructions, final_stage, image_exec, required, workdir
from tests.procs import logged_steps, wait_for

# The engine's fixtures: the image built by make docker-build, a fresh volume, containers removed afterwards
image, volume, containers = engine.image, engine.volume, engine.containers

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


def test_make_targets_build_and_run_what_the_manifests_name():
    env = {k: v for k, v in os.environ.items() if k not in ("IMAGE", "PROFILE", "COMPOSE", "MAKEFLAGS")}
    proc = subprocess.run(["make", "-n", "docker-build", "compose-up", "compose-down"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    tag = f"ddp-template:{VERSION}"
    assert re.search(rf"docker build .*-t {re.escape(tag)}", out), out
    assert f"VERSION={VERSION}" in out
    # Compose v2 where installed, else v1; either way with a project name (v1 reads no `name:`)
    compose = "docker compose" if _v2() else "docker-compose"
    assert re.search(rf"{compose} -p ddp-template --profile gpu up", out), out
    assert re.search(rf"{compose} -p ddp-template .* down", out), out
    # The tag make builds is the one compose and the PyTorchJob run.
    assert {s["image"] for s in _compose()["services"].values()} == {tag}
    k8s_images = {c["image"] for doc in yaml.safe_load_all((ROOT / "k8s" / "pytorchjob.yaml").read_text())
                  for r in doc["spec"]["pytorchReplicaSpecs"].values() for c in r["template"]["spec"]["containers"]}
    assert k8s_images == {tag}


# ---------------------------------------------------------------------------------------- docker compose

def _v2() -> bool:
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0 \
        if shutil.which("docker") else False


def compose_cli() -> list[str]:
    """The Compose the Makefile uses: v2 where installed, else v1 (Debian 12 packages only v1)."""
    if _v2():
        return ["docker", "compose"]
    if not shutil.which("docker-compose"):
        required("docker compose or docker-compose", "not installed (.ci/run installs Debian's docker-compose)")
    return ["docker-compose"]


def test_compose_file_validates_against_the_compose_spec():
    proc = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_v1_and_v2_read_the_file():
    """Compose itself (no engine needed) resolves the file, with no top-level `name:` (v1 rejects it)."""
    assert "name" not in _compose(), "Compose v1 rejects a top-level name: use -p / COMPOSE_PROJECT_NAME"
    proc = subprocess.run([*compose_cli(), "-p", "ddp-template", "--profile", "cpu", "config"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    profiles = {n: s["profiles"] for n, s in _compose()["services"].items()}
    assert {n: s["profiles"] for n, s in services.items()} == profiles


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
            # the launcher's stop budget ends inside compose's grace period (else SIGKILL before the save)
            grace = sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+)([hms])",
                                                                                      s["stop_grace_period"]))
            assert int(env["STOP_TIMEOUT"]) < grace, f"{name}: STOP_TIMEOUT {env['STOP_TIMEOUT']} >= {grace} s"
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




# ------------------------------------------------------------------------------ the image on a real engine

RUN_FLAGS = ["--read-only", "--user", "10001", "--tmpfs", "/tmp:exec,mode=1777", "--shm-size", "1g"]
SEGMENTED = [*TINY, "train.steps=40", "train.log_every=5"]


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


@pytest.mark.parametrize("args", [["--config", "configs/default.yaml", "train.steps=3", "run.name=x"],
                                  ["--", "--config", "configs/default.yaml", "train.steps=3", "run.name=x"]])
def test_docker_run_arguments_reach_training(image, args):
    """`docker run IMAGE --config ... key=value`: the entrypoint passes them to `python -m train`."""
    proc = docker("run", "--rm", *RUN_FLAGS, "-e", "NPROC_PER_NODE=1", image, "--dry-run", *args, timeout=300)
    torchrun = [line for line in proc.stderr.splitlines() if line.startswith("+ ")][-1]
    assert torchrun.endswith("-m train --config configs/default.yaml train.steps=3 run.name=x"), torchrun
    docker("run", "--rm", *RUN_FLAGS, "-e", "NPROC_PER_NODE=1", image, "--dry-run", timeout=300)  # the default CMD


@pytest.fixture(scope="module")
def uninterrupted(image) -> Path:
    """`docker run` as docs/containers.md shows it, read-only root, user 10001: 2 CPU ranks, 40 steps, to the end."""
    name = f"ddp-test-{uuid.uuid4().hex[:8]}"
    docker("volume", "create", name)
    try:
        docker("run", "--rm", *RUN_FLAGS, "-v", f"{name}:/runs", image, "--nproc-per-node", "2", "--",
               "--config", "configs/default.yaml", *SEGMENTED, "run.dir=/runs/r", timeout=900)
        yield volume_path(name) / "r"
    finally:
        docker("volume", "rm", "-f", name, check=False)


def test_docker_run_read_only_as_10001_trains_into_the_runs_volume(uninterrupted):
    s = summary(uninterrupted)
    assert s["world_size"] == 2 and s["steps"] == 40 and s["ranks_in_sync"], s
    assert sorted(p.name for p in (uninterrupted / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert (uninterrupted / "checkpoints" / "latest").exists()
    owners = {p.stat().st_uid for p in uninterrupted.rglob("*")}
    assert owners == {10001}, owners


def test_docker_stop_saves_exits_75_and_docker_start_resumes_bitwise(image, volume, containers, uninterrupted):
    """`docker stop` (its grace period, --stop-timeout, above the launcher's STOP_TIMEOUT): a checkpoint and
    exit 75; `docker start` runs the same command again, which continues to the uninterrupted run's end."""
    name = containers()
    run_dir = volume_path(volume) / "r"
    docker("run", "-d", "--name", name, *RUN_FLAGS, "--stop-timeout", "90", "-e", "STOP_TIMEOUT=60",
           "-v", f"{volume}:/runs", image, "--nproc-per-node", "2", "--", "--config", "configs/default.yaml",
           *SEGMENTED, "run.dir=/runs/r")
    wait_for(lambda: state(name)[0] != "running" or any(s >= 10 for s in logged_steps(run_dir)), 600, "step 10")
    assert state(name)[0] == "running", logs(name)
    docker("stop", name, timeout=200)
    status, code, _ = state(name)
    assert (status, code) == ("exited", 75), logs(name)
    stopped = latest_state(run_dir)["step"]
    assert json.loads((run_dir / "STOPPED").read_text())["step"] == stopped and 10 <= stopped < 40
    assert "stopped on SIGTERM" in logs(name)

    docker("start", name)
    wait_for(lambda: state(name)[0] == "exited", 600, "the resumed run to end")
    assert state(name)[1] == 0, logs(name)
    assert summary(run_dir)["steps"] == 40
    assert_same_training(uninterrupted, run_dir)


def test_the_example_user_task_trains_in_the_image(image, volume):
    """examples/ is in the image: a user's task file, its data set unpickled by a loader worker per rank,
    on a read-only root as user 10001."""
    docker("run", "--rm", *RUN_FLAGS, "-v", f"{volume}:/runs", image, "--nproc-per-node", "2", "--",
           "--config", "examples/regression.yaml", "train.steps=40", "data.num_workers=1",
           "log.wandb.mode=disabled", "log.report=false", "run.dir=/runs/ex", timeout=600)
    s = summary(volume_path(volume) / "ex")
    assert s["steps"] == 40 and s["world_size"] == 2 and s["ranks_in_sync"] and "eval_mae" in s, s


def test_torch_compile_in_the_image_on_cpu(image, volume):
    """train.compile=true: inductor's CPU backend compiles C++ with the image's compiler, read-only root."""
    docker("run", "--rm", *RUN_FLAGS, "-v", f"{volume}:/runs", "-e", "TORCHINDUCTOR_CACHE_DIR=/runs/c-inductor",
           image, "--nproc-per-node", "1", "--",
           "--config", "configs/default.yaml", *TINY, "train.steps=3", "train.compile=true", "run.dir=/runs/c",
           timeout=900)
    run_dir = volume_path(volume) / "c"
    assert summary(run_dir)["steps"] == 3
    # Code was compiled: inductor's C++ kernels, built by the image's compiler, are in its cache.
    built = list((volume_path(volume) / "c-inductor").rglob("*.so"))
    assert built, sorted(p.name for p in (volume_path(volume) / "c-inductor").rglob("*"))[:20]


def test_the_doctor_in_the_image_reports_the_transport(image, volume):
    proc = docker("run", "--rm", *RUN_FLAGS, "-v", f"{volume}:/runs", image, "--doctor", "--nproc-per-node", "1",
                  "--", "--config", "configs/default.yaml", *TINY, "run.dir=/runs/d", timeout=600)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("transport "))
    # CPU: gloo over sockets, said so; the verbs library NCCL needs for InfiniBand/RoCE is in the image.
    assert "gloo: TCP sockets" in row and "libibverbs loads" in row and "RDMA devices: none" in row, row


# ---------------------------------------------------------------------------------- compose, for real

class Project:
    """The compose file's cpu profile as a project of its own, the nodes' command + a short training."""

    def __init__(self, tmp: Path, tag: str, *overrides: str):
        self.name = f"ddp-test-{uuid.uuid4().hex[:8]}"
        command = [*_profile("cpu")["cpu-node0"]["command"], *overrides]
        override = tmp / "compose.override.yml"
        override.write_text(yaml.safe_dump({"services": {n: {"command": command} for n in _profile("cpu")}}))
        self.cli = [*compose_cli(), "-p", self.name, "-f", str(COMPOSE), "-f", str(override), "--profile", "cpu"]
        self.env = {**os.environ, "IMAGE": tag}

    def __call__(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.cli, *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(args)}: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        return proc

    def container(self, service: str) -> str:
        return docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.name}",
                      "--filter", f"label=com.docker.compose.service={service}").stdout.split()[0]

    def run_dir(self) -> Path:
        found = docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={self.name}").stdout
        return volume_path(found.split()[0]) / "compose"

    def wait_done(self, timeout: float = 900) -> None:
        """Until every node has exited 0 (restart: on-failure brings back any other exit)."""
        def done():
            return all(state(self.container(s))[:2] == ("exited", 0) for s in _profile("cpu"))
        try:
            wait_for(done, timeout, "both nodes to finish")
        except AssertionError as e:
            nodes = "\n".join(f"--- {n}: {state(self.container(n))}\n{logs(self.container(n))}"
                               for n in _profile("cpu"))
            raise AssertionError(f"{e}\n{nodes}") from None

    def down(self) -> None:
        subprocess.run([*self.cli, "down", "-v", "--remove-orphans"], cwd=ROOT, env=self.env, capture_output=True,
                       timeout=300)


@pytest.fixture
def project(image, tmp_path):
    made = []

    def new(*overrides: str) -> Project:
        made.append(Project(tmp_path, image, *TINY, *overrides))
        return made[-1]

    yield new
    for p in made:
        p.down()


def test_compose_cpu_nodes_started_last_node_first_train_to_the_end(project):
    """Node 1 first; the rendezvous host, node 0, tens of seconds later: node 1 waits for it."""
    p = project("train.steps=12")
    p("up", "-d", "cpu-node1")
    # Node 1 says it waits for the rendezvous host (then polls it every second): start node 0 only then.
    wait_for(lambda: "waiting up to" in logs(p.container("cpu-node1")), 300, "node 1 waiting for node 0")
    time.sleep(3)
    assert state(p.container("cpu-node1"))[0] == "running", logs(p.container("cpu-node1"))
    p("up", "-d", "cpu-node0")
    p.wait_done()
    s = summary(p.run_dir())
    assert s["world_size"] == 2 and s["steps"] == 12 and s["ranks_in_sync"], s


def test_compose_a_killed_node_comes_back_and_the_job_finishes(project):
    """SIGKILL to one node's container process (a crash, an OOM kill): restart: on-failure restarts it, it
    rejoins, and the job resumes from the latest checkpoint and ends. (`docker kill` itself counts as a
    manual stop, which no restart policy undoes: `docker compose start` brings such a node back.)"""
    p = project("train.steps=40", "train.log_every=5", "checkpoint.every=5")
    p("up", "-d")
    run_dir = p.run_dir()
    wait_for(lambda: any(s >= 10 for s in logged_steps(run_dir)), 600, "step 10")
    node1 = p.container("cpu-node1")
    pid = int(docker("inspect", "-f", "{{.State.Pid}}", node1).stdout)
    assert pid > 1
    saved = latest_state(run_dir)["step"]  # the newest complete checkpoint before the kill (step 10's may be saving)
    os.kill(pid, signal.SIGKILL)
    p.wait_done()
    assert state(node1)[2] >= 1, "the killed node was not restarted"
    s = summary(run_dir)
    assert s["world_size"] == 2 and s["steps"] == 40 and s["ranks_in_sync"], s
    assert logged_steps(run_dir) == list(range(5, 41, 5))  # every logged step once, in order
    assert latest_state(run_dir)["step"] == 40
    # It resumed from the newest checkpoint there was at the kill (or a later one), not from the start.
    text = "".join(docker("logs", c, check=False).stdout + docker("logs", c, check=False).stderr
                   for c in (p.container("cpu-node0"), node1))
    resumed = [int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", text)]
    assert saved >= 5 and resumed and all(step >= saved and step % 5 == 0 for step in resumed), (saved, resumed)
