"""Stops: every stop signal costs at most the steps since it arrived, and the exit code tells the truth.

Real launcher, torchrun and gloo workers, real signals (also SIGSTOP to make a stop slow), real files."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (
    BUILT_IN,
    OBSERVED,
    PACED,
    ROOT,
    after_import,
    assert_same_state,
    clean_env,
    copy_run,
    latest_state,
    metrics,
    run_train,
    summary,
    train_cmd,
)
from tests.procs import children, finish, kill_family, launch, logged_steps, wait_for, workers

SEGMENTED = ["train.steps=30", "train.log_every=5"]  # stops land inside log windows of 5 steps
# An evaluation of 30 s: 60 batches a rank, each with a sleep of 0.5 s (tests/small_task.py), which takes no CPU.
SLOW_EVAL = ["task.eval_samples=960", "task.eval_delay_s=0.5"]


def loss_lines(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in metrics(run_dir) if "loss" in m]


def eval_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in metrics(run_dir) if "eval_loss" in m]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run the segmented one must equal: two ranks under torchrun (the training the
    launcher starts), TINY with SEGMENTED to its end, a checkpoint and an evaluation at the last step."""
    ref = tmp_path_factory.mktemp("reference")
    run_train(ref, *SEGMENTED, nproc=2)
    return ref


def _rank_logs(run_dir: Path, since: dict[int, int]) -> dict[int, str]:
    """What each rank's log (appended to by every launch) gained after the sizes `since`."""
    return {r: (run_dir / "logs" / f"rank{r}.log").read_bytes()[since.get(r, 0):].decode() for r in (0, 1)}


def _log_sizes(run_dir: Path) -> dict[int, int]:
    return {r: p.stat().st_size if (p := run_dir / "logs" / f"rank{r}.log").exists() else 0 for r in (0, 1)}


def test_stop_signals_to_the_launcher_and_to_one_rank_segments_one_run_bitwise_equal_to_uninterrupted(
        tmp_path, reference):
    """TERM, USR1 (SLURM's warning before a time limit) and USR2 to the launcher in turn, each passed on to the
    workers as SIGTERM, then TERM to rank 1 alone (one node's kubelet, one srun task): each a checkpoint and exit
    75 within a minute, the relaunches continue, and the end equals the uninterrupted run:
    weights, optimizer, every loss line. (INT and HUP to the launcher: test_launcher.py's Ctrl-C through
    `make train-local` and hang-up to the whole process group, each a checkpoint and 75 with its line.)
    The signal to one rank stops every rank at the same step with one save, by rank 0."""
    stops = []
    for target, sig in (("launcher", signal.SIGTERM), ("launcher", signal.SIGUSR1), ("launcher", signal.SIGUSR2),
                        ("rank 1", signal.SIGTERM)):
        sizes = _log_sizes(tmp_path)
        proc = launch(tmp_path, *SEGMENTED)
        before = max(stops, default=0)
        wait_for(lambda b=before, p=proc: p.poll() is not None or any(s > b for s in logged_steps(tmp_path)),
                 120, f"a step after {before}")
        if target == "launcher":
            proc.send_signal(sig)
        else:
            ranks = workers(proc.pid)
            assert sorted(ranks) == [0, 1], ranks
            os.kill(ranks[1], sig)
        rc, out, err = finish(proc, timeout=60)
        assert rc == 75, f"{target} {sig.name}: exit {rc}\n{err[-3000:]}"
        marker = json.loads((tmp_path / "STOPPED").read_text())
        if target == "launcher":  # torchrun's SignalException is the expected end of a stop, not news
            assert f"launch: stopped on {sig.name}" in err and "Traceback" not in err, err[-3000:]
            # the launcher passes any stop signal on to the workers as SIGTERM; rank 0's line reaches its stdout
            assert f"stopped on SIGTERM at step {marker['step']}, checkpoint saved" in out, out[-3000:]
        assert marker["step"] == latest_state(tmp_path)["step"] > before
        logs = _rank_logs(tmp_path, sizes)  # this launch's lines
        saved = [int(re.search(r"at step (\d+), checkpoint saved", logs[r]).group(1)) for r in (0, 1)]
        assert saved == [marker["step"]] * 2, saved  # every rank stopped at the same step
        assert len(re.findall(r"INFO saved ", logs[0])) == 1  # one save, by rank 0
        if target != "launcher":
            said = {r: re.findall(r"stopped on (\S+(?: a peer rank signal)?).*? at step (\d+)", logs[r])
                    for r in (0, 1)}
            assert said[1][0][0] == sig.name and "peer rank signal" in logs[0], said
        stops.append(marker["step"])
    assert stops[-1] < 30, stops
    assert any(s % 5 for s in stops), f"no stop landed inside a log window: {stops}"
    rc, out, err = finish(launch(tmp_path, *SEGMENTED))
    assert rc == 0, err[-3000:]
    assert_same_state(latest_state(reference), latest_state(tmp_path))
    assert logged_steps(tmp_path) == list(range(5, 31, 5))  # every loss line once, in order
    assert loss_lines(tmp_path) == loss_lines(reference)  # the same window averages, bit for bit
    assert summary(tmp_path)["steps"] == 30 and summary(tmp_path)["ranks_in_sync"]


def test_ctrl_c_to_python_m_train_saves_and_exits_75(tmp_path):
    """SIGINT straight to a worker (Ctrl-C in `python -m train`, or a terminal's Ctrl-C passed on by
    torchrun) is a stop like SIGTERM, not a KeyboardInterrupt."""
    proc = subprocess.Popen(train_cmd(tmp_path, *PACED, "train.steps=200"), cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: len(logged_steps(tmp_path)) >= 2, 120, "step 2")
    proc.send_signal(signal.SIGINT)
    rc, out, err = finish(proc)
    assert rc == 75 and "KeyboardInterrupt" not in err, err[-3000:]
    assert "stopped on SIGINT" in out and latest_state(tmp_path)["step"] >= 2


# A SIGTERM from rank 0 to its own process right after the training of step $SIGNAL_AT.
SIGNAL_AFTER_STEP = """
import os, signal
real = module.train_step
def train_step(training, *a, **k):
    loss = real(training, *a, **k)
    if training.state.step == int(os.environ["SIGNAL_AT"]) and os.environ.get("RANK", "0") == "0":
        os.kill(os.getpid(), signal.SIGTERM)
    return loss
module.train_step = train_step
"""


@pytest.mark.parametrize("nproc, lands", [(1, 7), (2, 8)])
def test_a_run_of_one_process_stops_at_the_step_its_signal_came_in(tmp_path, nproc, lands):
    """Step 7 logs, evaluates and saves nothing. Ranks that must agree read the previous step's all-reduce there,
    so their stop lands a step later (8). One process has nobody to agree with: it reads its own flag, with no
    collective and no wait for the device, and stops at step 7."""
    env = after_import(tmp_path, "train.trainer", SIGNAL_AFTER_STEP) | {"SIGNAL_AT": "7"}
    proc = run_train(tmp_path / "run", "train.steps=20", "train.log_every=5", "train.eval_every=0",
                     "checkpoint.every=0", nproc=nproc, expect=75 if nproc == 1 else None, env=env)  # torchrun: 1
    assert json.loads((tmp_path / "run" / "STOPPED").read_text())["step"] == lands, proc.stdout[-2000:]
    assert latest_state(tmp_path / "run")["step"] == lands


def test_a_stop_during_a_slow_evaluation_does_not_wait_for_it(tmp_path):
    """The ranks agree between evaluation batches: the stop is done long before the evaluation would be
    (a 10 s budget against an evaluation of about 30 s), and the resumed run evaluates that step first."""
    proc = launch(tmp_path, *SLOW_EVAL, "train.steps=4", "train.eval_every=2", launcher=("--nproc-per-node=2",
                                                                                          "--stop-timeout=10"))
    wait_for(lambda: 2 in logged_steps(tmp_path), 120, "step 2, then its evaluation")
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    assert latest_state(tmp_path)["step"] == 2 and eval_steps(tmp_path) == []
    assert "stopped on SIGTERM at step 2, checkpoint saved (its evaluation runs after the resume)" in out
    # The relaunch evaluates step 2 before training on (a smaller evaluation set keeps this test short).
    rc, out, err = finish(launch(tmp_path, "train.steps=4", "train.eval_every=2"))
    assert rc == 0, err[-3000:]
    assert eval_steps(tmp_path) == [2, 4] and logged_steps(tmp_path) == [1, 2, 3, 4]


def test_a_stop_at_the_last_step_is_finished_by_the_relaunch(tmp_path):
    """Stopped after the last step, in the final evaluation: a checkpoint and 75, no summary; the relaunch
    evaluates and finishes the run (summary.json, report, W&B), rather than calling it complete."""
    proc = launch(tmp_path, *SLOW_EVAL, *OBSERVED, "train.steps=3", launcher=("--nproc-per-node=2",
                                                                            "--stop-timeout=10"))
    wait_for(lambda: 3 in logged_steps(tmp_path), 120, "the last step")
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    assert latest_state(tmp_path)["step"] == 3 and not (tmp_path / "summary.json").exists()
    rc, out, err = finish(launch(tmp_path, *OBSERVED, "train.steps=3"))
    assert rc == 0, err[-3000:]
    assert "already complete" not in out and "done: 3 steps" in out
    s = summary(tmp_path)
    assert s["steps"] == 3 and s["wandb_run_id"] and (tmp_path / "report.png").stat().st_size > 0
    assert eval_steps(tmp_path) == [3] and logged_steps(tmp_path) == [1, 2, 3]
    rc, out, err = finish(launch(tmp_path, "train.steps=3"))
    assert rc == 0 and "already complete at step 3" in out


def _stop_slowly(run_dir: Path, launcher: tuple, frozen_s: float, also_torchrun: bool = False,
                 env: dict | None = None):
    """Stop a run whose workers need `frozen_s` seconds (SIGSTOPped) before they can act on it; when the
    launcher exits, kill whatever is left of the job, as a scheduler does at the end of a job step."""
    proc = launch(run_dir, "train.steps=500", launcher=launcher, env=env)
    wait_for(lambda: len(logged_steps(run_dir)) >= 2, 120, "step 2")
    ranks = workers(proc.pid)
    agent = children(proc.pid)[0]
    for pid in ranks.values():
        os.kill(pid, signal.SIGSTOP)
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    if also_torchrun:  # SLURM signals every process of the step, and a second scancel or a kill does again
        for _ in range(2):
            time.sleep(0.5)
            os.kill(agent, signal.SIGTERM)
    while time.time() < t + frozen_s and proc.poll() is None:
        time.sleep(0.1)
    for pid in ranks.values():
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    rc, out, err = finish(proc)
    for pid in ranks.values():  # the scheduler ends the step with the launcher
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return rc, out, err, time.time() - t


# A stop slower than torchrun's own timeout, within the launcher's larger budget: tests/processes/test_torch_range.py
# (on every
# torch of the range, whether its torchrun takes --shutdown-timeout or not).


def test_a_budget_too_short_is_exit_1_with_the_setting_to_raise(tmp_path):
    rc, out, err, took = _stop_slowly(tmp_path, ("--nproc-per-node=2", "--stop-timeout=3"), frozen_s=12)
    assert rc == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: stopped on SIGTERM, but no checkpoint was written within the stop budget "
                           "(--stop-timeout=3 s)") and "raise STOP_TIMEOUT" in last, last
    assert not (tmp_path / "STOPPED").exists() and not (tmp_path / "checkpoints").exists()


def test_more_sigterms_to_torchrun_do_not_lose_the_save(tmp_path):
    """SLURM's SIGTERMs reach torchrun besides the launcher's: torch 2.14's torchrun survives a second one
    (its shutdown runs again) and gives up waiting at the third; the launcher does not leave before the
    workers have saved (whatever is left when it exits is killed, as a scheduler does)."""
    rc, out, err, took = _stop_slowly(tmp_path, ("--nproc-per-node=2", "--stop-timeout=60"), frozen_s=12,
                                      also_torchrun=True)
    assert rc == 75, err[-3000:]
    assert json.loads((tmp_path / "STOPPED").read_text())["step"] == latest_state(tmp_path)["step"] >= 2


# ---------------------------------------------------------------- resume correctness

def test_resuming_with_fp16_starts_a_fresh_loss_scaler(tmp_path):
    """A checkpoint without a loss scaler (fp32's; bf16's is the same disabled scaler, saved as {}) resumed in
    fp16 starts a fresh GradScaler; and back to fp32, which needs none."""
    small = ["task.image_size=8", "task.eval_samples=16"]  # half-precision convolutions are slow on CPU
    run_train(tmp_path, *small, "train.precision=fp32", "train.steps=1")
    proc = run_train(tmp_path, *small, "train.precision=fp16", "train.steps=2")
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text and "was trained in fp32 (no loss scaler)" in text
    assert "starts a fresh GradScaler" in text
    assert summary(tmp_path)["steps"] == 2 and latest_state(tmp_path)["scaler"]["scale"] > 0
    proc = run_train(tmp_path, *small, "train.precision=fp32", "train.steps=3")
    assert "Traceback" not in proc.stderr and summary(tmp_path)["steps"] == 3


def test_resume_never_on_an_earlier_run_refuses_in_one_line_and_changes_nothing(tmp_path, finished_run):
    copy_run(finished_run, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = run_train(tmp_path, "resume=never", expect=2)
    assert proc.stderr.count("\n") == 1 and "resume=never" in proc.stderr and "run.name or run.dir" in proc.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    run_train(tmp_path / "fresh", "resume=never")  # an empty place is fine
    assert logged_steps(tmp_path / "fresh") == [1, 2, 3, 4, 5, 6]


def test_evaluation_uses_the_saved_batchnorm_statistics_on_every_rank(tmp_path, reference):
    """Two ranks evaluate with rank 0's BatchNorm statistics, the ones saved: the result equals one
    process evaluating the saved checkpoint, and the end-of-run check covers the buffers."""
    copy_run(reference, tmp_path)  # 2 ranks, 30 steps, the last one checkpointed
    two = summary(tmp_path)
    assert two["ranks_in_sync"] and two["world_size"] == 2
    (tmp_path / "summary.json").unlink()  # the relaunch finishes the run again: one process evaluates
    proc = run_train(tmp_path, *SEGMENTED)
    one = summary(tmp_path)
    assert "done: 30 steps" in proc.stdout and one["world_size"] == 1
    assert one["eval_accuracy"] == two["eval_accuracy"]
    assert one["eval_loss"] == pytest.approx(two["eval_loss"], rel=1e-6)


# ---------------------------------------------------------------- a stop during a save

SAVE_S = 5  # how long each save takes here: rank 0 is frozen while a checkpoint's temporary file is open


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stop_during_a_periodic_save_ends_with_that_save_within_one_step_and_one_save(tmp_path, mode):
    """A stop that comes while a periodic save (blocking, or in the background with checkpoint.async) is
    being written ends with that save: no second save, no step after it (an async save's next step is
    trained again after the resume), so the stop budget sized as one step plus one save holds. Every save
    takes SAVE_S seconds (rank 0 frozen with SIGSTOP while a checkpoint's temporary folder exists), as on a
    slow shared file system; a step takes well under a second."""
    budget = SAVE_S + 4  # one save, one step and a margin
    ckpts = tmp_path / "checkpoints"
    # ResNet-18's saves (90 MB, ~0.2 s): long enough to be caught in the act, which TINY's take milliseconds for.
    proc = launch(tmp_path, BUILT_IN, "train.steps=500", "checkpoint.every=3", f"checkpoint.async={mode == 'async'}",
                  launcher=("--nproc-per-node=2", f"--stop-timeout={budget}"))

    def saving() -> set[str]:
        return {p.name for p in ckpts.glob(".step_*.tmp")} if ckpts.is_dir() else set()

    try:
        while True:  # freeze rank 0 inside a save (the file may be renamed between the look and the freeze)
            wait_for(saving, 120, "a save")
            rank0 = workers(proc.pid)[0]
            os.kill(rank0, signal.SIGSTOP)
            if names := saving():
                break
            os.kill(rank0, signal.SIGCONT)
        step = int(re.search(r"step_(\d+)", names.pop()).group(1))
        t = time.time()
        proc.send_signal(signal.SIGTERM)
        thaw, was_saving = t + SAVE_S, True
        while proc.poll() is None and time.time() < t + 60:  # every save after this one is as slow
            now, busy = time.time(), bool(saving())
            if thaw and now >= thaw:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank0, signal.SIGCONT)
                thaw = None
            elif thaw is None and busy and not was_saving:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank0, signal.SIGSTOP)
                thaw = now + SAVE_S
            was_saving = busy
            time.sleep(0.005)
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank0, signal.SIGCONT)
        rc, out, err = finish(proc)
        took = time.time() - t
    finally:
        if proc.poll() is None:
            kill_family(proc.pid)
    assert rc == 75 and took < budget + 5, f"exit {rc} after {took:.1f} s\n{err[-3000:]}"
    assert json.loads((tmp_path / "STOPPED").read_text())["step"] == step == latest_state(tmp_path)["step"]
    assert f"stopped on a peer rank signal at step {step}, checkpoint saved" in out or \
        f"stopped on SIGTERM at step {step}, checkpoint saved" in out, out[-3000:]
    if mode == "sync":  # no step after the save (an async save lets training go on while it is written)
        assert logged_steps(tmp_path)[-1] == step, logged_steps(tmp_path)
    log0 = (tmp_path / "logs" / "rank0.log").read_text()
    saves = re.findall(r"INFO saved \S+step_(\d+) in", log0)
    assert saves == [f"{s:08d}" for s in range(3, step + 1, 3)], saves  # each due step once, none for the stop
    assert sorted(p.name for p in ckpts.glob("step_*"))[-1] == f"step_{step:08d}"
