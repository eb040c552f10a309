"""Data: the built-in set, CIFAR-10's python batches and ImageFolder from a local path, and sampling."""
from __future__ import annotations

import pickle
import subprocess

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import PY, ROOT, clean_env, copy_run, run_train, summary, train_cmd
from tests.procs import finish
from tests.quick.test_data import _bad_images, write_imagefolder
from train import config
from train.parallel import data
from train.tasks import image


def write_cifar(root, per_batch: int = 40):
    """Small files in the exact format of cifar-10-batches-py (pickled dicts with bytes keys)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [*image.CIFAR_TRAIN, image.CIFAR_TEST]:
        labels = [int(i % 10) for i in range(per_batch)]
        images = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        images[:, :1024] = np.array(labels, dtype=np.uint8)[:, None] * 25  # red channel encodes the class
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": images,
                 b"filenames": [f"{name}_{i}.png".encode() for i in range(per_batch)]}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    return folder


def test_augmentation_depends_on_seed_epoch_and_index_only():
    cfg = config.load("configs/default.yaml", ["task.image_size=16", "task.train_samples=64"])
    train_set = data.SeededSamples(cfg.task_class(cfg.task, cfg.seed).datasets()[0], cfg.seed)
    x1, _ = train_set[(5, 0)]
    state = torch.get_rng_state()
    assert torch.equal(x1, train_set[(5, 0)][0]) and torch.equal(state, torch.get_rng_state())  # no draw leaks
    assert torch.equal(x1, train_set[(5, 0)][0])  # same key, same pixels
    assert not all(torch.equal(train_set[(i, 0)][0], train_set[(i, 1)][0]) for i in range(8))  # epochs differ

    def first_batches(workers):
        sampler = data.ShardSampler(train_set, 1, 0, seed=0)
        loader = DataLoader(train_set, batch_size=8, sampler=sampler, num_workers=workers)
        return [x for x, _ in loader][:4]

    for a, b in zip(first_batches(0), first_batches(2), strict=True):
        assert torch.equal(a, b)  # worker count does not change the data


def test_a_relaunch_with_another_seed_is_refused_and_changes_nothing(finished_run, tmp_path):
    """The seed orders each epoch: a relaunch with another one would read the rest of the epoch in another
    permutation (samples twice, others never). One line naming the checkpoint's seed, exit 2, before any
    step; the checkpoints and the metrics stay as they were."""
    run = copy_run(finished_run, tmp_path / "run")  # stopped mid-epoch: 6 steps of 16 in an epoch
    files = lambda: {p for p in [*(run / "checkpoints").rglob("*"), run / "metrics.jsonl"] if p.is_file()}  # noqa: E731
    kept = {p: p.read_bytes() for p in files()}
    proc = run_train(run, "seed=1", "train.steps=8", "checkpoint.every=2", "checkpoint.keep=3", expect=2)
    lines = proc.stderr.strip().splitlines()
    # The relaunch rule's words now (train/relaunch.py), found before any tensor is read; they were the data
    # stream's ("trained with seed=0 and this run has seed=1 ... set seed=0 to continue it"), which stays for a
    # checkpoint without a config
    assert lines == [f"error: relaunch of {run} with seed 0 -> 1 refused: it orders the rest of the epoch; start a "
                     f"new run with another run.name, or relaunch with the run's own value (seed=0)"], proc.stderr
    assert {p: p.read_bytes() for p in kept} == kept
    assert files() == kept.keys()  # none added, none moved aside


def test_trains_on_cifar10_python_batches(tmp_path):
    folder = write_cifar(tmp_path / "data")
    run_train(tmp_path / "run", "task.data=cifar10", f"task.path={folder}", "task.image_size=32", nproc=2)
    s = summary(tmp_path / "run")
    assert s["steps"] == 6 and s["world_size"] == 2
    # the parent folder is accepted too, and reads the same batches (the reader the task calls, in this process)
    for split in ("train", "test"):
        parent, own = image.cifar10(str(tmp_path / "data"), split), image.cifar10(str(folder), split)
        assert all(torch.equal(a, b) for a, b in zip(parent, own, strict=True)) and len(own[0]) > 0


def test_trains_on_an_imagefolder(tmp_path):
    root = write_imagefolder(tmp_path / "imgs")
    run_train(tmp_path / "run", "task.data=imagefolder", f"task.path={root}", "train.global_batch_size=8",
              "train.micro_batch_size=4", "data.num_workers=1", nproc=2)
    assert summary(tmp_path / "run")["steps"] == 6


@pytest.mark.parametrize("case", ["missing", "no_batch", "garbage"])
def test_bad_cifar_path_is_one_line_naming_the_path(tmp_path, case):
    folder = tmp_path / "cifar-10-batches-py"
    if case != "missing":
        folder = write_cifar(tmp_path)
        if case == "no_batch":
            (folder / "data_batch_3").unlink()
        else:
            (folder / "data_batch_2").write_bytes(b"not a pickle")
    proc = run_train(tmp_path / "run", "task.data=cifar10", f"task.path={folder}", expect=2)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(folder) in err
    assert {"missing": "does not exist", "no_batch": "data_batch_3", "garbage": "data_batch_2"}[case] in err
    assert not (tmp_path / "run").exists()


def test_imagefolder_without_val_is_one_line(tmp_path):
    root = write_imagefolder(tmp_path / "imgs")
    for p in sorted((root / "val").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (root / "val").rmdir()
    proc = run_train(tmp_path / "run", "task.data=imagefolder", f"task.path={root}", expect=2)
    assert f"{root}/val does not exist" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("launcher", [False, True])
def test_training_on_an_image_that_does_not_read_stops_in_one_line(tmp_path, launcher):
    """The run reads a corrupt image at a step: exit 2 and the one line naming the file, not PIL's traceback. In the
    training process (python -m train, num_workers=0): a text file and a cut PNG among 24 images, 8 a step (the first
    epoch reads each one). Under the launcher, 2 ranks with a loader worker each, every training image a text file
    (as the issue had it; so each rank finds one at its first batch, before any all-reduce, as in test_collate.py):
    the launcher's verdict naming one, once (each rank's own line is in its log file). The images are as the user
    wrote them."""
    root = tmp_path / "imgs"
    text, cut = _bad_images(root)
    if launcher:
        for p in (root / "train").rglob("*.png"):
            p.write_text("not an image\n")
    before = {p: p.read_bytes() for p in root.rglob("*.png")}
    overrides = ["task.data=imagefolder", f"task.path={root}", "train.global_batch_size=8", "train.micro_batch_size=4",
                 "train.steps=3", f"data.num_workers={int(launcher)}"]
    says = {f"task.path: {path} is not a readable image (PIL: {why}): remove or replace it"
            for path, why in ((text, "cannot identify image file"), (cut, "image file is truncated"))}
    if launcher:
        says = {f"task.path: {p} is not a readable image (PIL: cannot identify image file): remove or replace it"
                for p in (root / "train").rglob("*.png")}
        cmd = [PY, "-m", "train.launch", "--nproc-per-node=2", "--", *train_cmd(tmp_path / "run", *overrides)[3:]]
        rc, out, err = finish(subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True, start_new_session=True), timeout=180)
        last = err.strip().splitlines()[-1]
        assert last.removeprefix("error: ").removesuffix(" (found by the workers; not retried)") in says, last
        said = [line for line in (out + err).splitlines() if "is not a readable image" in line]
        assert said == [last], err[-3000:]  # not by each rank as well
    else:
        proc = run_train(tmp_path / "run", *overrides, expect=None)
        rc, err = proc.returncode, proc.stderr
        assert err.count("\n") == 1 and err.removeprefix("error: ").strip() in says, err[-3000:]
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err and "DataLoader worker" not in err and "PIL" not in err.replace("(PIL: ", ""), \
        err[-3000:]
    assert {p: p.read_bytes() for p in root.rglob("*.png")} == before
