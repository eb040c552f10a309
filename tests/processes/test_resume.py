"""Checkpoints and exact resume, with real processes, real signals and real files."""
from __future__ import annotations

import io
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import (
    BUILT_IN,
    PY,
    RNG_DRAWS,
    ROOT,
    TINY,
    after_import,
    assert_same_state,
    assert_same_training,
    clean_env,
    copy_run,
    latest_state,
    metrics,
    pacing,
    run_train,
    summary,
    train_cmd,
    train_losses,
)
from tests.procs import is_stopped, signal_at_step, wait_for
from train.checkpoint import dcp_io, storage
from train.errors import EXIT_REQUEUE

# 18 steps of 16 over 128 samples: 8 steps an epoch. A stop at step 9 (signal_at_step: at the step logged when
# the ranks were paused, or the next) is mid-epoch in the second epoch, and the resumed run crosses into the third.
LONG = ["train.steps=18", "task.train_samples=128"]


def start(run_dir, *overrides, nproc=1, entry=("-m", "train")):
    """A run the test acts on mid-way: paced (PACED) unless it trains a task of its own."""
    return subprocess.Popen(train_cmd(run_dir, *pacing(overrides), *overrides, nproc=nproc, entry=entry), cwd=ROOT,
                            env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(run_dir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(m.get("step", 0) >= step for m in metrics(run_dir)):
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def test_sigterm_to_torchrun_mid_epoch_then_resume_is_bitwise_exact(tmp_path):
    """The model draws from torch's, numpy's and Python's generators every step (RNG_DRAWS), so the resume
    is exact only if every rank gets its own generator states back."""
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    run_train(ref, *LONG, nproc=2, entry=RNG_DRAWS)

    proc = start(cut, *LONG, nproc=2, entry=RNG_DRAWS)
    paused_at = signal_at_step(proc, cut, 9, ranks=2)  # to the torchrun agent, which passes it on to the workers
    out, _ = proc.communicate(timeout=30)  # inside torchrun's 30 s grace period
    stopped_at = latest_state(cut)["step"]
    assert paused_at <= stopped_at <= paused_at + 1, (paused_at, stopped_at, out)
    assert 9 <= stopped_at < 16 and stopped_at % 8 != 0, out  # mid-run, mid-epoch (the second)
    assert "stopped on SIGTERM" in out, out
    assert not (cut / "summary.json").exists()

    run_train(cut, *LONG, nproc=2, entry=RNG_DRAWS)  # the same command again continues the run
    assert_same_training(ref, cut)  # weights, optimizer state and losses, step for step, bit for bit
    assert sorted(train_losses(cut)) == list(range(1, 19))
    assert summary(cut)["steps"] == 18


def test_configured_signal_stops_a_single_process_with_the_requeue_code(tmp_path):
    proc = start(tmp_path, "train.steps=8", "checkpoint.signal=SIGUSR1")
    paused_at = signal_at_step(proc, tmp_path, 3, sig=signal.SIGUSR1)
    time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # twice: still one clean stop
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_REQUEUE, out
    step = latest_state(tmp_path)["step"]
    assert 3 <= paused_at <= step <= paused_at + 1 < 8 and "stopped on SIGUSR1" in out, (paused_at, step, out)
    run_train(tmp_path, "train.steps=8")
    assert sorted(train_losses(tmp_path)) == list(range(1, 9))


def test_sigkill_during_a_save_leaves_a_loadable_latest(tmp_path):
    """Save every step and SIGKILL while a save's temporary file exists: the process is paused (SIGSTOP) as soon
    as one is seen, and killed only if it is still there, so the kill lands mid-save every time."""
    ckpts = tmp_path / "checkpoints"
    # The built-in ResNet-18: its saves (90 MB, ~0.2 s) are caught in the act; TINY's take milliseconds.
    proc = start(tmp_path, BUILT_IN, "checkpoint.every=1", "train.steps=200")
    deadline, killed = time.time() + 120, False
    while time.time() < deadline and proc.poll() is None and not killed:
        if (ckpts / "latest").exists() and any(".tmp" in p.name for p in ckpts.iterdir()):
            proc.send_signal(signal.SIGSTOP)
            wait_for(lambda: is_stopped(proc.pid), 60, "the run to stop")
            # frozen: a temporary file there now is one of a save in progress (it may have been renamed between
            # the look and the pause: then go on and look again)
            if any(".tmp" in p.name for p in ckpts.iterdir()):
                proc.kill()
                killed = True
            else:
                proc.send_signal(signal.SIGCONT)
        time.sleep(0.005)
    proc.wait()
    assert killed and proc.returncode == -signal.SIGKILL, "the kill never landed during a save"
    assert any(".tmp" in p.name for p in ckpts.iterdir())
    name = (ckpts / "latest").read_text().strip()
    state = dcp_io.read_state(ckpts / name)  # verifies the CRCs, loads with weights_only
    assert state["step"] >= 1
    resumed = run_train(tmp_path, BUILT_IN, "checkpoint.every=0", f"train.steps={state['step'] + 1}")
    assert f"resumed from {ckpts / name}" in resumed.stdout
    assert not any(".tmp" in p.name for p in ckpts.iterdir())  # the dead save's leftovers are gone


def test_corrupt_latest_falls_back_to_the_previous(tmp_path, finished_run):
    """A tensor file cut short (the newest checkpoint, step 6) and one with a flipped byte (step 4) both fail their
    checksum: each is named and skipped for the one before."""
    copy_run(finished_run, tmp_path)  # checkpoints at steps 2, 4 and 6
    ckpts = tmp_path / "checkpoints"
    truncated, flipped = (ckpts / f"step_{step:08d}" / "__0_0.distcp" for step in (6, 4))
    raw = truncated.read_bytes()
    truncated.write_bytes(raw[: len(raw) // 2])
    raw = flipped.read_bytes()
    flipped.write_bytes(raw[:1000] + bytes([raw[1000] ^ 1]) + raw[1001:])
    proc = run_train(tmp_path, "checkpoint.every=2", "checkpoint.keep=3", "train.steps=8")
    for name in ("step_00000006", "step_00000004"):
        warnings = [line for line in proc.stderr.splitlines() + proc.stdout.splitlines() if name in line]
        assert any("checksum" in w and "trying the previous one" in w for w in warnings), proc.stdout + proc.stderr
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in proc.stdout
    assert summary(tmp_path)["steps"] == 8


class _Payload:
    """Unpickling this runs a shell command: what a planted checkpoint would do to a plain torch.load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _forge(path, payload: bytes) -> None:
    """Give one file of a checkpoint new bytes, and its manifest their size and CRC: it passes the check."""
    path.write_bytes(payload)
    manifest_path = path.parent / storage.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][path.name] = {"bytes": len(payload), "crc32": zlib.crc32(payload)}
    manifest_path.write_text(json.dumps(manifest))


def test_a_checkpoint_that_passes_its_crc_but_does_not_load_is_skipped_and_never_executed(tmp_path, finished_run):
    """DCP's .metadata is a pickle (unpickled here with a whitelist), trainer.pt a torch.save (weights_only). Each
    way of not loading is forged into one of the run's three newest checkpoints, whose manifests give the forged
    files their size and CRC: random bytes as a tensor file (step 4), a pickle that runs code as .metadata (step 6)
    and as trainer.pt (step 8, a copy of step 6)."""
    copy_run(finished_run, tmp_path)  # checkpoints at steps 2, 4 and 6
    ckpts, marker = tmp_path / "checkpoints", tmp_path / "pwned"
    shutil.copytree(ckpts / "step_00000006", ckpts / "step_00000008")
    (ckpts / "latest").write_text("step_00000008\n")
    buf = io.BytesIO()
    torch.save({"rest": _Payload(marker), "step": 8}, buf)
    forged = {4: ("__0_0.distcp", os.urandom(4096)), 6: (".metadata", pickle.dumps(_Payload(marker))),
              8: ("trainer.pt", buf.getvalue())}
    for step, (name, payload) in forged.items():
        _forge(ckpts / f"step_{step:08d}" / name, payload)
    # asked for by path, a checkpoint that does not load is a usage error in one line
    for step in forged:
        branch, path = tmp_path / f"branch{step}", ckpts / f"step_{step:08d}"
        proc = run_train(branch, f"resume={path}", expect=2)
        assert f"no loadable checkpoint at {path}" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not (branch / "metrics.jsonl").exists()
    # found by resume=auto, each is skipped for the one before
    proc = run_train(tmp_path, "checkpoint.every=2", "checkpoint.keep=3", "train.steps=8")
    out = proc.stdout + proc.stderr
    for step in forged:
        skipped = [line for line in out.splitlines() if f"step_{step:08d} does not load" in line]
        assert len(skipped) == 1 and "trying the previous one" in skipped[0], out
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in proc.stdout
    assert not marker.exists()  # never unpickled with code: the payloads never ran


def _files(run_dir) -> dict:
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and "logs" not in p.parts}


@pytest.mark.parametrize("change", ["model", "optimizer", "every checkpoint corrupt"])
def test_a_run_none_of_whose_checkpoints_loads_is_refused_in_one_line_and_they_stay(tmp_path, change, finished_run):
    """resume=auto never trains from step 0 over a run it cannot load: that would lose the run at the next
    retention (its new saves sort below the old ones) and again at every relaunch. Another model or optimizer
    is named: by its key's relaunch rule, and, for a new run from the checkpoints, with the tensors that differ;
    checkpoints that all fail to load are a usage error that lists the ways out."""
    copy_run(finished_run, tmp_path)  # checkpoints at steps 2, 4 and 6, trained with sgd
    if change == "every checkpoint corrupt":
        for shard in (tmp_path / "checkpoints").glob("step_*/__0_0.distcp"):
            raw = shard.read_bytes()
            shard.write_bytes(raw[:1000] + bytes([raw[1000] ^ 1]) + raw[1001:])
    before = _files(tmp_path)
    override = {"model": "task.model=resnet34", "optimizer": "optim.name=adamw"}.get(change, "seed=0")
    proc = run_train(tmp_path, override, "checkpoint.every=2", "train.steps=9", expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    if change in ("model", "optimizer"):
        # A relaunch: the key's rule refuses it by name before any tensor is read (train/relaunch.py). Before the
        # rules, a relaunch met the tensors' mismatch below, as a new run from the run's checkpoints still does.
        key, old, new = ("task.model", "resnet18", "resnet34") if change == "model" else ("optim.name", "sgd", "adamw")
        assert errors[0].startswith(f"error: relaunch of {tmp_path} with {key} {old} -> {new} refused"), errors[0]
        branch = tmp_path.parent / f"{tmp_path.name}-branch"
        proc = run_train(branch, override, f"resume={tmp_path}", "train.steps=9", expect=2)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    if change == "model":
        assert "does not match the model of this run (it has task.model=resnet18, this run task.model=resnet34)" \
            in errors[0] and "missing, first layer1.2" in errors[0]
    elif change == "optimizer":
        assert "does not match the optimizer of this run (it has optim.name=sgd, this run optim.name=adamw)" \
            in errors[0] and "missing, first state.conv1.weight.step" in errors[0], errors[0]
    else:
        assert "no checkpoint of this run loads: step_00000006 fails its checksum" in errors[0]
        assert "Nothing was trained" in errors[0] and "new run.name" in errors[0]
    assert _files(tmp_path) == before  # nothing trained, saved, deleted or set aside
    if change == "optimizer":  # the run itself is intact: its own config continues it
        proc = run_train(tmp_path, "checkpoint.every=2", "train.steps=8")
        assert "resumed from" in proc.stdout and "at step 6" in proc.stdout
        assert sorted(train_losses(tmp_path)) == list(range(1, 9))


def test_retention_keeps_exactly_what_the_config_says(tmp_path):
    run_train(tmp_path, "checkpoint.every=1", "train.steps=10", "checkpoint.keep=2", "checkpoint.keep_every=4")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000004", "step_00000008", "step_00000009", "step_00000010"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000010"


def test_async_save_gives_the_same_checkpoints_as_a_synchronous_one(full_disk):
    """The relaunches of the full-disk test below (2 ranks) continue the same run from its step 6 with the same
    command, saving at steps 8 and 10, one synchronously and one in the background (step 10 trained after the
    background save of step 8)."""
    sync, asyn = full_disk("sync"), full_disk("async")
    for run in (sync, asyn):
        assert run.relaunch.returncode == 0, run.relaunch.stdout[-2000:] + run.relaunch.stderr[-3000:]
    for step in (8, 10):
        a = dcp_io.read_state(sync.dir / "checkpoints" / f"step_{step:08d}")
        b = dcp_io.read_state(asyn.dir / "checkpoints" / f"step_{step:08d}")
        assert_same_state(a, b, f"step {step}: ")


ASYNC_SAVE_THEN_TRAIN = """
import sys
from pathlib import Path
from types import SimpleNamespace
import torch, torch.distributed as dist
from train import config, optim
from train.checkpoint import checkpointer, dcp_io, resume, storage
from train.checkpoint.state import TrainState

run = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{run}.store", rank=0, world_size=1)
cfg = config.load(None, [f"run.dir={run}", "checkpoint.async=true", "optim.name=adamw"])
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 64))
opt = optim.build(cfg.optim, net)
x = torch.randn(2, 64)
net(x).square().mean().backward()
opt.step()  # the optimizer's state exists
net(x).square().mean().backward()  # the gradients of the step after the save
state = TrainState(model=net, optimizer=opt, scaler=torch.amp.GradScaler("cpu", enabled=False),
                   data=SimpleNamespace(state_dict=lambda: {}), device=torch.device("cpu"), step=1,
                   window_loss=torch.zeros(()))
before = {k: v.clone() for k, v in net.state_dict().items()}
moments = {k: v.clone() for k, v in opt.state[net[0].weight].items()}
ckpt = checkpointer.Checkpointer(cfg, 0, 1, SimpleNamespace(info=print, warning=print))
ckpt.save(state)  # returns before DCP's host copy is made (which the test's patch delays by a second)
with torch.no_grad():
    net(x)  # at once: a forward changes the BatchNorm statistics
opt.step()  # and the optimizer step every other tensor, while the copy has not begun
ckpt.wait()
saved = dcp_io.read_state(run / "checkpoints" / "step_00000001")
for k, v in net.state_dict().items():
    assert torch.equal(saved["model"][k], before[k]), f"{k}: the checkpoint holds a later value"
    assert k.endswith("num_batches_tracked") or not torch.equal(v, before[k]), f"{k}: training did not move it"
for k, v in moments.items():
    assert torch.equal(saved["optimizer"]["state"]["0.weight"][k], v), f"optimizer {k}: a later value"
print("the checkpoint holds the state of its step")
"""


# A patch of train/checkpoint/checkpointer.py (conftest.after_import): DCP's host copy of an asynchronous save starts
# a second late, so that training always runs ahead of it: without the optimizer's wait for the copy
# (Checkpointer._gate) the step's tensors change before they are copied, every time.
SLOW_HOST_COPY = """
import time
class SlowStager(module.DefaultStager):
    def stage(self, *args, **kwargs):
        time.sleep(1.0)
        return super().stage(*args, **kwargs)
module.DefaultStager = SlowStager
"""


def test_an_async_save_holds_its_steps_state_while_training_goes_on_at_once(tmp_path):
    """checkpoint.async returns before DCP copies the tensors to host memory; training goes on at once. The
    checkpoint must still hold the state of its step: the BatchNorm statistics that the next forward changes
    (copied by save()), the parameters and the optimizer's state that the next optimizer step changes (it
    waits for the copy, here made to come late)."""
    proc = subprocess.run([sys.executable, "-c", ASYNC_SAVE_THEN_TRAIN, str(tmp_path / "run")], cwd=ROOT,
                          env=after_import(tmp_path, "train.checkpoint.checkpointer", SLOW_HOST_COPY),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the checkpoint holds the state of its step" in proc.stdout


def _save_on_a_full_disk(run_dir, mode, finished_two_ranks) -> SimpleNamespace:
    """finished_two_ranks continued to step 10, saving every 2 steps in `mode`, where files past a size are refused
    (RLIMIT_FSIZE, as a full disk refuses them), then the same command again with room: the two launches, what the
    checkpoints were between them, and the run."""
    copy_run(finished_two_ranks, run_dir)  # 2 ranks, checkpoints at steps 2, 4 and 6
    args = ["train.steps=10", "checkpoint.every=2", "checkpoint.keep=3", "train.eval_every=2",
            f"checkpoint.async={mode == 'async'}"]
    ckpts = run_dir / "checkpoints"
    # Half a rank's tensor file (TINY's: ~1.2 MiB); the logs and the other files of a run stay far below.
    limit = min(f.stat().st_size for f in ckpts.glob("step_*/*.distcp")) // 2
    full = subprocess.run(train_cmd(run_dir, *args, nproc=2), cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    latest = (ckpts / "latest").read_text().strip()
    complete = [p.name for p in storage.complete_checkpoints(ckpts)]
    relaunch = run_train(run_dir, *args, nproc=2, expect=None)  # the same command again
    return SimpleNamespace(dir=run_dir, full=full, latest=latest, complete=complete, relaunch=relaunch)


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory, finished_two_ranks):
    """mode ("sync" or "async") -> _save_on_a_full_disk in that mode, made once for the module: the full-disk test
    asserts on it, and the async-against-sync test compares the checkpoints its two relaunches saved."""
    made = {}

    def get(mode):
        if mode not in made:
            made[mode] = _save_on_a_full_disk(tmp_path_factory.mktemp(f"full-disk-{mode}"), mode, finished_two_ranks)
        return made[mode]

    return get


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_on_a_full_disk_is_one_line_and_the_checkpoints_before_it_resume(mode, full_disk):
    """A save that cannot be written (here a real write error: files past a size refused, RLIMIT_FSIZE, as a
    full disk refuses them) ends the run with one line per rank naming the error and what to do; the
    checkpoints before it stay complete and `latest`, and the same command relaunched resumes from them."""
    run = full_disk(mode)
    proc = run.full
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert (f"[rank {rank}] error: a checkpoint could not be written; the ones before it are intact: make room"
                in proc.stderr and "OSError: [Errno 27] File too large)" in proc.stderr), proc.stderr[-3000:]
    assert run.latest == "step_00000006"
    assert run.complete == ["step_00000006", "step_00000004", "step_00000002"]
    proc = run.relaunch
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "at step 6" in proc.stdout and summary(run.dir)["steps"] == 10


# A patch of train/checkpoint/dcp_io.py (conftest.after_import): the background save's writer fails on an error that is
# neither a full disk nor an unwritable folder (torch 2.11's reused stager failed so, with a KeyError).
FAILING_WRITER = """
def write_data(self, plan, planner):
    raise ValueError("the writer's own bug")
module.BackgroundWriter.write_data = write_data
"""


def test_a_save_that_fails_on_something_else_than_the_disk_names_it_and_does_not_say_make_room(tmp_path):
    """Only a full disk is told to make room: any other failure of a save names itself, says what to do (relaunch;
    again: blocking saves), and leaves its traceback in the rank's log file, not on the console."""
    env = after_import(tmp_path, "train.checkpoint.dcp_io", FAILING_WRITER)
    proc = run_train(tmp_path / "run", "checkpoint.every=2", "checkpoint.async=true", expect=1, env=env)
    (line,) = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert line.startswith("[rank 0] error: a checkpoint could not be written; the ones before it are intact: not "
                           "for want of room or permissions") and "make room" not in line, line
    assert "checkpoint.async=false" in line and line.endswith("(ValueError: the writer's own bug)"), line
    assert "Traceback" not in proc.stderr
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "Traceback (most recent call last)" in log and "ValueError: the writer's own bug" in log


def test_resume_from_a_path(tmp_path, finished_run):
    """A new run from another run's checkpoint ends with the weights of that run uninterrupted (finished_run:
    the same 6 steps in one go; resume=never in an empty place: test_stops)."""
    branch = tmp_path / "branch"
    proc = run_train(branch, f"resume={finished_run / 'checkpoints' / 'step_00000004'}", "train.steps=6")
    assert "at step 4" in proc.stdout
    assert_same_state(latest_state(branch), latest_state(finished_run))
    proc = run_train(tmp_path / "x", f"resume={tmp_path / 'nowhere'}", expect=2)
    assert f"resume: {tmp_path / 'nowhere'} does not exist: check the path" in proc.stderr
    # a new run from another run's checkpoint may take a seed of its own (a relaunch of a run may not: test_data)
    proc = run_train(tmp_path / "seeded", f"resume={finished_run / 'checkpoints' / 'step_00000004'}", "seed=1",
                     "train.steps=5")
    assert "trained with seed=0: from its data position on, this run's seed=1 orders the data" in proc.stdout


@pytest.mark.parametrize("case", ["missing", "missing, relative", "no checkpoint there"])
def test_a_resume_path_that_does_not_exist_is_called_missing_one_of_the_wrong_kind_is_named_so(tmp_path, case):
    """resume=PATH with a typo says the path does not exist (a relative one: where it starts); a folder that is
    there but holds no checkpoint is named as such. One line, exit 2, no checkpoint written."""
    expected = "a checkpoint folder step_NNNNNNNN, or a run directory or checkpoints folder that holds them"
    if case == "missing":
        target = tmp_path / "nowhere" / "step_00000002"
        line = f"error: resume: {target} does not exist: check the path ({expected})"
    elif case == "missing, relative":
        target = "nowhere/step_00000002"
        line = f"error: resume: {target} does not exist (relative paths start at {ROOT}): check the path ({expected})"
    else:
        target = tmp_path / "empty"
        target.mkdir()
        line = f"error: resume: {target} is neither a checkpoint folder nor a folder holding checkpoints"
    proc = run_train(tmp_path / "run", f"resume={target}", expect=2)
    assert proc.stderr.strip() == line, proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_relaunching_a_finished_run_changes_nothing(tmp_path, finished_run):
    """Nor does a relaunch with fewer steps: the run's record (config.yaml, run_info.json) stays its own."""
    copy_run(finished_run, tmp_path)
    before = _files(tmp_path)
    proc = run_train(tmp_path, "checkpoint.every=2", "checkpoint.keep=3")  # the same command again
    assert "already complete at step 6" in proc.stdout
    proc = run_train(tmp_path, "checkpoint.every=2", "checkpoint.keep=3", "train.steps=4")
    assert "already complete at step 6" in proc.stdout
    assert _files(tmp_path) == before
    assert json.loads(before[Path("summary.json")])["steps"] == 6 and b"steps: 6" in before[Path("config.yaml")]


def test_a_run_killed_before_its_first_save_starts_again_with_its_metrics_from_step_0(tmp_path):
    """A run SIGKILLed (an OOM kill, a node lost) before any checkpoint starts again from step 0 when relaunched,
    and its metrics.jsonl holds each step once: the killed attempt's lines go, its last one cut short or not.
    The run is paused (SIGSTOP) before the kill, and killed only if it has saved nothing."""
    proc = start(tmp_path, "train.steps=40", "train.log_every=1", "checkpoint.every=0")
    wait_for_step(tmp_path, 3, proc)
    proc.send_signal(signal.SIGSTOP)
    wait_for(lambda: is_stopped(proc.pid), 60, "the run to stop")
    assert not list((tmp_path / "checkpoints").glob("step_*")), "it saved before the kill"
    proc.kill()
    proc.wait()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # the line a kill cut short
    run_train(tmp_path, "train.steps=6", "train.log_every=1", "checkpoint.every=0")
    assert [r["step"] for r in metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_step_folders_without_a_manifest_are_never_overwritten_or_deleted(tmp_path, finished_run):
    """Every save of this project writes its manifest before its folder gets its step's name, so a step folder
    without one is a copy or an edit by hand. It is not a free name: a relaunch tries it as a checkpoint that does
    not load. When none loads the start is refused and every folder stays; when an older one loads, the others are
    set aside, kept as they are, and never overwritten by a save of the same step or deleted by retention."""
    copy_run(finished_run, tmp_path)  # checkpoints at steps 2, 4 and 6
    for manifest in (tmp_path / "checkpoints").glob("step_*/manifest.json"):
        manifest.unlink()
    before = _files(tmp_path)
    proc = run_train(tmp_path, "checkpoint.every=2", "checkpoint.keep=3", "train.steps=8", expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "no checkpoint of this run loads: step_00000006 incomplete (no manifest.json" in errors[0], errors[0]
    assert _files(tmp_path) == before  # nothing trained, saved, deleted or set aside

    # step 4 complete again: the folders without a manifest before it (2) and after it (6) are set aside
    copy_run(finished_run / "checkpoints" / "step_00000004", tmp_path / "checkpoints" / "step_00000004")
    proc = run_train(tmp_path, "checkpoint.every=2", "checkpoint.keep=2", "train.steps=8")
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout, proc.stdout
    assert "step folders without a manifest (step_00000002, step_00000006) are set aside" in proc.stdout
    kept = {p.relative_to(tmp_path / "checkpoints"): p.read_bytes()
            for p in (tmp_path / "checkpoints" / "abandoned").rglob("step_*/*")}
    assert {(k.parts[-2], k.parts[-1]): v for k, v in kept.items()} == {
        (k.parts[-2], k.parts[-1]): v for k, v in before.items()
        if k.parent.name in ("step_00000002", "step_00000006")}
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000006", "step_00000008"]
    assert sorted(train_losses(tmp_path)) == list(range(1, 9))


def test_a_finished_run_whose_checkpoints_were_deleted_is_not_trained_again(tmp_path, finished_run):
    """Its summary.json says it ran: starting from step 0 would train it again over its metrics and summary."""
    copy_run(finished_run, tmp_path)
    shutil.rmtree(tmp_path / "checkpoints")
    before = _files(tmp_path)
    for resume_from in ("auto", str(finished_run / "checkpoints" / "step_00000004")):
        proc = run_train(tmp_path, "checkpoint.every=2", "checkpoint.keep=3", f"resume={resume_from}", expect=2)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{tmp_path} holds a finished run (summary.json) but none of its checkpoints" in errors[0], errors[0]
        assert "new run.name or run.dir" in errors[0]
        assert _files(tmp_path) == before


def test_a_run_never_writes_over_a_users_folder(tmp_path):
    """run.dir names a folder of the user's that holds files of the names a run writes (a project folder with its
    own config.yaml, run.dir=.): refused in one line, before anything is written. A file as run.dir, or on its
    path, is named as such."""
    folder = tmp_path / "project"
    (folder / "logs").mkdir(parents=True)
    (folder / "config.yaml").write_text("my: own config\n")
    (folder / "report.txt").write_text("mine\n")
    before = _files(folder)
    proc = run_train(folder, expect=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"run.dir {folder} holds no run of this project but files a run writes (config.yaml, report.txt)" \
        in errors[0] and "choose another run.dir" in errors[0], errors[0]
    assert _files(folder) == before and not list((folder / "logs").iterdir())
    (tmp_path / "afile").write_text("mine\n")
    for run_dir in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        proc = run_train(run_dir, expect=2)
        assert f"{tmp_path / 'afile'} is a file, not a folder; choose another with run.dir=" in proc.stderr
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_relaunched_branch_continues_from_its_own_checkpoints_not_from_resume_path(tmp_path, finished_run):
    """resume=PATH is where a new run starts: relaunched with the same command line (a SLURM requeue, a
    torchrun or pod restart), a branch continues from the checkpoints it wrote itself, as resume=auto would
    (past a corrupt newest one to an older one of its own), keeps its metrics and its W&B run, and once
    finished it is already complete."""
    branch, base = tmp_path / "branch", finished_run / "checkpoints" / "step_00000004"
    ckpts = branch / "checkpoints"
    args = [f"resume={base}", "train.steps=12", "checkpoint.every=2", "log.wandb.mode=offline"]
    proc = start(branch, *args)
    wait_for_step(branch, 9, proc)
    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):  # stopped at the next step boundary
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_REQUEUE, out
    stopped = latest_state(branch)["step"]
    assert 8 <= stopped < 12 and stopped % 2 == 0, out  # its own checkpoints: stopped and stopped - 2
    run_id = latest_state(branch)["tracker"]["run_id"]
    (ckpts / f"step_{stopped:08d}" / "__0_0.distcp").write_bytes(b"torn")  # the newest one of its own is corrupt
    before = metrics(branch)

    proc = run_train(branch, *args)  # the same command line again
    own = ckpts / f"step_{stopped - 2:08d}"
    assert f"resumed from {own} at step {stopped - 2}" in proc.stdout, proc.stdout
    lines = [line for line in proc.stdout.splitlines() if f"resume={base}" in line]
    assert len(lines) == 1 and "PATH, the run directory holds its own: a relaunch" in lines[0], proc.stdout
    # metrics.jsonl is truncated only to the step resumed from: the lines before it are the ones first written
    after = metrics(branch)
    assert [m for m in after if m["step"] <= stopped - 2] == [m for m in before if m["step"] <= stopped - 2]
    assert sorted(train_losses(branch)) == list(range(5, 13))
    assert summary(branch)["steps"] == 12 and summary(branch)["wandb_run_id"] == run_id  # the same W&B run

    done = (branch / "summary.json").read_text(), (branch / "metrics.jsonl").read_text()
    proc = run_train(branch, *args)
    assert "already complete at step 12" in proc.stdout, proc.stdout
    assert ((branch / "summary.json").read_text(), (branch / "metrics.jsonl").read_text()) == done


@pytest.mark.parametrize("how", ["resume=PATH", "corrupt newest"])
def test_resuming_before_newer_checkpoints_sets_them_aside_and_keeps_the_new_saves(tmp_path, how, finished_run):
    """Rolled back to step 2 (resume=PATH to an older checkpoint of the same run, or resume=auto falling
    back past corrupt newer ones), the run's checkpoints after step 2 are moved to checkpoints/abandoned/,
    not deleted, and retention (keep, keep_every) applies to the new saves alone: none is deleted as it is
    written because abandoned ones sort above it."""
    copy_run(finished_run, tmp_path)  # checkpoints at steps 2, 4 and 6
    ckpts = tmp_path / "checkpoints"
    args = ["checkpoint.every=1", "checkpoint.keep=2", "checkpoint.keep_every=4"]
    if how == "resume=PATH":
        args.append(f"resume={ckpts / 'step_00000002'}")
    else:
        for step in (4, 6):
            path = ckpts / f"step_{step:08d}" / "__0_0.distcp"
            path.write_bytes(path.read_bytes()[:1000])
    newer = {str(p.relative_to(ckpts)): p.read_bytes() for p in ckpts.rglob("*")
             if p.is_file() and p.parent.name in ("step_00000004", "step_00000006")}
    proc = run_train(tmp_path, *args)
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in proc.stdout, proc.stdout
    # the new saves, kept per keep=2 and keep_every=4; `latest` names the last of them
    assert sorted(p.name for p in ckpts.iterdir() if p.name != "abandoned") == [
        "latest", "step_00000004", "step_00000005", "step_00000006"]
    assert (ckpts / "latest").read_text().strip() == "step_00000006" and latest_state(tmp_path)["step"] == 6
    aside = [line for line in proc.stdout.splitlines() if "abandoned" in line]
    assert len(aside) == 1 and "step_00000004" in aside[0] and "step_00000006" in aside[0], proc.stdout
    # the abandoned ones, byte for byte, in one folder under checkpoints/abandoned/
    (folder,) = (ckpts / "abandoned").iterdir()
    assert folder.name in aside[0]
    assert {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == newer
    assert sorted(train_losses(tmp_path)) == list(range(1, 7)) and summary(tmp_path)["steps"] == 6
    if how == "resume=PATH":  # relaunched with the same command line, the rolled-back run is already complete
        def files():
            paths = [*ckpts.rglob("*"), tmp_path / "metrics.jsonl", tmp_path / "summary.json"]
            return {p: p.read_bytes() for p in paths if p.is_file()}

        before = files()
        proc = run_train(tmp_path, *args)
        assert "already complete at step 6" in proc.stdout, proc.stdout
        assert files() == before


def test_a_resume_after_its_steps_evaluation_was_logged_does_not_evaluate_it_again(tmp_path):
    """A checkpoint is saved before its step's evaluation. Killed after that evaluation was logged (or
    stopped in the step after an asynchronous save, which ends with that save), the resumed run does not
    evaluate and log that step again: metrics.jsonl holds each evaluation once."""
    args = ["train.steps=6", "checkpoint.every=2", "train.eval_every=2", "task.eval_samples=16"]
    proc = start(tmp_path, *args)
    deadline = time.time() + 120
    while not any("eval_loss" in m for m in (metrics(tmp_path) if (tmp_path / "metrics.jsonl").exists() else [])):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.005)
    proc.kill()  # in step 3, after step 2's checkpoint and evaluation
    proc.wait()
    assert latest_state(tmp_path)["step"] == 2 and [m["step"] for m in metrics(tmp_path) if "eval_loss" in m] == [2]
    proc = run_train(tmp_path, *args)
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout, proc.stdout
    assert [m["step"] for m in metrics(tmp_path) if "eval_loss" in m] == [2, 4, 6]
    assert sorted(train_losses(tmp_path)) == list(range(1, 7))


NO_COUNT_TASK = """
from train.tasks.image import ImageClassification

class NoCount(ImageClassification):
    def eval_step(self, model, batch):  # a usage error, found at the first evaluation
        return {k: v for k, v in super().eval_step(model, batch).items() if k != "count"}
"""


def test_an_async_save_that_fails_while_the_run_ends_on_another_error_is_one_more_line(tmp_path):
    """The run's own error (here a task's usage error at the evaluation right after a save) and the failure of
    the save still in flight (a real write error, RLIMIT_FSIZE): each is one line, no traceback, and the
    teardown still runs: the W&B run is closed with its exit code."""
    from tests.processes.test_observability import obs_env, offline_runs, wandb_records

    (tmp_path / "no_count.py").write_text(NO_COUNT_TASK)
    cmd = train_cmd(tmp_path / "run", f"task.name={tmp_path / 'no_count.py'}:NoCount", "train.steps=4",
                    "checkpoint.every=2", "checkpoint.async=true", "train.eval_every=2", "log.wandb.mode=offline")
    limit = 10 << 20  # the DCP file is ~45 MiB; the logs stay far below
    proc = subprocess.run(cmd, cwd=ROOT, env=obs_env(tmp_path), capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 2, errors
    assert 'eval_step() must return a "count"' in proc.stderr
    assert "a checkpoint could not be written; the ones before it are intact" in proc.stderr
    (piece,) = offline_runs(tmp_path / "run")
    exits = [r.exit for r in wandb_records(next(piece.glob("*.wandb"))) if r.WhichOneof("record_type") == "exit"]
    assert [e.exit_code for e in exits] == [1], exits


def test_a_relaunch_with_more_steps_and_other_optimizer_values_applies_them_and_says_so(finished_run, tmp_path):
    """A finished 6-step run relaunched with train.steps=8 and another weight decay and momentum: the two steps
    train with the new values (the checkpoint's hyper-parameters would otherwise win: torch restores them with
    the optimizer's state), and one log line names each change and the learning rate the schedule gives now."""
    run = copy_run(finished_run, tmp_path / "run")
    proc = run_train(run, "checkpoint.every=2", "checkpoint.keep=3", "train.steps=8", "optim.weight_decay=0.002",
                     "optim.momentum=0.8")
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "relaunch with" in line]
    assert len(said) == 1, proc.stdout + proc.stderr
    assert ("relaunch with train.steps 6 -> 8, optim.momentum 0.9 -> 0.8, optim.weight_decay 0.0005 -> 0.002: "
            "applied from step 6; the learning rate is ") in said[0], said[0]
    state = latest_state(run)
    assert state["step"] == 8
    groups = state["optimizer"]["param_groups"]
    assert groups[0]["weight_decay"] == 0.002 and groups[1]["weight_decay"] == 0.0, groups
    assert {g["momentum"] for g in groups} == {0.8}, groups


# Rank by rank, the weights turn NaN in the optimizer step of step K (as one bad batch's inf loss or a learning rate
# too high makes them): a parameter filled with NaN right after that step.
POISON = """
import os, torch
real = module.train_step
def train_step(training, *args, **kwargs):
    loss = real(training, *args, **kwargs)
    if training.state.step == int(os.environ["POISON_AT"]):
        with torch.no_grad():
            if os.environ["POISON"] == "buffer":  # a BatchNorm's statistics, after one forward that overflowed
                next(b for b in training.state.model.buffers() if b.is_floating_point()).fill_(float("inf"))
            else:
                next(training.state.model.parameters()).fill_(float("nan"))
    return loss
module.train_step = train_step
"""


@pytest.mark.parametrize("found", ["weights at a save", "loss at a log", "statistics at a save"])
def test_a_diverged_run_is_never_saved_over_its_good_checkpoints(tmp_path, found):
    """Weights that turned NaN end the run in one line (exit 2: with the same settings a relaunch diverges again)
    before anything is saved from them: found at the next save (a step whose loss was still finite), or at the
    next log (the loss). So do BatchNorm statistics that turned inf (the training loss never sees them). The
    checkpoints stay those of the good steps, retention deletes none of them, and a
    relaunch (here without the cause) resumes from the last and finishes (in the first case, in one process: the
    same resume for all three, and any number of ranks loads it). Two ranks, under the launcher."""
    run_dir = tmp_path / "run"
    poison_at, every = (3, "train.log_every=4") if found == "loss at a log" else (4, "train.log_every=100")
    env = after_import(tmp_path, "train.trainer", POISON) | {"POISON_AT": str(poison_at),
                                                             "POISON": "buffer" if "statistics" in found else "param"}
    overrides = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep=2", every]
    proc = subprocess.run([PY, "-m", "train.launch", "--nproc-per-node=2", "--", "--config", "configs/default.yaml",
                           *TINY, f"run.dir={run_dir}", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    what = ("the training loss of steps 1-4 is nan" if found == "loss at a log"
            else "the model's weights or buffers hold NaN or inf after step 4")
    says = f"error: training diverged: {what}, and nothing is saved from it; lower optim.lr (now "
    assert last.startswith(says), last
    assert last.endswith("then relaunch, which resumes from the checkpoint of step 2 (found by the workers; not "
                         "retried)"), last
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert all(torch.isfinite(t).all() for t in latest_state(run_dir)["model"].values()
               if torch.is_tensor(t) and t.is_floating_point())
    if found == "weights at a save":  # one process: the checkpoint of 2 ranks loads into any number (resharded)
        run_train(run_dir, *overrides)
        assert summary(run_dir)["steps"] == 8 and latest_state(run_dir)["step"] == 8


def test_a_model_whose_own_buffer_holds_inf_from_the_start_trains_and_saves(tmp_path):
    """A buffer that is not finite from the start (an attention mask of -inf) is the model's own, not a divergence:
    the run saves and finishes."""
    patch = ("import torch\nreal = module.build\ndef build(*args, **kwargs):\n    training = real(*args, **kwargs)\n"
             "    training.state.model.register_buffer('mask', torch.full((4,), float('-inf'),\n"
             "                                         device=training.device))\n"
             "    return training\nmodule.build = build\n")
    run_dir = tmp_path / "run"
    run_train(run_dir, "train.steps=4", "checkpoint.every=2", env=after_import(tmp_path, "train.trainer", patch))
    assert summary(run_dir)["steps"] == 4 and torch.isinf(latest_state(run_dir)["model"]["mask"]).all()
