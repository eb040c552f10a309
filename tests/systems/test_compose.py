"""docker compose (docker-compose.yml), the project's image on several nodes. Without an engine: the file
against the compose spec, Compose v1's and v2's own reading of it, its topology, and the make targets. With a
real Docker engine (tests/engine.py builds the image): the cpu profile's two nodes started in either order,
and one of them killed. The image itself: tests/systems/test_image.py; `docker run`: tests/systems/test_container.py."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests import engine
from tests.conftest import PACED, ROOT, latest_state, summary
from tests.engine import SMALL_TASK, TASKS_IN_IMAGE, docker, logs, state, volume_path
from tests.image_build import IMAGE_VERSION as VERSION
from tests.multinode import required, tool
from tests.procs import logged_steps, wait_for
from tests.quick.test_compose import COMPOSE, _compose, _profile

image = engine.image  # the engine's fixture: the image built by make docker-build


TASK_OVERRIDE = ROOT / "tasks" / "compose.yml"  # docker compose with a task of the user's (docs/containers.md)


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


@pytest.mark.parametrize("path", [COMPOSE, TASK_OVERRIDE], ids=lambda p: p.name)
def test_compose_file_validates_against_the_compose_spec(path):
    proc = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
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


def test_the_task_override_mounts_tasks_on_every_node_and_changes_nothing_else():
    """tasks/compose.yml over docker-compose.yml, as Compose itself merges them: every node (gpu and cpu) gets
    tasks/ read-only at the image's tasks/ and the same command, tasks/my.yaml; the rest is the base file's."""
    def config(*files: Path) -> dict:
        cli = [*compose_cli(), "-p", "ddp-template", *(a for f in files for a in ("-f", str(f)))]
        proc = subprocess.run([*cli, "--profile", "cpu", "--profile", "gpu", "config"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "TASKS"})
        assert proc.returncode == 0, proc.stderr
        return yaml.safe_load(proc.stdout)["services"]

    base, merged = config(COMPOSE), config(COMPOSE, TASK_OVERRIDE)
    assert set(yaml.safe_load(TASK_OVERRIDE.read_text())["services"]) == set(base), "a node left without the task"
    for name, s in merged.items():
        assert s["command"] == ["--config", "tasks/my.yaml", "run.dir=/runs/compose"], (name, s["command"])
        assert f"{ROOT / 'tasks'}:{TASKS_IN_IMAGE}:ro" in s["volumes"], (name, s["volumes"])
        assert set(s["volumes"]) - set(base[name]["volumes"]) == {f"{ROOT / 'tasks'}:{TASKS_IN_IMAGE}:ro"}, name
        assert {k: v for k, v in s.items() if k not in ("command", "volumes")} == \
               {k: v for k, v in base[name].items() if k not in ("command", "volumes")}, name


def my_config(*overrides: str) -> dict:
    """configs/default.yaml with key=value overrides applied: what a user writes into tasks/my.yaml."""
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    for o in overrides:
        key, _, value = o.partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return cfg


class Project:
    """The compose file's cpu profile as a project of its own, with a user's task as tasks/compose.yml (the
    override docs/containers.md shows) brings it: a tasks folder holding tests/small_task.py and my.yaml (the
    nodes' config, configs/default.yaml + a short training), mounted read-only on every node."""

    def __init__(self, tmp: Path, tag: str, *overrides: str):
        self.name = f"ddp-test-{uuid.uuid4().hex[:8]}"
        self.tasks, self.overrides = tmp / "tasks", overrides
        tasks = self.tasks
        tasks.mkdir()
        shutil.copy(ROOT / "tests" / "small_task.py", tasks)
        (tasks / "my.yaml").write_text(yaml.safe_dump(my_config(*overrides)))
        self.cli = [*compose_cli(), "-p", self.name, "-f", str(COMPOSE), "-f", str(TASK_OVERRIDE), "--profile", "cpu"]
        self.env = {**os.environ, "IMAGE": tag, "TASKS": str(tasks)}

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
            wait_for(done, timeout, "both nodes to finish", every=0.5)
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
        made.append(Project(tmp_path, image, *SMALL_TASK, *overrides))
        return made[-1]

    yield new
    for p in made:
        p.down()


def test_compose_cpu_nodes_started_last_node_first_train_to_the_end_then_a_usage_error_ends_them_once(project):
    """Node 1 first; the rendezvous host, node 0, tens of seconds later: node 1 waits for it. Then the same nodes
    started again on a config with a bad key: each ends once (USAGE_EXIT_CODE=0, which restart: on-failure does
    not restart), neither waits at the rendezvous, and the error's line is its log's last."""
    p = project("train.steps=12")
    p("up", "-d", "cpu-node1")
    # Node 1 says it waits for the rendezvous host (then polls it every second): start node 0 only then.
    wait_for(lambda: "waiting up to" in logs(p.container("cpu-node1")), 300, "node 1 waiting for node 0",
             every=0.5)
    time.sleep(3)
    assert state(p.container("cpu-node1"))[0] == "running", logs(p.container("cpu-node1"))
    p("up", "-d", "cpu-node0")
    p.wait_done()
    s = summary(p.run_dir())
    assert s["world_size"] == 2 and s["steps"] == 12 and s["ranks_in_sync"], s

    # A usage error: the same containers (compose starts them again), the task's my.yaml with an unknown key.
    nodes = {n: p.container(n) for n in _profile("cpu")}
    assert all(state(c) == ("exited", 0, 0) for c in nodes.values()), {n: state(c) for n, c in nodes.items()}
    started = {n: docker("inspect", "-f", "{{.State.StartedAt}}", c).stdout for n, c in nodes.items()}
    p.tasks.joinpath("my.yaml").write_text(yaml.safe_dump(my_config(*p.overrides, "train.no_such_key=1")))
    p("up", "-d")

    def ended_again() -> bool:
        return all(docker("inspect", "-f", "{{.State.StartedAt}}", c).stdout != started[n]
                   and state(c)[0] != "running" for n, c in nodes.items())

    wait_for(ended_again, 120, "both nodes to start and end", every=0.5)
    time.sleep(5)  # on-failure restarts a failed container after 0.1 s, and the usage error takes about 1.5 s
    for name, c in nodes.items():
        assert state(c) == ("exited", 0, 0), (name, state(c), logs(c))
        proc = docker("logs", "--tail", "1", c)
        last = (proc.stdout + proc.stderr).strip()
        assert last.startswith("error: unknown config key 'train.no_such_key'") and last.endswith(
            "; exit 0 in place of 2 (USAGE_EXIT_CODE=0): not restarted"), (name, last)


def test_compose_a_killed_node_comes_back_and_the_job_finishes(project):
    """SIGKILL to one node's container process (a crash, an OOM kill): restart: on-failure restarts it, it
    rejoins, and the job resumes from the latest checkpoint and ends. (`docker kill` itself counts as a
    manual stop, which no restart policy undoes: `docker compose start` brings such a node back.)"""
    p = project(*PACED, "train.steps=40", "train.log_every=5", "checkpoint.every=5")
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
