"""A user's own task: examples/regression.py through the launcher (stop, bitwise resume), and every way a
task file can be wrong, each one line and exit 2 before anything is written."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, ROOT, assert_same_training, clean_env, latest_state, metrics, summary
from tests.procs import finish, stop_at
from train.config import ConfigError
from train.task import first_tensor

# The example with dropout (training draws from torch's RNG in the rank) and a loader worker per rank that
# unpickles the user's data set and draws its input noise: a resume that lost either would differ.
EXAMPLE = ["--config", "examples/regression.yaml", "task.dropout=0.1", "data.num_workers=1", "train.steps=200",
           "train.log_every=5", "train.eval_every=100", "checkpoint.every=0", "log.wandb.mode=disabled",
           "log.report=false"]


def launch_example(run_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [PY, "-m", "train.launch", "--nproc-per-node=2", "--", *EXAMPLE, f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def test_the_example_task_stops_on_sigterm_and_resumes_bitwise_through_the_launcher(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    rc, out, err = finish(launch_example(ref))
    assert rc == 0, err[-3000:]
    s = summary(ref)
    assert s["world_size"] == 2 and s["ranks_in_sync"] and {"eval_loss", "eval_mae"} <= s.keys(), s
    first = next(m["loss"] for m in metrics(ref) if "loss" in m)
    assert s["eval_loss"] < 0.5 * first, (first, s)  # it learns

    stop_at(launch_example(run), run, 20)  # 180 steps before its end: the stop lands first
    stopped = latest_state(run)["step"]
    assert 20 <= stopped < 200, stopped
    rc, out, err = finish(launch_example(run))
    assert rc == 0, err[-3000:]

    assert latest_state(ref)["step"] == 200
    assert_same_training(ref, run)
    assert [m for m in metrics(run) if "eval_mae" in m][-1]["eval_mae"] == summary(ref)["eval_mae"]


GOOD = """
from dataclasses import dataclass
import torch
from torch.utils.data import TensorDataset
from train.task import Task

class T(Task):
    @dataclass
    class Config:
        width: int = 4

    def datasets(self):
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x.sum(1, keepdim=True)), TensorDataset(x[:8], x[:8].sum(1, keepdim=True))

    def model(self):
        return torch.nn.Linear(4, 1)

    def loss(self, model, batch):
        x, y = batch
        return LOSS
"""


def _task_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "my_task.py"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("case", ["no file", "no class", "not a task", "no loss", "import error", "no module",
                                  "bad form", "unknown key", "wrong type", "check", "loss not scalar",
                                  "model not a module"])
def test_a_wrong_task_is_one_line_exit_2_and_writes_nothing(tmp_path, case):
    good = GOOD.replace("LOSS", "torch.nn.functional.mse_loss(model(x), y)")
    name, extra = f"{tmp_path / 'my_task.py'}:T", []
    if case == "no file":
        name, expected = "nowhere/my_task.py:T", "task.name: nowhere/my_task.py does not exist"
    elif case == "no class":
        _task_file(tmp_path, good)
        name, expected = f"{tmp_path / 'my_task.py'}:Q", "my_task.py has no Q (it has T)"
    elif case == "not a task":
        _task_file(tmp_path, good + "\nclass Q:\n    pass\n")
        name, expected = f"{tmp_path / 'my_task.py'}:Q", "my_task.py:Q is not a subclass of train.task.Task"
    elif case == "no loss":
        _task_file(tmp_path, good.replace("def loss(", "def lose("))
        expected = "my_task.py:T does not define loss()"
    elif case == "import error":
        _task_file(tmp_path, good + "\nimport no_such_package_here\n")
        expected = "my_task.py:23: ModuleNotFoundError: No module named 'no_such_package_here'"
    elif case == "no module":
        name, expected = "no_such_package.tasks:T", "task.name: cannot import no_such_package.tasks"
    elif case == "bad form":
        name, expected = "my_task.py", "is not of the form path/to/file.py:ClassName or module:ClassName"
    elif case == "unknown key":
        _task_file(tmp_path, good)
        extra, expected = ["task.widht=3"], "unknown config key 'task.widht' (did you mean 'task.width'"
    elif case == "wrong type":
        _task_file(tmp_path, good)
        extra, expected = ["task.width=wide"], "task.width: expected int, got str 'wide'"
    elif case == "check":
        name, extra = "examples/regression.py:Regression", ["task.dropout=1.5"]
        expected = "task.dropout must be in [0, 1), got 1.5"
    elif case == "loss not scalar":
        _task_file(tmp_path, GOOD.replace("LOSS", "(model(x) - y) ** 2"))
        expected = "my_task.py:T: loss() must return a scalar tensor, got Tensor(8, 1)"
    else:
        _task_file(tmp_path, good.replace("return torch.nn.Linear(4, 1)", "return 'a model'"))
        expected = "model() must return a torch.nn.Module, got str"
    run_dir = tmp_path / "run"
    proc = subprocess.run([PY, "-m", "train", f"task.name={name}", *extra, f"run.dir={run_dir}", "train.steps=2",
                           "train.global_batch_size=8", "train.micro_batch_size=8", "log.wandb.mode=disabled",
                           "data.num_workers=0"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-3000:]
    assert lines[0].startswith("error: ")
    if case not in ("loss not scalar",):  # found at the first step: the run directory exists by then
        assert not run_dir.exists()


def test_a_mistake_in_a_task_file_names_its_line(tmp_path):
    _task_file(tmp_path, GOOD.replace("LOSS", "0") + "\nx = 1 / 0\n")
    proc = subprocess.run([PY, "-m", "train", "--check", f"task.name={tmp_path / 'my_task.py'}:T"], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    line = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in line, line
    assert f"failed at {tmp_path / 'my_task.py'}:23: ZeroDivisionError: division by zero" in line, line


NAMED = """
from dataclasses import dataclass
import torch
from torch.utils.data import Dataset
from train.task import Task

class Named(Dataset):
    \"\"\"Items (name, x, y): the default collate makes a batch's names a list of strings, its first element.\"\"\"
    def __init__(self, n):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return f"sample {i}", self.x[i], self.x[i].sum(0, keepdim=True)

class T(Task):
    @dataclass
    class Config:
        pass

    def datasets(self):
        return Named(64), Named(12)

    def model(self):
        return torch.nn.Linear(4, 1)

    def loss(self, model, batch):
        names, x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)
"""


def test_the_default_evaluation_counts_batches_whose_first_element_is_a_list_of_strings(tmp_path):
    """A task whose items start with a string (an id, a caption) and that keeps Task's eval_step: the
    evaluation ends, and averages its loss over the 12 samples."""
    path = _task_file(tmp_path, NAMED)
    run_dir = tmp_path / "run"
    proc = subprocess.run([PY, "-m", "train", f"task.name={path}:T", f"run.dir={run_dir}", "train.steps=2",
                           "train.eval_every=1", "train.global_batch_size=8", "train.micro_batch_size=8",
                           "train.log_every=1", "log.wandb.mode=disabled", "log.report=false", "data.num_workers=0"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [m for m in metrics(run_dir) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [1, 2], evals
    weights = latest_state(run_dir)["model"]  # step 2's, which its evaluation used
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(12))  # Named(12)
    per_sample = ((x @ weights["weight"].T + weights["bias"]) - x.sum(1, keepdim=True)).pow(2)
    assert evals[-1]["eval_loss"] == pytest.approx(per_sample.mean().item(), rel=1e-5)
    with pytest.raises(ConfigError, match="holds no tensor: .* define eval_step"):  # nothing to count by
        first_tensor([["a", "b"], {"ids": ["c", "d"]}])
