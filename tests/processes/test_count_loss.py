"""A step's loss on masked shards is the sum over its counted targets divided by their count over the whole step
(task.count(): all micro-batches, all ranks): 1, 2 and 4 gloo ranks and any micro-batch split train alike, to
float rounding (project issue 69). A step with no counted target on any rank moves no weight, said once. The
conversations are packed (task.pack): a resume at the same world size is bitwise, at another the same windows in the
same order (the losses to float rounding); the log shows the padding share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import assert_same_state, latest_state, metrics, summary, train_losses
from tests.processes.test_lm_train import run_lm
from train.checkpoint.dcp_io import read_state
from train.tasks import shards

SEQ = 16  # tokens a window: a conversation of L tokens has ceil((L - 1) / 16) windows, the last padded
# fp32, the nano GPT, a global batch of 4 windows, 4 steps; a loss logged each step
COUNTED = [f"task.seq_len={SEQ}", "task.model=nano", "train.global_batch_size=4", "train.precision=fp32",
           "train.steps=4", "train.log_every=1", "optim.warmup_steps=1", "checkpoint.every=2", "checkpoint.keep=2"]
# (ranks, micro-batch size, dist.strategy): 1 to 4 passes a rank; FSDP's reduce-scatter (on 4 ranks, a pass each)
# averages as DDP's all-reduce (on 2, two passes each) does. One rank in 2 passes of 2 is the 1-rank resume's
# (test_packed_windows_resume...: its steps 3 and 4 against the 2-rank run's losses).
SPLITS = [(1, 4, "ddp"), (1, 1, "ddp"), (2, 1, "ddp"), (4, 1, "fsdp")]
RTOL = 1e-5  # fp32 rounding: the sums run in another order
# The weights: to RTOL of the largest (layer norms' ~1). Attention's key bias has an exactly zero gradient (softmax
# ignores a shift common to all keys): AdamW normalizes its rounding noise into updates of ~1e-6 that differ from
# split to split (measured: 2.8e-6 at most, on values of the same size); every other weight agrees to 1e-5 relative.
ATOL = 1e-5


def write_chats(folder: Path, conversations: int, seed: int, counted: bool = True) -> Path:
    """Masked shards (train and val) of conversations of 4 to 40 tokens whose assistant part (the tail, counted in
    the loss) is 1 token in some and nearly all of them in others; `counted`=False: the training shard counts no
    target at all (its evaluation shard still does)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", conversations), ("val", 8)):
        toks, mask = [], []
        for _ in range(n):
            length = int(rng.integers(4, 41))
            user = int(rng.choice([length - 1, length // 2, 1]))  # assistant: 1 token, half of them, all but one
            m = np.zeros(length, np.uint8)
            m[0] |= shards.STARTS
            if counted or split == "val":
                m[user:] |= shards.COUNTS
            toks.append(rng.integers(0, 256, length).astype(np.uint16))
            mask.append(m)
        shards.write_shard(folder / f"chat_{split}_000000.bin", np.concatenate(toks), "llmc")
        np.concatenate(mask).tofile(folder / f"chat_{split}_000000.mask")
    return folder


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory) -> dict[tuple[int, int, str], Path]:
    root = tmp_path_factory.mktemp("count")
    data = write_chats(root / "data", 24, seed=69)
    runs = {}
    for nproc, micro, strategy in SPLITS:
        run = runs[nproc, micro, strategy] = root / f"r{nproc}m{micro}{strategy}"
        run_lm(run, *COUNTED, f"task.data={data}", f"train.micro_batch_size={micro}", f"dist.strategy={strategy}",
               nproc=nproc)
    return runs


def test_ranks_and_micro_batch_splits_give_the_same_losses_and_weights(split_runs):
    losses = {split: train_losses(run) for split, run in split_runs.items()}
    reference = losses[SPLITS[0]]
    assert sorted(reference) == [1, 2, 3, 4], reference
    table = "\n".join(f"{n} rank(s), micro {m}, {d}: {[round(v, 6) for v in ls.values()]}"
                      for (n, m, d), ls in losses.items())
    for split, got in losses.items():
        assert got == pytest.approx(reference, rel=RTOL), f"{split} differs:\n{table}"
    evals = {split: summary(run)["eval_loss"] for split, run in split_runs.items()}
    assert all(v == pytest.approx(evals[SPLITS[0]], rel=RTOL) for v in evals.values()), evals
    weights = latest_state(split_runs[SPLITS[0]])["model"]
    for split, run in split_runs.items():
        for name, w in latest_state(run)["model"].items():
            torch.testing.assert_close(w, weights[name], rtol=RTOL, atol=ATOL, msg=f"{split}: {name}")


def test_packed_windows_resume_bitwise_at_the_same_world_size_and_alike_at_another(split_runs, tmp_path):
    """From the 2-rank run's step-2 checkpoint: on 2 ranks, the steps after it bitwise as the run's own; on 1 rank
    (micro-batches of 2), the same packed windows in the same order: the losses to float rounding."""
    source = split_runs[2, 1, "ddp"]
    data = next(a for a in summary_args(source) if a.startswith("task.data="))
    reference = train_losses(source)
    for nproc, micro in ((2, 1), (1, 2)):
        run = tmp_path / f"resumed{nproc}"
        run_lm(run, *COUNTED, data, f"train.micro_batch_size={micro}",
               f"resume={source / 'checkpoints' / 'step_00000002'}", nproc=nproc)
        got = train_losses(run)
        assert sorted(got) == [3, 4], got
        if nproc == 2:
            assert got == {k: reference[k] for k in (3, 4)}
            assert_same_state(latest_state(source), latest_state(run), "resumed on 2 ranks: ")
        else:
            assert got == pytest.approx({k: reference[k] for k in (3, 4)}, rel=RTOL), (nproc, got, reference)
    lines = [m for m in metrics(source) if "loss" in m]
    shares = [m["padding_share"] for m in lines]
    assert all(0 <= v < 0.3 for v in shares) and any(shares), shares  # packed: little padding, some
    assert all(m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * SEQ * (1 - m["padding_share"])) for m in lines)


def summary_args(run: Path) -> list[str]:
    """The task.data override a run of split_runs was launched with, from its config.yaml."""
    import yaml

    return [f"task.data={yaml.safe_load((run / 'config.yaml').read_text())['task']['data']}"]


def test_a_step_with_no_counted_target_moves_no_weight_and_says_so_once(tmp_path):
    data = write_chats(tmp_path / "data", 24, seed=70, counted=False)
    run = tmp_path / "run"
    proc = run_lm(run, *COUNTED, f"task.data={data}", "train.micro_batch_size=1", "checkpoint.every=1",
                  "checkpoint.keep=4", nproc=2)
    said = (proc.stdout + proc.stderr).count("no target counts in the loss on any rank")
    assert said == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = latest_state(run)
    assert state["step"] == 4 and not state["optimizer"]["state"], "the optimizer stepped"
    first = sorted((run / "checkpoints").glob("step_*"))[0]
    for name, w in read_state(first)["model"].items():
        assert torch.equal(w, state["model"][name]), f"{name} moved"
    assert all(np.isnan(m["loss"]) for m in metrics(run) if "loss" in m)
    assert np.isfinite(summary(run)["eval_loss"])
