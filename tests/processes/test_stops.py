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
from dataclasses import dataclass, field
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

SEGMENTED = ["train.steps=40", "train.log_every=5", "train.eval_every=25"]  # stops land inside log windows of 5
# An evaluation of 30 s: 60 batches a rank, each with a sleep of 0.5 s (tests/small_task.py), which takes no CPU.
SLOW_EVAL = ["task.eval_samples=960", "task.eval_delay_s=0.5"]
SLOW_STOP = ("--nproc-per-node=2", "--stop-timeout=10")  # a 10 s budget against an evaluation of about 30 s

# A SIGTERM from rank $SIGNAL_RANK (0 unless set) to its own process right after the training of step $SIGNAL_AT.
SIGNAL_AFTER_STEP = """
import os, signal
real = module.train_step
def train_step(training, *a, **k):
    loss = real(training, *a, **k)
    if (training.state.step == int(os.environ["SIGNAL_AT"])
            and os.environ.get("RANK", "0") == os.environ.get("SIGNAL_RANK", "0")):
        os.kill(os.getpid(), signal.SIGTERM)
    return loss
module.train_step = train_step
"""


def loss_lines(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in metrics(run_dir) if "loss" in m]


def eval_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in metrics(run_dir) if "eval_loss" in m]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run the segmented one must equal: two ranks under torchrun (the training the
    launcher starts), TINY with SEGMENTED to its end, evaluations at steps 25 and 40, a checkpoint at the last."""
    ref = tmp_path_factory.mktemp("reference")
    run_train(ref, *SEGMENTED, nproc=2)
    return ref


def _rank_logs(run_dir: Path, since: dict[int, int]) -> dict[int, str]:
    """What each rank's log (appended to by every launch) gained after the sizes `since`."""
    return {r: (run_dir / "logs" / f"rank{r}.log").read_bytes()[since.get(r, 0):].decode() for r in (0, 1)}


def _log_sizes(run_dir: Path) -> dict[int, int]:
    return {r: p.stat().st_size if (p := run_dir / "logs" / f"rank{r}.log").exists() else 0 for r in (0, 1)}


@dataclass
class Segment:
    """One launch of the segmented run, as it ended: what the tests about it read (the run directory changes
    with the next launch)."""
    rc: int
    out: str
    err: str
    before: int  # the step the launch resumed from (0: none)
    marker: dict | None  # STOPPED
    latest: int | None  # the step of the checkpoint `latest` names
    logs: dict[int, str]  # each rank's log lines of this launch
    logged: list[int]  # the steps of metrics.jsonl's loss lines
    evals: list[int]  # the steps of its evaluation lines
    order: list[tuple[str, int]]  # metrics.jsonl's lines: ("loss" or "eval", step), in file order
    summary: dict | None
    report: int  # report.png's size (0: none)
    ranks: dict[int, int] = field(default_factory=dict)  # {rank: pid} while it ran (only where asked)


def _ended(run_dir: Path, result: tuple[int, str, str], sizes: dict[int, int], before: int, **more) -> Segment:
    rc, out, err = result
    stopped, summary_json = run_dir / "STOPPED", run_dir / "summary.json"
    records = metrics(run_dir)
    return Segment(rc, out, err, before, json.loads(stopped.read_text()) if stopped.exists() else None,
                   latest_state(run_dir)["step"] if (run_dir / "checkpoints" / "latest").exists() else None,
                   _rank_logs(run_dir, sizes), logged_steps(run_dir), eval_steps(run_dir),
                   [("loss" if "loss" in m else "eval", m["step"]) for m in records if "loss" in m or "eval_loss" in m],
                   json.loads(summary_json.read_text()) if summary_json.exists() else None,
                   (run_dir / "report.png").stat().st_size if (run_dir / "report.png").exists() else 0, **more)


def _both_ranks(proc: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the launch's two workers, once both run (a launch that ended: {})."""
    def found():
        if proc.poll() is not None:
            return {"ended": True}
        ranks = workers(proc.pid)
        return ranks if len(ranks) == 2 else None

    ranks = wait_for(found, 120, "two ranks")
    return {} if "ended" in ranks else ranks


@pytest.fixture(scope="module")
def segmented(tmp_path_factory) -> dict[str, Segment]:
    """One run of TINY with SEGMENTED on two ranks under the launcher, stopped in turn (each a launch of its own):
    - "rank 1": by rank 1's own SIGTERM right after step 7 (SIGNAL_AFTER_STEP: a signal to one rank alone, as one
      node's kubelet or one srun task sends);
    - "TERM": by SIGTERM to the launcher while the workers are frozen (SIGSTOP) for 12 s, and two more to torchrun
      (_stop_slowly);
    - "USR1": by SIGUSR1 to the launcher (SLURM's warning before a time limit);
    - "slow eval": by SIGTERM during the evaluation of step 25, which takes 30 s (SLOW_EVAL), within 10 s;
    - "USR2": by SIGUSR2 to the launcher, after the launch evaluated step 25 and trained on;
    - "last step": by SIGTERM in the final evaluation (SLOW_EVAL again), with W&B and the report on (OBSERVED);
    - "finish": relaunched to its end (OBSERVED);
    - "complete": relaunched once more.
    Each of these is what a test below asserts on; together they end equal to the uninterrupted reference."""
    run = tmp_path_factory.mktemp("segmented")
    segments: dict[str, Segment] = {}

    def before() -> int:
        return max([s.latest or 0 for s in segments.values()], default=0)

    def plain(name: str, *overrides: str, sig: signal.Signals | None = None, at_step: int | None = None,
              launcher=("--nproc-per-node=2",), env: dict | None = None, ranks: bool = False) -> None:
        """A launch; `sig` to the launcher after a step beyond the one it resumed from (`at_step`: once that step is
        logged, and a second later: in its evaluation); then its end."""
        sizes, start = _log_sizes(run), before()
        proc = launch(run, *SEGMENTED, *overrides, launcher=launcher, env=env)
        found = _both_ranks(proc) if ranks else {}
        if sig is not None:
            if at_step is None:
                wait_for(lambda: proc.poll() is not None or any(s > start for s in logged_steps(run)), 120,
                         f"a step after {start}")
            else:
                wait_for(lambda: proc.poll() is not None or at_step in logged_steps(run), 120, f"step {at_step}")
                time.sleep(1)
            proc.send_signal(sig)
        segments[name] = _ended(run, finish(proc, timeout=60 if sig else 240), sizes, start, ranks=found)

    site = tmp_path_factory.mktemp("site")
    plain("rank 1", env=after_import(site, "train.trainer", SIGNAL_AFTER_STEP) | {"SIGNAL_AT": "7", "SIGNAL_RANK": "1"},
          ranks=True)
    sizes, start = _log_sizes(run), before()
    result = _stop_slowly(run, ("--nproc-per-node=2", "--stop-timeout=60"), frozen_s=12, also_torchrun=True,
                          overrides=SEGMENTED, ready=lambda: any(s > start for s in logged_steps(run)))
    segments["TERM"] = _ended(run, result[:3], sizes, start)
    plain("USR1", sig=signal.SIGUSR1)
    plain("slow eval", *SLOW_EVAL, sig=signal.SIGTERM, at_step=25, launcher=SLOW_STOP)
    plain("USR2", sig=signal.SIGUSR2)
    plain("last step", *SLOW_EVAL, *OBSERVED, sig=signal.SIGTERM, at_step=40, launcher=SLOW_STOP)
    plain("finish", *OBSERVED)
    plain("complete")
    segments["run"] = run  # the run directory at the end
    return segments


def test_stop_signals_to_the_launcher_and_to_one_rank_segments_one_run_bitwise_equal_to_uninterrupted(
        segmented, reference):
    """TERM (the workers frozen meanwhile: a slow stop), USR1 (SLURM's warning before a time limit) and USR2 to the
    launcher, each passed on to the workers as SIGTERM, and TERM to rank 1 alone (one node's kubelet, one srun
    task, right after step 7: SIGNAL_AFTER_STEP): each a checkpoint and exit 75 within a minute, the relaunches
    continue (the segmented fixture: two more stops in evaluations in between), and the end equals the
    uninterrupted run: weights, optimizer, every loss line. (INT and HUP to the launcher: test_launcher.py's
    Ctrl-C through `make train-local` and hang-up to the whole process group, each a checkpoint and 75 with its
    line.)
    The signal to one rank stops every rank at the same step with one save, by rank 0."""
    stops = []
    for name, target, sig in (("rank 1", "rank 1", signal.SIGTERM), ("TERM", "launcher", signal.SIGTERM),
                              ("USR1", "launcher", signal.SIGUSR1), ("USR2", "launcher", signal.SIGUSR2)):
        seg = segmented[name]
        assert seg.rc == 75, f"{target} {sig.name}: exit {seg.rc}\n{seg.err[-3000:]}"
        marker = seg.marker
        if target == "launcher":  # torchrun's SignalException is the expected end of a stop, not news
            assert f"launch: stopped on {sig.name}" in seg.err and "Traceback" not in seg.err, seg.err[-3000:]
            # the launcher passes any stop signal on to the workers as SIGTERM; rank 0's line reaches its stdout
            assert f"stopped on SIGTERM at step {marker['step']}, checkpoint saved" in seg.out, seg.out[-3000:]
        else:
            assert sorted(seg.ranks) == [0, 1], seg.ranks
        assert marker["step"] == seg.latest > seg.before
        saved = [int(re.search(r"at step (\d+), checkpoint saved", seg.logs[r]).group(1)) for r in (0, 1)]
        assert saved == [marker["step"]] * 2, saved  # every rank stopped at the same step
        assert len(re.findall(r"INFO saved ", seg.logs[0])) == 1  # one save, by rank 0
        if target != "launcher":
            said = {r: re.findall(r"stopped on (\S+(?: a peer rank signal)?).*? at step (\d+)", seg.logs[r])
                    for r in (0, 1)}
            assert said[1][0][0] == sig.name and "peer rank signal" in seg.logs[0], said
        stops.append(marker["step"])
    assert max(stops) < 40, stops
    assert any(s % 5 for s in stops), f"no stop landed inside a log window: {stops}"
    run = segmented["run"]
    assert segmented["finish"].rc == 0, segmented["finish"].err[-3000:]
    assert_same_state(latest_state(reference), latest_state(run))
    assert logged_steps(run) == list(range(5, 41, 5))  # every loss line once, in order
    assert loss_lines(run) == loss_lines(reference)  # the same window averages, bit for bit
    assert summary(run)["steps"] == 40 and summary(run)["ranks_in_sync"]


@pytest.fixture(scope="module")
def stopped_alone(tmp_path_factory) -> Path:
    """`python -m train`, resume=never in an empty place, 8-px images in fp32 (small: the fp16 test resumes it),
    stopped by its own SIGTERM right after step 7 of 20 (SIGNAL_AFTER_STEP): step 7 logs, evaluates and saves
    nothing."""
    root = tmp_path_factory.mktemp("alone")
    env = after_import(root, "train.trainer", SIGNAL_AFTER_STEP) | {"SIGNAL_AT": "7"}
    run_train(root / "run", *ALONE, "resume=never", expect=75, env=env)
    return root / "run"


ALONE = ["task.image_size=8", "task.eval_samples=16", "train.precision=fp32", "train.steps=20", "train.log_every=5",
         "train.eval_every=0", "checkpoint.every=0"]  # half-precision convolutions are slow on CPU: 8-px images


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


@pytest.mark.parametrize("nproc, lands", [(1, 7), (2, 8)])
def test_a_run_of_one_process_stops_at_the_step_its_signal_came_in(request, nproc, lands):
    """Step 7 logs, evaluates and saves nothing. Ranks that must agree read the previous step's all-reduce there,
    so their stop lands a step later (8: the segmented run's first launch, where rank 1 signals itself). One
    process has nobody to agree with: it reads its own flag, with no collective and no wait for the device, and
    stops at step 7 (stopped_alone)."""
    if nproc == 1:
        run = request.getfixturevalue("stopped_alone")
        marker, latest = json.loads((run / "STOPPED").read_text()), latest_state(run)["step"]  # exit 75: the fixture
    else:
        seg = request.getfixturevalue("segmented")["rank 1"]
        marker, latest = seg.marker, seg.latest
        assert seg.rc == 75, seg.err[-3000:]
    assert marker["step"] == lands and latest == lands, marker


def test_a_stop_during_a_slow_evaluation_does_not_wait_for_it(segmented):
    """The ranks agree between evaluation batches: the stop is done long before the evaluation would be
    (a 10 s budget against an evaluation of about 30 s), and the resumed run evaluates that step first."""
    seg = segmented["slow eval"]
    assert seg.rc == 75, seg.err[-3000:]
    assert seg.latest == 25 and seg.evals == []
    assert "stopped on SIGTERM at step 25, checkpoint saved (its evaluation runs after the resume)" in seg.out
    # The relaunch (stopped later by USR2) evaluates step 25 before training on, with the usual evaluation set.
    after = segmented["USR2"]
    assert after.evals == [25] and after.logged == list(range(5, after.logged[-1] + 1, 5)), after.order
    assert after.order.index(("eval", 25)) == after.order.index(("loss", 25)) + 1 and after.logged[-1] > 25
    assert segmented["finish"].evals == [25, 40] and segmented["finish"].logged == list(range(5, 41, 5))


def test_a_stop_at_the_last_step_is_finished_by_the_relaunch(segmented):
    """Stopped after the last step, in the final evaluation: a checkpoint and 75, no summary; the relaunch
    evaluates and finishes the run (summary.json, report, W&B), rather than calling it complete."""
    seg = segmented["last step"]
    assert seg.rc == 75, seg.err[-3000:]
    assert seg.latest == 40 and seg.summary is None
    seg = segmented["finish"]
    assert seg.rc == 0, seg.err[-3000:]
    assert "already complete" not in seg.out and "done: 40 steps" in seg.out
    s = seg.summary
    assert s["steps"] == 40 and s["wandb_run_id"] and seg.report > 0
    assert seg.evals == [25, 40] and seg.logged == list(range(5, 41, 5))
    seg = segmented["complete"]
    assert seg.rc == 0 and "already complete at step 40" in seg.out


def _stop_slowly(run_dir: Path, launcher: tuple, frozen_s: float, also_torchrun: bool = False,
                 env: dict | None = None, overrides=("train.steps=500",), ready=None):
    """Stop a run whose workers need `frozen_s` seconds (SIGSTOPped) before they can act on it (once `ready()`:
    by default its second step); when the launcher exits, kill whatever is left of the job, as a scheduler does at
    the end of a job step."""
    proc = launch(run_dir, *overrides, launcher=launcher, env=env)
    wait_for(lambda: proc.poll() is not None or (ready or (lambda: len(logged_steps(run_dir)) >= 2))(), 120,
             "a step to stop after")
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
    """(One worker: the budget is the launcher's, whatever the number of ranks.)"""
    rc, out, err, took = _stop_slowly(tmp_path, ("--nproc-per-node=1", "--stop-timeout=3"), frozen_s=12)
    assert rc == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: stopped on SIGTERM, but no checkpoint was written within the stop budget "
                           "(--stop-timeout=3 s)") and "raise STOP_TIMEOUT" in last, last
    assert not (tmp_path / "STOPPED").exists() and not (tmp_path / "checkpoints").exists()


def test_more_sigterms_to_torchrun_do_not_lose_the_save(segmented):
    """SLURM's SIGTERMs reach torchrun besides the launcher's: torch 2.14's torchrun survives a second one
    (its shutdown runs again) and gives up waiting at the third; the launcher does not leave before the
    workers have saved (whatever is left when it exits is killed, as a scheduler does). The segmented run's
    "TERM" launch: its workers frozen for 12 s, two SIGTERMs to torchrun after the launcher's."""
    seg = segmented["TERM"]
    assert seg.rc == 75, seg.err[-3000:]
    assert seg.marker["step"] == seg.latest > seg.before


# ---------------------------------------------------------------- resume correctness

def test_resuming_with_fp16_starts_a_fresh_loss_scaler(tmp_path, stopped_alone):
    """A checkpoint without a loss scaler (fp32's, stopped_alone's at step 7; bf16's is the same disabled scaler,
    saved as {}) resumed in fp16 starts a fresh GradScaler; and back to fp32, which needs none."""
    copy_run(stopped_alone, tmp_path)
    proc = run_train(tmp_path, *ALONE, "train.precision=fp16", "train.steps=8")
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text and "was trained in fp32 (no loss scaler)" in text
    assert "starts a fresh GradScaler" in text
    assert summary(tmp_path)["steps"] == 8 and latest_state(tmp_path)["scaler"]["scale"] > 0
    proc = run_train(tmp_path, *ALONE, "train.precision=fp32", "train.steps=9")
    assert "Traceback" not in proc.stderr and summary(tmp_path)["steps"] == 9


def test_resume_never_on_an_earlier_run_refuses_in_one_line_and_changes_nothing(tmp_path, finished_run,
                                                                                 stopped_alone):
    copy_run(finished_run, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = run_train(tmp_path, "resume=never", expect=2)
    assert proc.stderr.count("\n") == 1 and "resume=never" in proc.stderr and "run.name or run.dir" in proc.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # An empty place is fine: stopped_alone, resume=never there, trained from step 1 (to its stop at step 7).
    assert logged_steps(stopped_alone) == [5] and latest_state(stopped_alone)["step"] == 7


def test_evaluation_uses_the_saved_batchnorm_statistics_on_every_rank(tmp_path, reference):
    """Two ranks evaluate with rank 0's BatchNorm statistics, the ones saved: the result equals one
    process evaluating the saved checkpoint, and the end-of-run check covers the buffers."""
    copy_run(reference, tmp_path)  # 2 ranks, 40 steps, the last one checkpointed
    two = summary(tmp_path)
    assert two["ranks_in_sync"] and two["world_size"] == 2
    (tmp_path / "summary.json").unlink()  # the relaunch finishes the run again: one process evaluates
    proc = run_train(tmp_path, *SEGMENTED)
    one = summary(tmp_path)
    assert "done: 40 steps" in proc.stdout and one["world_size"] == 1
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
