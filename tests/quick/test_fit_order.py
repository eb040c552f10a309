"""fit's order around each step, in this process (one rank, a one-process gloo group): when it logs, saves,
evaluates and stops, each when its component says it is due, and what a stop leaves for the relaunch."""

from __future__ import annotations

import pytest

from tests.conftest import TINY
from train import config, trainer
from train.checkpoint.checkpointer import Checkpointer
from train.errors import EXIT_REQUEUE
from train.observe.log import RunLog
from train.parallel import distributed
from train.stops.signals import StopRequest


@pytest.fixture
def events(monkeypatch):
    """The run's events in order, ("log" | "save" | "eval", step); `stop_when[0]`: from when on every rank agrees
    to stop (as if a signal came then): a function of the last step trained and the events so far, or None;
    `step[0]`: the last step trained."""
    seen: list[tuple[str, int]] = []
    step = [0]
    stop_when: list = [None]
    # run_info.json records the git commit and the platform, each by a process of its own (git, uname)
    monkeypatch.setattr(RunLog, "run_info", lambda self, *args: None)

    def recorded(name, real, step_of):
        def call(self, *args, **kwargs):
            seen.append((name, step_of(self, *args)))
            return real(self, *args, **kwargs)
        return call

    monkeypatch.setattr(RunLog, "train", recorded("log", RunLog.train, lambda self, record: record["step"]))
    monkeypatch.setattr(RunLog, "eval", recorded("eval", RunLog.eval, lambda self, record: record["step"]))
    monkeypatch.setattr(Checkpointer, "save", recorded("save", Checkpointer.save, lambda self, state, *a: state.step))
    real_advance = RunLog.advance

    def advance(self, s):
        step[0] = s
        return real_advance(self, s)

    monkeypatch.setattr(RunLog, "advance", advance)
    real_agreed = StopRequest.agreed

    def agreed(self, device, now=False):
        if stop_when[0] is not None and stop_when[0](step[0], seen):
            self.signal = "SIGTERM"
            return True
        return real_agreed(self, device, now=now)

    monkeypatch.setattr(StopRequest, "agreed", agreed)
    return seen, stop_when, step


def _run(run_dir, *overrides: str) -> int:
    cfg = config.load("configs/default.yaml", [*TINY, f"run.dir={run_dir}", *overrides])
    return trainer.run(cfg, distributed.detect({}))


def test_each_step_logs_then_saves_then_evaluates_each_when_due(tmp_path, events):
    seen, _, _ = events
    assert _run(tmp_path / "run", "train.steps=6", "train.log_every=2", "checkpoint.every=2",
                "train.eval_every=3") == 0
    # Step 3 evaluates (eval_every) without logging or saving; step 6, the last, logs, saves and evaluates once.
    assert seen == [("log", 2), ("save", 2), ("eval", 3), ("log", 4), ("save", 4), ("log", 6), ("save", 6),
                    ("eval", 6)]


def test_a_stop_before_a_due_evaluation_saves_first_and_the_relaunch_evaluates_before_its_next_step(tmp_path,
                                                                                                       events):
    seen, stop_when, _ = events
    run_dir = tmp_path / "run"
    stop_when[0] = lambda step, seen: step >= 3
    assert _run(run_dir, "train.steps=6", "train.log_every=2", "train.eval_every=3") == EXIT_REQUEUE
    assert seen == [("log", 2), ("save", 3)]  # the stop is agreed before the evaluation, which never waits for it
    seen.clear()
    stop_when[0] = None
    assert _run(run_dir, "train.steps=6", "train.log_every=2", "train.eval_every=3") == 0
    assert seen == [("eval", 3), ("log", 4), ("log", 6), ("save", 6), ("eval", 6)]


def test_a_stop_that_comes_during_a_save_ends_with_that_save(tmp_path, events):
    """A stop agreed only once a periodic save is made: no second save of that step, no step trained after it."""
    seen, stop_when, trained = events
    stop_when[0] = lambda step, seen: ("save", 4) in seen
    run_dir = tmp_path / "run"
    assert _run(run_dir, "train.steps=6", "train.log_every=4", "checkpoint.every=4") == EXIT_REQUEUE
    assert seen == [("log", 4), ("save", 4)] and trained[0] == 4
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
