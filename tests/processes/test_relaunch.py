"""A relaunch says what it does with every change (train/relaunch.py): applied and named in the log, the new data
from its beginning, or refused in one line with nothing written, on a run that is finished or not."""

from __future__ import annotations

import subprocess

from tests.conftest import PY, ROOT, TINY, clean_env, copy_run, metrics, run_train, train_losses


def _files(run_dir):
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()
            and "logs" not in p.parts}


def test_a_finished_run_relaunched_with_a_change_that_needs_training_is_refused_by_name(finished_run, tmp_path):
    """Not "already complete" (exit 0, nothing trained): the change is named with the fix, exit 2, and nothing of
    the run changes. Another task (a copy of its file, as docs/first-hour.md's "your own model" step makes) too."""
    run = copy_run(finished_run, tmp_path / "run")
    before = _files(run)
    proc = run_train(run, "task.train_samples=128", expect=2)
    assert proc.stderr.strip() == (f"error: run {run} is finished at step 6: task.train_samples 256 -> 128 would need "
                                   f"training and no step is left; train more steps (train.steps above 6) or start a "
                                   f"new run with another run.name"), proc.stderr
    mine = tmp_path / "my_task.py"
    mine.write_text((ROOT / "tests" / "small_task.py").read_text())
    proc = run_train(run, f"task.name={mine}:SmallImages", expect=2)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: relaunch of {run} with task.name ") and f"-> {mine}:SmallImages refused: " \
        "another task; start a new run with another run.name" in last, proc.stderr
    assert _files(run) == before
    # A change that needs no training: nothing to do, and said
    proc = run_train(run, "train.log_every=3")
    assert "already complete at step 6; nothing to do, train.log_every 1 -> 3 changes nothing here" in proc.stdout
    assert _files(run) == before


def test_python_m_train_check_refuses_what_the_relaunch_would(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    proc = subprocess.run([PY, "-m", "train", "--check", "--config", "configs/default.yaml", *TINY, f"run.dir={run}",
                           "task.num_classes=4", "train.steps=8"], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: relaunch of {run} with task.num_classes 10 -> 4 refused; start a new run with another run.name, or "
        f"relaunch with the run's own value (task.num_classes=10)"), proc.stderr


def test_a_relaunch_refused_by_the_trainer_writes_nothing(finished_run, tmp_path):
    """python -m train checks against the checkpoint it resumes (the run's config.yaml gone, as a copy may lose it):
    the refused key is named before any tensor is read; no checkpoint, metric or record is written."""
    run = copy_run(finished_run, tmp_path / "run")
    (run / "config.yaml").unlink()
    before = _files(run)
    proc = run_train(run, "train.steps=8", "seed=1", expect=2)
    assert proc.stderr.strip() == (f"error: relaunch of {run} with seed 0 -> 1 refused: it orders the rest of the "
                                   f"epoch; start a new run with another run.name, or relaunch with the run's own "
                                   f"value (seed=0)"), proc.stderr
    assert _files(run) == before


def test_applied_changes_are_named_and_new_data_starts_at_its_beginning(finished_run, tmp_path):
    """A relaunch with more steps: an applied change and the schedule's are logged; other data (fewer samples)
    starts at its beginning, epoch 0; resume=PATH onto other data (a new run) too."""
    run = copy_run(finished_run, tmp_path / "run")
    proc = run_train(run, "train.steps=8", "train.log_every=2", "task.train_samples=128", "checkpoint.every=2",
                     "checkpoint.keep=3")  # as finished_run was made
    assert "relaunch with train.log_every 1 -> 2: applied from step 6" in proc.stdout, proc.stdout
    assert ("the data changed (task.train_samples 256 -> 128): training goes on from step 6 at the new data's "
            "beginning") in proc.stdout, proc.stdout
    assert [m["epoch"] for m in metrics(run) if m.get("step") == 8 and "loss" in m] == [0]  # 16 samples into 128
    assert sorted(train_losses(run)) == [1, 2, 3, 4, 5, 6, 8]
    branch = tmp_path / "branch"
    proc = run_train(branch, f"resume={finished_run}", "train.steps=8", "task.train_samples=128")
    assert ("the data changed (task.train_samples 256 -> 128): training goes on from step 6 at the new data's "
            "beginning") in proc.stdout, proc.stdout
    assert [m["epoch"] for m in metrics(branch) if m.get("step") == 8 and "loss" in m] == [0]


def test_the_launcher_and_train_submit_refuse_before_anything_starts_or_is_queued(finished_run, tmp_path):
    """The launcher's torchrun process and train.submit compare the run's config.yaml: no worker starts, no job is
    queued (a stand-in sbatch records whether it was called)."""
    run = copy_run(finished_run, tmp_path / "run")
    before = _files(run)
    logs = {p: p.read_bytes() for p in (run / "logs").glob("rank*.log")}  # a rank that started writes there
    says = (f"error: relaunch of {run} with task.num_classes 10 -> 4 refused; start a new run with another run.name, "
            f"or relaunch with the run's own value (task.num_classes=10)")
    args = ["--config", "configs/default.yaml", *TINY, f"run.dir={run}", "task.num_classes=4", "train.steps=8"]
    proc = subprocess.run([PY, "-m", "train.launch", "--nproc-per-node=1", "--", *args], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == says, proc.stderr
    assert {p: p.read_bytes() for p in (run / "logs").glob("rank*.log")} == logs  # no worker started
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("sbatch", "srun"):  # submitit looks for srun; sbatch writes where it was called
        (bin_dir / name).write_text(f"#!/bin/sh\ntouch {tmp_path / name}.called\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    proc = subprocess.run([PY, "-m", "train.submit", "--nodes", "1", "--gpus-per-node=0", "--cpus-per-task=1", "--",
                           *args], cwd=ROOT, env=clean_env(PATH=f"{bin_dir}:{clean_env()['PATH']}"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == says, proc.stderr
    assert not (tmp_path / "sbatch.called").exists()
    assert _files(run) == before
