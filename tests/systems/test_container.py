"""`docker run` with the project's image, on a real Docker engine (tests/engine.py builds it with `make
docker-build`): arguments reaching training, read-only as user 10001, `docker stop`/`docker start` resuming
bitwise, a user's task file, torch.compile building its kernels with the image's compiler (the longest of the
image's files: tests/conftest.py hands it out first). What the image holds: tests/systems/test_image.py; compose,
several nodes: tests/systems/test_compose.py."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from tests import engine
from tests.conftest import PACED, ROOT, assert_same_training, latest_state, summary
from tests.engine import RUN_FLAGS, SMALL_TASK, SMALL_TASK_MOUNT, docker, logs, state, volume_path
from tests.procs import logged_steps, wait_for

# The engine's fixtures: the image built by make docker-build, a fresh volume, containers removed afterwards
image, volume, containers = engine.image, engine.volume, engine.containers

SEGMENTED = [*SMALL_TASK, "train.steps=40", "train.log_every=5"]
# A stop lands mid-run: steps of 0.15 s (a sleep, which changes no number: the uninterrupted run needs none)
PACED_SEGMENTED = [*SEGMENTED, *PACED]


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
        docker("run", "--rm", *RUN_FLAGS, *SMALL_TASK_MOUNT, "-v", f"{name}:/runs", image, "--nproc-per-node", "2",
               "--", "--config", "configs/default.yaml", *SEGMENTED, "run.dir=/runs/r", timeout=900)
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
    docker("run", "-d", "--name", name, *RUN_FLAGS, *SMALL_TASK_MOUNT, "--stop-timeout", "90", "-e", "STOP_TIMEOUT=60",
           "-v", f"{volume}:/runs", image, "--nproc-per-node", "2", "--", "--config", "configs/default.yaml",
           *PACED_SEGMENTED, "run.dir=/runs/r")
    wait_for(lambda: state(name)[0] != "running" or any(s >= 10 for s in logged_steps(run_dir)), 600, "step 10",
             every=0.2)
    assert state(name)[0] == "running", logs(name)
    docker("stop", name, timeout=200)
    status, code, _ = state(name)
    assert (status, code) == ("exited", 75), logs(name)
    stopped = latest_state(run_dir)["step"]
    assert json.loads((run_dir / "STOPPED").read_text())["step"] == stopped and 10 <= stopped < 40
    assert "stopped on SIGTERM" in logs(name)

    docker("start", name)
    wait_for(lambda: state(name)[0] == "exited", 600, "the resumed run to end", every=0.5)
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


def _tasks_in(tag: str) -> list[str]:
    """What the image holds in its tasks/ folder."""
    probe = "import os; print(*sorted(os.listdir('tasks')))"
    return docker("run", "--rm", *RUN_FLAGS, "--entrypoint", "python", tag, "-c", probe, timeout=300).stdout.split()


def test_an_image_built_from_the_template_trains_the_task_it_copies(image, volume, tmp_path):
    """tasks/Dockerfile as docs/containers.md builds it (`docker build -t my-task:1 tasks`): a tasks folder with a
    task (examples/regression.py as my_task.py) and its config, one layer on the template's image; its CMD trains
    tasks/my.yaml, the data set unpickled by a loader worker per rank. The template's own image has the project's
    tasks/ (make docker-build copies it), the build files left out by .dockerignore in either."""
    assert _tasks_in(image) == ["README.md"]
    tasks = tmp_path / "tasks"
    shutil.copytree(ROOT / "tasks", tasks)
    shutil.copy(ROOT / "examples" / "regression.py", tasks / "my_task.py")
    cfg = yaml.safe_load((ROOT / "examples" / "regression.yaml").read_text())
    cfg["task"]["name"] = "tasks/my_task.py:Regression"
    cfg["train"].update(steps=4, log_every=1)
    cfg.update(run={"dir": "/runs/mine"}, log={"wandb": {"mode": "disabled"}, "report": False})
    (tasks / "my.yaml").write_text(yaml.safe_dump(cfg))
    tag = f"ddp-test-my-task:{uuid.uuid4().hex[:8]}"
    try:
        docker("build", "-q", "--build-arg", f"BASE={image}", "-t", tag, str(tasks), timeout=300)
        assert _tasks_in(tag) == ["README.md", "my.yaml", "my_task.py"]
        docker("run", "--rm", *RUN_FLAGS, "-e", "NPROC_PER_NODE=2", "-v", f"{volume}:/runs", tag, timeout=600)
    finally:
        docker("rmi", "-f", tag, check=False)
    s = summary(volume_path(volume) / "mine")
    assert s["steps"] == 4 and s["world_size"] == 2 and s["ranks_in_sync"], s


# The image's language model at its smallest (34k parameters, windows of 32 tokens): half the kernels and half the
# compile time of the ResNet (40 s of CPU against 78 s here).
NANO_GPT = ["--config", "configs/gpt.yaml", "task.model=nano", "task.seq_len=32", "task.train_tokens=20000",
            "task.eval_tokens=2048", "data.num_workers=0", "train.global_batch_size=8", "train.micro_batch_size=8",
            "train.eval_every=0", "checkpoint.every=0", "log.wandb.mode=disabled", "log.report=false"]


def test_torch_compile_in_the_image_on_cpu(image, volume):
    """train.compile=true: inductor's CPU backend compiles C++ with the image's compiler, read-only root."""
    docker("run", "--rm", *RUN_FLAGS, "-v", f"{volume}:/runs", "-e", "TORCHINDUCTOR_CACHE_DIR=/runs/c-inductor",
           image, "--nproc-per-node", "1", "--", *NANO_GPT, "train.steps=3", "train.compile=true", "run.dir=/runs/c",
           timeout=900)
    run_dir = volume_path(volume) / "c"
    assert summary(run_dir)["steps"] == 3
    # Code was compiled: inductor's C++ kernels, built by the image's compiler, are in its cache.
    built = list((volume_path(volume) / "c-inductor").rglob("*.so"))
    assert built, sorted(p.name for p in (volume_path(volume) / "c-inductor").rglob("*"))[:20]
