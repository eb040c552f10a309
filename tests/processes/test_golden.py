"""Golden numbers: the first losses and evaluations of the built-in ResNet-18 (conftest.RESNET) and of the tiny
language model on 2 CPU ranks, compared with tests/golden.json to a relative 1e-4 (RTOL). A change that moves any
of them (the initial weights, the data or its augmentation, the sampler, the optimizer, the loss, the averaging
over ranks) fails here, so that numbers move only on purpose. When they are meant to move, write the file again
and commit it with the change:

    GOLDEN_UPDATE=1 .venv/bin/python -m pytest tests/processes/test_golden.py

Both runs use the same CPU kernels on every x86-64 machine (conftest.SAME_KERNELS): with each machine's own vector
kernels, the ResNet's losses on two machines were 2e-2 apart at step 6. RTOL rather than bits leaves room for
what those settings do not fix; a change of the training moves the numbers by far more (a GPT init of other draws:
1e-2 at step 1). Another torch version can move them too: the file names the torch and the kernels it was made
with. Other architectures (ARM) have kernels of their own: the test says so and is skipped there."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, SAME_KERNELS, clean_env, metrics, run_train
from tests.processes.test_lm_train import run_lm

GOLDEN = ROOT / "tests" / "golden.json"
RTOL = 1e-4
# The ResNet: conftest's finished_resnet18, RESNET on 2 ranks, evaluated (and saved: which changes no number, as
# the last test shows) every 2 steps. The language model: test_lm_train's (windows of 32 tokens, 2 ranks x 2
# micro-steps of 4) in fp32, 4 layers of width 128.
LM = ["task.model=tiny", "train.precision=fp32", "train.steps=6", "train.log_every=1", "train.eval_every=3"]


def numbers(run_dir: Path) -> dict:
    """{"loss": {step: loss}, "eval": {step: {metric: value}}} of a run's metrics.jsonl."""
    out: dict = {"loss": {}, "eval": {}}
    for m in metrics(run_dir):
        if "loss" in m:
            out["loss"][str(m["step"])] = m["loss"]
        evals = {k: v for k, v in m.items() if k.startswith("eval_")}
        if evals:
            out["eval"][str(m["step"])] = evals
    return out


def flat(numbers: dict, prefix: str = "") -> dict:
    """{"loss/3": ..., "eval/4/eval_loss": ...}: one level, as pytest.approx compares mappings."""
    out = {}
    for k, v in numbers.items():
        out |= flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


@pytest.fixture(scope="module")
def golden_runs(tmp_path_factory, finished_resnet18) -> dict[str, Path]:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"tests/golden.json holds x86-64's numbers; this machine is {platform.machine()}")
    root = tmp_path_factory.mktemp("golden")
    run_lm(root / "lm", *LM, env=clean_env(**SAME_KERNELS))
    return {"resnet": finished_resnet18, "lm": root / "lm"}


def test_the_first_losses_of_the_resnet_and_the_language_model_are_the_golden_ones(golden_runs):
    got = {name: numbers(run) for name, run in golden_runs.items()}
    if os.environ.get("GOLDEN_UPDATE") == "1":
        GOLDEN.write_text(json.dumps({"torch": torch.__version__, "kernels": SAME_KERNELS, **got}, indent=1) + "\n")
        print(f"wrote {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())
    for name in got:
        assert len(got[name]["loss"]) == 6 and got[name]["eval"], got[name]
        assert flat(got[name]) == pytest.approx(flat(golden[name]), rel=RTOL), (
            f"the {name}'s numbers are not the golden ones (torch {torch.__version__}; the file's: {golden['torch']}, "
            f"kernels {golden.get('kernels')}). "
            f"If the change meant to move them: GOLDEN_UPDATE=1 pytest tests/processes/test_golden.py, and commit "
            f"tests/golden.json.\nnow:    {got[name]}\ngolden: {golden[name]}")


def test_an_evaluation_without_a_save_before_it_is_the_one_after_a_save(tmp_path, finished_two_ranks):
    """finished_two_ranks (TINY, 2 ranks) saves at steps 2 and 4, each before the evaluation of its step; a save
    gives every rank rank 0's BatchNorm statistics. The same run without those saves (only at the end) must
    still evaluate steps 2 and 4 with rank 0's statistics on both ranks (evaluate() syncs them), and give the
    same numbers; the saves change no loss."""
    run_train(tmp_path, "checkpoint.every=0", "train.eval_every=2", nproc=2)
    plain, saved = numbers(tmp_path), numbers(finished_two_ranks)
    assert plain["loss"] == saved["loss"]
    assert sorted(plain["eval"]) == sorted(saved["eval"]) == ["2", "4", "6"]
    assert plain["eval"] == saved["eval"]
