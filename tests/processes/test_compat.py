"""Checkpoints of earlier versions, written by their own code (tests/fixtures/previous_release.py), resume in
this one with bitwise the losses and the state of an uninterrupted run of today's code."""
from __future__ import annotations

import subprocess

import pytest

from tests.conftest import (
    PY,
    RESNET,
    RNG_DRAWS,
    ROOT,
    assert_same_training,
    clean_env,
    copy_run,
    latest_state,
    run_train,
    train_losses,
)
from tests.fixtures.previous_release import (
    FIXTURES,
    OLD,
    REGRESSION,
    RELEASE,
    STEPS,
    have,
    write_old_run,
    write_run,
)
from train.checkpoint import dcp_io

LATER = f"train.steps={STEPS + 2}"


def assert_same_first_steps(ref, run, written_by: str) -> None:
    """The earlier version's steps (logged in the run) are those of today's uninterrupted run: without that
    the resume cannot be bitwise, whatever the checkpoint holds."""
    ref_losses, losses = train_losses(ref), train_losses(run)
    first = [(s, losses[s], ref_losses[s]) for s in range(1, STEPS + 1)]
    assert all(a == b for _, a, b in first), (
        f"today's code does not compute {written_by}'s first {STEPS} steps bit for bit here (step, theirs, "
        f"today's: {first}): a change of the numbers (or, for a committed fixture, another kind of CPU): see "
        f"tests/fixtures/previous_release.py")


def test_the_previous_releases_checkpoint_resumes_bitwise(tmp_path):
    """RELEASE's 2-rank run, stopped at step 2, continued by today's code: every logged loss (its steps 1-2
    included) and the final weights and optimizer state are those of today's uninterrupted run. The run is
    written by RELEASE's own code here where the clone holds it (its numbers are this CPU's, as today's run's
    are); a clone without it uses the committed one (tests/fixtures/<RELEASE>/), whose numbers are those of the
    CPU it was written on."""
    run = tmp_path / "run"
    if have(RELEASE):
        write_run(RELEASE, run, REGRESSION, nproc=2)
    else:
        copy_run(FIXTURES / RELEASE, run)
    proc = run_train(run, *REGRESSION, LATER, nproc=2, tiny=False)
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'} at step 2" in proc.stdout + proc.stderr
    run_train(tmp_path / "ref", *REGRESSION, LATER, nproc=2, tiny=False)
    assert list(train_losses(run)) == [1, 2, 3, 4]
    assert_same_first_steps(tmp_path / "ref", run, RELEASE)
    assert_same_training(tmp_path / "ref", run)


@pytest.mark.skipif(not have(OLD), reason=f"this clone lacks commit {OLD}, whose code writes the checkpoint "
                    "(too large to commit): `git fetch --unshallow` runs it")
def test_a_checkpoint_of_42fd791_converts_and_resumes_bitwise(tmp_path):
    """42fd791's format-1 checkpoint (keys data.*, model.*) written by its own code converts without its
    model being built, with the config in today's keys, and today's code continues it bitwise: the weights,
    the optimizer's momentum, the data position and the RNG states (the model draws: RNG_DRAWS) all carried."""
    old = tmp_path / "old"
    write_old_run(old)
    proc = subprocess.run([PY, "-m", "train.checkpoint", "--convert", str(old)], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "converted 1 checkpoint(s)" in proc.stdout, proc.stderr
    proc = run_train(old, *RESNET, "task.augment=false", LATER, entry=RNG_DRAWS, tiny=False)  # OLD's model
    assert f"resumed from {old / 'checkpoints' / 'step_00000002'} at step 2" in proc.stdout + proc.stderr
    ref = tmp_path / "ref"
    run_train(ref, *RESNET, "task.augment=false", LATER, entry=RNG_DRAWS, tiny=False)
    assert list(train_losses(old)) == [1, 2, 3, 4]
    assert_same_first_steps(ref, old, OLD)
    assert_same_training(ref, old)
    converted = dcp_io.read_state(old / "checkpoints" / "step_00000002", keys=())
    assert converted["config"]["task"] == latest_state(ref)["config"]["task"]  # OLD_KEYS maps every key
    assert converted["config"]["dist"]["sync_bn"] is False
    assert (old / "checkpoints" / "step_00000002.pt").exists()  # the original stays


def test_a_checkpoint_that_names_code_is_refused_in_one_line_and_nothing_it_names_runs(tmp_path):
    """--convert loads weights_only: a format-1 file naming a module's class (importable here, and writing a
    file when imported) is refused in one line (exit 2), the module never imported, nothing written."""
    (tmp_path / "planted.py").write_text("import pathlib\npathlib.Path(__file__).with_name('imported').touch()\n"
                                         "class Thing:\n    pass\n")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    make = (f"import sys, json, zlib, torch; sys.path.insert(0, {str(tmp_path)!r}); import planted\n"
            f"p = {str(folder / 'step_00000002.pt')!r}; torch.save({{'format': 1, 'x': planted.Thing()}}, p)\n"
            "raw = open(p, 'rb').read()\n"
            "open(p[:-3] + '.json', 'w').write(json.dumps({'crc32': zlib.crc32(raw), 'bytes': len(raw)}))\n")
    subprocess.run([PY, "-c", make], check=True, timeout=60)
    (tmp_path / "imported").unlink()
    proc = subprocess.run([PY, "-m", "train.checkpoint", "--convert", str(tmp_path / "run")], cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {folder / 'step_00000002.pt'} does not load as plain tensors and values (it names planted.Thing, "
        "which is no tensor or plain value): finish its run with the version of this project that wrote it\n")
    assert not (tmp_path / "imported").exists()
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002.json", "step_00000002.pt"]
