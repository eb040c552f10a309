"""The launcher tells the truth with its exit code whatever signal comes, whenever it comes, and a usage
error found by the workers is said once, never retried.

Real launcher, torchrun and gloo workers, real signals (to the whole process group as a terminal sends
them, to torchrun itself), real files."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PACED, PY, ROOT, TINY, after_import, clean_env, copy_run, latest_state, summary
from tests.procs import (
    children,
    descendants,
    environ,
    finish,
    is_standby,
    kill_family,
    launch,
    logged_steps,
    standbys,
    torchrun,
    wait_for,
    workers,
)
from tests.small_task import gate_reached
from train.launch.forwarding import alive
from train.launch.passthrough import Passthrough

RUNNING = ["train.steps=400"]  # long enough to be stopped in the middle
# One rank, for the tests of how a signal reaches the workers and what the launcher then says: torchrun passes it to
# each worker alike, and a stop's agreement among several ranks is tests/processes/test_stops.py's (here: the stops
# during the first step and during torchrun's second round, a rank's own error among several, a usage error said once)
ONE_RANK = ("--nproc-per-node=1",)


def _stopped_cleanly(run_dir, rc: int, err: str) -> dict:
    """Exit 75 after a checkpoint of the step the STOPPED marker names, without a traceback."""
    assert rc == 75, err[-3000:]
    marker = json.loads((run_dir / "STOPPED").read_text())
    assert marker["step"] == latest_state(run_dir)["step"] >= 2, marker
    assert "Traceback" not in err, err[-3000:]
    return marker


def test_a_hang_up_to_the_whole_process_group_checkpoints_and_exits_75(tmp_path):
    """A dropped SSH session: SIGHUP to the launcher's process group (the launcher and torchrun; torchrun
    passes SIGHUP on to the workers as it came, besides the launcher's SIGTERM). One rank (ONE_RANK)."""
    proc = launch(tmp_path, *RUNNING, launcher=ONE_RANK)
    wait_for(lambda: len(logged_steps(tmp_path)) >= 2, 120, "step 2")
    os.killpg(proc.pid, signal.SIGHUP)
    rc, out, err = finish(proc)
    _stopped_cleanly(tmp_path, rc, err)
    assert err.strip().splitlines()[-1].startswith("launch: stopped on SIGHUP; the workers checkpointed")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_sighup_or_sigquit_to_torchrun_itself_is_a_stop_for_the_workers(tmp_path, sig):
    """torchrun handles TERM, INT, HUP and QUIT by sending the same signal to the workers: each is a stop. One rank
    (ONE_RANK)."""
    proc = launch(tmp_path, *RUNNING, launcher=ONE_RANK)
    wait_for(lambda: len(logged_steps(tmp_path)) >= 2, 120, "step 2")
    os.kill(torchrun(proc.pid), sig)
    rc, out, err = finish(proc)
    assert _stopped_cleanly(tmp_path, rc, err)["signal"] == sig.name


def test_a_run_started_under_nohup_keeps_ignoring_hang_ups(tmp_path):
    """Three hang-ups, each after a step of its own and steps before the end: the run trains on to its end. One rank
    (ONE_RANK): the launcher, torchrun and the worker each keep the ignore they inherited."""
    proc = launch(tmp_path, "train.steps=16", launcher=ONE_RANK, prefix=("nohup",))
    wait_for(lambda: len(logged_steps(tmp_path)) >= 2, 120, "step 2")
    ranks = workers(proc.pid)
    for step in (2, 3, 4):
        wait_for(lambda s=step: proc.poll() is not None or len(logged_steps(tmp_path)) >= s, 120, f"step {step}")
        os.killpg(proc.pid, signal.SIGHUP)  # the launcher and torchrun
        for pid in ranks.values():  # and the workers, as a scheduler signalling every process would
            os.kill(pid, signal.SIGHUP)
    assert len(logged_steps(tmp_path)) < 16  # each hang-up came while the run trained
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    assert summary(tmp_path)["steps"] == 16 and not (tmp_path / "STOPPED").exists()


def _contents(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory (a link: its target) but the launcher's own .launch/, removed as it exits."""
    return {str(p.relative_to(run_dir)): os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
            for p in sorted(run_dir.rglob("*")) if ".launch" not in p.parts and (p.is_file() or p.is_symlink())}


def test_a_stop_during_worker_start_up_is_exit_75_nothing_lost(tmp_path, finished_run):
    """The rule: a stop that reaches the workers before they write STARTED (importing torch, building, resuming)
    found nothing trained since the last checkpoint, so the launcher asks for the relaunch (75), not for a larger
    stop budget (1), and the run directory is left as it was: the same checkpoints and `latest`, the same metrics,
    no STOPPED or STARTED for a resume or the user to misread. The ranks are held in their start-up (building the
    data sets, task.start_gate, tests/small_task.py) until the signal has come: it lands there whatever the
    machine's speed (a busy one imported torch slower, and the signal once landed after STARTED)."""
    run_dir, gate = copy_run(finished_run, tmp_path / "run"), tmp_path / "gate"
    before, files = latest_state(run_dir)["step"], _contents(run_dir)
    proc = launch(run_dir, "train.steps=400", f"task.start_gate={gate}", launcher=("--nproc-per-node=2",))
    wait_for(lambda: proc.poll() is not None or gate_reached(gate, 2), 120, "both ranks in their start-up")
    proc.send_signal(signal.SIGTERM)  # the gate stays shut: the ranks end on the signal, where it found them
    rc, out, err = finish(proc, timeout=120)
    assert rc == 75, err[-3000:]
    assert "before the workers began training" in err.strip().splitlines()[-1], err[-3000:]
    assert latest_state(run_dir)["step"] == before  # nothing new, nothing lost
    assert _contents(run_dir) == files  # nothing written, nothing removed


def test_a_stop_during_the_first_step_ends_with_a_checkpoint_of_it(tmp_path, finished_run):
    """The rule once the workers wrote STARTED (resumed, the stop handler installed): a stop ends with a checkpoint,
    of the step it came in, and the STOPPED marker naming it; exit 75. The ranks are held in their first step's
    micro-step (task.step_gate) until the signal has reached them, so it lands there whatever the machine's speed;
    the stop budget is set far above what the step and the save need on any machine (--stop-timeout=200: the
    budget's own rule is tests/test_stops.py's), so that a busy machine cannot turn this run into exit 1."""
    run_dir, gate = copy_run(finished_run, tmp_path / "run"), tmp_path / "gate"
    before = latest_state(run_dir)["step"]
    proc = launch(run_dir, "train.steps=400", f"task.step_gate={gate}",
                  launcher=("--nproc-per-node=2", "--stop-timeout=200"))
    wait_for(lambda: proc.poll() is not None or gate_reached(gate, 2), 120, "both ranks in their first step")
    assert json.loads((run_dir / "STARTED").read_text())["step"] == before
    proc.send_signal(signal.SIGTERM)  # each rank leaves the gate when the signal reaches it
    rc, out, err = finish(proc)
    marker = _stopped_cleanly(run_dir, rc, err)
    assert marker["step"] == before + 1 == latest_state(run_dir)["step"], marker
    assert err.strip().splitlines()[-1].startswith("launch: stopped on SIGTERM; the workers checkpointed"), err[-3000:]
    assert logged_steps(run_dir)[-1] == before + 1


def test_a_stop_during_the_doctor_is_exit_75_and_training_never_starts(tmp_path):
    env = clean_env(LAUNCH_DOCTOR="1")
    proc = launch(tmp_path, "train.steps=400", env=env)
    wait_for(lambda: workers(proc.pid), 60, "the doctor's workers")
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    assert "before training started" in err.strip().splitlines()[-1], err[-3000:]
    assert " -m train " not in err.replace("train.doctor", "")  # the training's torchrun never started
    assert not (tmp_path / "metrics.jsonl").exists()


# How the launcher's last line names a rank killed by SIGKILL (a regular expression)
KILLED = r"was killed by signal 9 \(SIGKILL: most often the out-of-memory killer; `dmesg` or the pod's status says\)"


def _usage_cases(tmp_path) -> dict:
    return {
        "data path": (["task.data=cifar10", f"task.path={tmp_path / 'nowhere'}"], {}, "does not exist"),
        "CUDA unusable": ([], {"CUDA_VISIBLE_DEVICES": "0"}, "GPUs were allocated (CUDA_VISIBLE_DEVICES=0)"),
        "W&B without a key": (["log.wandb.mode=online"], {"HOME": str(tmp_path), "WANDB_API_KEY": ""}, "API key"),
        "no loadable checkpoint": ([f"resume={tmp_path / 'broken'}"], {}, "no loadable checkpoint"),
    }


# One error of each place in a worker's start where one is found (the same on every rank): before the process
# group (the device), after it on rank 0's word (the tracker), while building (the data; resume=never over a
# run is found there too: test_stops.py), and resuming, where the trainer's stop handler is installed (another
# model is refused there too: test_resume.py).
@pytest.mark.parametrize("case", ["CUDA unusable", "W&B without a key", "data path", "no loadable checkpoint"])
def test_a_usage_error_found_by_the_workers_is_exit_2_once_not_retried(tmp_path, finished_run, case):
    overrides, extra_env, says = _usage_cases(tmp_path)[case]
    run_dir = tmp_path / "run"
    if case == "no loadable checkpoint":  # a checkpoint whose bytes fail their CRC
        copy_run(finished_run / "checkpoints", tmp_path / "broken")
        for shard in (tmp_path / "broken").glob("step_*/__*.distcp"):
            shard.write_bytes(b"\0" * shard.stat().st_size)
    env = {k: v for k, v in clean_env(**extra_env).items() if v != ""}
    proc = launch(run_dir, *overrides, launcher=("--nproc-per-node=2", "--max-restarts=3"), env=env)
    rc, out, err = finish(proc, timeout=180)
    last = err.strip().splitlines()[-1]
    assert rc == 2, err[-3000:]
    assert last.startswith("error: ") and says in last and last.endswith("(found by the workers; not retried)"), last
    # Said once, in the launcher's last line: not by each rank as well (nor by the tries of torchrun's restarts).
    said = [line for line in (out + err).splitlines() if says in line]
    assert said == [last], (said, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    # A refused start writes nothing, as `python -m train` alone: the ranks' logs and the launch's markers went with
    # the run directory they made.
    assert not run_dir.exists(), sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))


def test_a_start_refused_under_the_launcher_leaves_a_users_folder_as_it_was(tmp_path):
    """run.dir naming a folder of the user's that holds a file a run writes (config.yaml) is refused by rank 0;
    the launcher says it once and leaves the folder holding what it held (no logs/, no .launch/)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text("lr: 3\n")
    (folder / "notes").mkdir()
    proc = launch(folder, launcher=("--nproc-per-node=2",))
    rc, out, err = finish(proc, timeout=180)
    assert rc == 2 and "holds no run of this project" in err.strip().splitlines()[-1], err[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "notes"]
    assert (folder / "config.yaml").read_text() == "lr: 3\n"


# Rank 0 alone meets a usage error at run time (a bad sample only it reads), held first at its first step; rank 1
# waits for it in the step's all-reduce, which fails once rank 0 tears its process group down.
ONE_RANK_S_USAGE_ERROR = """
import os, time
from pathlib import Path
from train.errors import ConfigError
real = module.train_step
def train_step(training, *args, **kwargs):
    if os.environ["RANK"] == "0":
        gate = Path(os.environ["GATE"])
        Path(f"{gate}.0").touch()
        while not gate.exists():
            time.sleep(0.05)
        raise ConfigError("task.path: sample 3 is not a readable image: remove or replace it")
    return real(training, *args, **kwargs)
module.train_step = train_step
"""


def test_one_rank_s_usage_error_is_one_line_even_where_torchrun_ends_first_on_its_peer(tmp_path):
    """Rank 1, left without its peer, fails at once ("a peer rank's connection broke"), and torchrun may end on
    that failure, with its own traceback (ChildFailedError), before the launcher has seen rank 0's USAGE_ERROR
    marker and stopped it: a race the launcher lost about two runs in fifteen. Here it loses every time: the launcher
    is held (SIGSTOP) from before rank 0's error until torchrun has ended. Still exit 2 and the usage error's one
    line, the last, said once; no traceback."""
    gate, says = tmp_path / "gate", "task.path: sample 3 is not a readable image: remove or replace it"
    env = after_import(tmp_path, "train.trainer", ONE_RANK_S_USAGE_ERROR) | {"GATE": str(gate)}
    proc = launch(tmp_path / "run", "train.steps=3", env=env, paced=False)
    agent = torchrun(proc.pid)
    wait_for(lambda: proc.poll() is not None or Path(f"{gate}.0").exists(), 120, "rank 0 at its first step")
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        gate.touch()
        wait_for(lambda: not alive(agent), 120, "torchrun's end, the launcher held")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    rc, out, err = finish(proc)
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == f"error: {says} (found by the workers; not retried)", err[-3000:]
    assert [line for line in (out + err).splitlines() if says in line] == [last], err[-3000:]
    assert "[rank 1] error: a peer rank's connection broke" in err, err[-3000:]  # the race was run
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    # It came after the run began: the ranks' logs stay, with rank 0's line
    assert says in (tmp_path / "run" / "logs" / "rank0.log").read_text()


def test_a_bad_task_key_is_one_line_and_exit_2_before_any_worker_starts(tmp_path):
    """The task's keys are checked in torchrun's process (train/launch/torchrun.py), before torchrun starts a
    worker: exit 2 and one line, which the launcher passes on and adds nothing to; nothing is written."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([PY, "-m", "train.launch", "--nproc-per-node=2", "--", "--config", "configs/default.yaml",
                           *TINY, "task.image_sise=16", f"run.dir={run_dir}"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "'task.image_sise' (did you mean 'task.image_size'" in errors[0], errors
    assert proc.stderr.strip().splitlines()[-1] == errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not run_dir.exists()


def test_a_killed_loader_worker_is_named_whatever_wording_torch_uses(tmp_path):
    """torch says `DataLoader worker (pid(s) N) exited unexpectedly` when the worker dies while the main
    process waits for its batch; the signal is only in the exception's cause."""
    script = tmp_path / "kill_loader.py"
    script.write_text(
        "import os, signal, threading, time, torch\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "from train.parallel.distributed import describe_failure\n"
        "class Slow(Dataset):\n"
        "    def __len__(self): return 100\n"
        "    def __getitem__(self, i): time.sleep(0.3 if i else 0); return torch.zeros(1)\n"
        "it = iter(DataLoader(Slow(), batch_size=1, num_workers=1))\n"
        "next(it)\n"
        "worker = next(iter(it._workers)).pid\n"
        "threading.Timer(0.1, os.kill, (worker, signal.SIGKILL)).start()\n"
        "try:\n"
        "    [next(it) for _ in range(99)]\n"
        "except RuntimeError as e:\n"
        "    print('TOP:', e)\n"
        "    print('LINE:', describe_failure(e, 600))\n")
    proc = subprocess.run([PY, str(script)], cwd=ROOT, env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    assert "exited unexpectedly" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "LINE: a DataLoader worker was killed (Killed; often the out-of-memory killer)" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]


# Rank 0 (it hosts the store the ranks share) fails at once in its first batch; rank 1 is held 3 s, then meets a
# peer that is gone: its store and its collective fail too, in words (DistNetworkError, "Connection was likely
# closed") that read like an unreachable rendezvous.
OWN_ERRORS = {
    "in the training step": ("train.trainer", """
import os, time
real = module.train_step
def train_step(training, *args, **kwargs):
    if os.environ["RANK"] == "0":
        raise RuntimeError("boom: a bug in the user's model")
    time.sleep(3)
    return real(training, *args, **kwargs)
module.train_step = train_step
""", "RuntimeError: boom: a bug in the user's model"),
    "in a loader worker": ("train.parallel.data", """
import os, time
real = module.SeededSamples._seeded
def _seeded(self, index, epoch):
    if os.environ["RANK"] == "0":
        raise ValueError(f"sample {index} does not parse")
    if not getattr(module, "held", False):  # the worker's first sample only (a batch of 3 s samples took 24 s)
        module.held = True
        time.sleep(3)
    return real(self, index, epoch)
module.SeededSamples._seeded = _seeded
""", "ValueError: sample "),
}


@pytest.mark.parametrize("where", OWN_ERRORS)
def test_the_last_line_names_the_failing_rank_s_own_error_not_what_the_others_ran_into(tmp_path, where):
    """A bug on one rank at its first batch: the launcher's last line is that rank's exception line (from its
    FAILED marker), never a rendezvous nobody had trouble with (issue 49), nor only an exit code. The rank's
    traceback is shown; torchrun's own (ChildFailedError), whose "root cause" may be the peer the bug left behind,
    is not."""
    module, patch, error = OWN_ERRORS[where]
    env = after_import(tmp_path, module, patch)
    rc, out, err = finish(launch(tmp_path / "run", "train.steps=3", "data.num_workers=1", env=env, paced=False))
    assert rc == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: rank 0 failed: {error}") and last.endswith("(its traceback is above)"), \
        err[-3000:]
    assert "rendezvous" not in last
    assert error in err[:-len(last)] and "ChildFailedError" not in err and "Root Cause" not in err, err[-3000:]


# torch's own words for a GPU out of memory (torch.OutOfMemoryError, one line), raised by rank 0 at its second step
OUT_OF_MEMORY = """
import os, torch
real = module.train_step
def train_step(training, *args, **kwargs):
    if os.environ.get("RANK", "0") == "0" and training.state.step == 1:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1.53 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.20 GiB "
            "is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the allocated memory "
            "75.10 GiB is allocated by PyTorch, and 1.30 GiB is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    return real(training, *args, **kwargs)
module.train_step = train_step
"""


@pytest.mark.parametrize("launcher", [True, False], ids=["launcher", "alone"])
def test_a_gpu_out_of_memory_is_one_line_with_the_settings_that_fix_it(tmp_path, launcher):
    """torch's out-of-memory error, as it words it: the last line says where (step 2), what torch tried to allocate
    and held, and what lowers a step's memory (the micro-batch, activation checkpointing, FSDP); its traceback,
    which says where in the step, is in the rank's log file, not on the console. Exit 1, not a usage error."""
    env = after_import(tmp_path, "train.trainer", OUT_OF_MEMORY)
    run_dir = tmp_path / "run"
    if launcher:
        rc, out, err = finish(launch(run_dir, "train.steps=4", env=env, paced=False))
    else:
        proc = subprocess.run([PY, "-m", "train", "--config", "configs/default.yaml", *TINY, "train.steps=4",
                               f"run.dir={run_dir}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        rc, err = proc.returncode, proc.stderr
    assert rc == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    log = run_dir / "logs" / "rank0.log"
    says = ("out of GPU memory at step 2 (tried to allocate 1.53 GiB, 77.90 GiB of 79.19 GiB in use by this "
            "process): lower train.micro_batch_size (now 8; train.global_batch_size stays, by more micro-batches a "
            "step), train in bf16 (train.precision=bf16), set train.activation_checkpointing=true, or shard the model "
            "over the GPUs with dist.strategy=fsdp")
    assert last == (f"error: rank 0 failed: {says} (its traceback: {log})" if launcher
                    else f"error: {says} (its traceback: {log})"), err[-3000:]
    assert [line for line in err.splitlines() if "out of GPU memory" in line] == [last], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "Traceback (most recent call last)" in log.read_text() and "in train_step" in log.read_text()


def test_an_out_of_memory_before_training_is_said_once_with_its_traceback(tmp_path):
    """Out of memory while the model is built (no log file yet): the launcher says it once, its traceback is shown
    above it."""
    patch = ("import torch\ndef build(*args, **kwargs):\n"
             "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 9.00 GiB.')\n"
             "module.build = build\n")
    rc, out, err = finish(launch(tmp_path / "run", env=after_import(tmp_path, "train.trainer", patch), paced=False,
                                 launcher=("--nproc-per-node=1",)))
    last = err.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("error: rank 0 failed: out of GPU memory before training began (tried to "
                                       "allocate 9.00 GiB)") and last.endswith("(its traceback is above)"), err[-3000:]
    assert [line for line in err.splitlines() if "out of GPU memory" in line] == [last], err[-3000:]
    assert "Traceback (most recent call last)" in err and "in build" in err, err[-3000:]


# torch's out-of-memory error raised at step 2 by the evaluation (its first, after step 2) or by the checkpoint save,
# the one that step 2 also evaluates after: what the line names, and the latest checkpoint left
@pytest.mark.parametrize("target, when, says, latest", [
    ("module.Evaluation.run", "True", "in the evaluation after step 2", "step_00000002"),
    ("module.Checkpointer.save", "any(type(a).__name__ == 'TrainState' and a.step == 2 for a in args)",
     "in the checkpoint save of step 2", "step_00000001"),
], ids=["evaluation", "save"])
def test_an_out_of_memory_in_an_evaluation_or_a_save_says_which(tmp_path, target, when, says, latest):
    """Told as that evaluation's or that save's, not as step 3's; the checkpoints before it stay."""
    patch = (f"import torch\nreal = {target}\ndef raising(*args, **kwargs):\n"
             f"    if {when}:\n"
             "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB.')\n"
             f"    return real(*args, **kwargs)\n{target} = raising\n")
    env = after_import(tmp_path, "train.trainer", patch)
    proc = subprocess.run([PY, "-m", "train", "--config", "configs/default.yaml", *TINY, "train.steps=4",
                           "checkpoint.every=1", "train.eval_every=2", f"run.dir={tmp_path / 'run'}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(f"error: out of GPU memory {says} ("), proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == latest


REAL_OUT_OF_MEMORY = """
import torch
real = module.train_step
def train_step(training, *args, **kwargs):
    if training.state.step == 1:  # twice the GPU's memory, at once
        torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda")
    return real(training, *args, **kwargs)
module.train_step = train_step
"""


@pytest.mark.gpu
def test_gpu_a_real_out_of_memory_is_read_as_one(tmp_path):
    """On a GPU, torch's own out-of-memory error (its wording, this torch's) is read: the one line says so, with
    the size torch tried to allocate."""
    env = after_import(tmp_path, "train.trainer", REAL_OUT_OF_MEMORY)
    proc = subprocess.run([PY, "-m", "train", "--config", "configs/default.yaml", *TINY, "train.steps=4",
                           f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("error: out of GPU memory at step 2 (tried to allocate "), \
        proc.stderr[-3000:]


def test_a_rank_killed_mid_run_is_named_not_the_rendezvous_its_peers_then_cannot_reach(tmp_path):
    """Rank 0, which hosts the store the ranks share, SIGKILLed after step 2 (the out-of-memory killer): rank 1
    then fails to reach that store (DistNetworkError, "Connection was likely closed"), which is not a rendezvous
    to blame once training began; the last line names the rank torchrun saw end first."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *RUNNING)
    wait_for(lambda: len(logged_steps(run_dir)) >= 2, 120, "step 2")
    os.kill(workers(proc.pid)[0], signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    crash = (r"error: rank [01] on \S+ (" + KILLED + r"|exited with code 1), and torchrun gave up after 0 "
             r"restart\(s\) \(--max-restarts=0\); see its log in the run directory")
    assert re.fullmatch(crash, last), err[-3000:]
    assert "Root Cause (first observed failure)" in err, err[-3000:]  # torchrun's report, where the line comes from


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether a process has a handler installed for `sig` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (sig - 1) & 1)


def test_the_launcher_as_pid_1_stops_on_a_sigterm_before_torchrun_starts(tmp_path):
    """As a container's PID 1 (docker run, a pod), a signal whose action is the default is dropped by the
    kernel: the launcher's handler must be there from its first line, not only once torchrun runs. The pod
    waits for its rendezvous host (a name that never resolves): torchrun never starts."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare (a PID namespace)")
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", PY, "-m", "train.launch", "--nnodes=2",
           "--nproc-per-node=2", "--rdzv-endpoint=no-such-host.invalid:29400", "--", "--config",
           "configs/default.yaml", *TINY, "train.global_batch_size=32", f"run.dir={tmp_path}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    launcher = wait_for(lambda: next(iter(children(proc.pid)), None), 30, "the launcher")
    wait_for(lambda: _catches(launcher, signal.SIGTERM), 30, "the launcher's handler")
    os.kill(launcher, signal.SIGTERM)
    rc, out, err = finish(proc, timeout=120)
    assert rc == 75, err[-3000:]
    assert "before training started" in err.strip().splitlines()[-1], err[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_ctrl_c_to_make_train_local_s_whole_foreground_group_checkpoints(tmp_path):
    """Ctrl-C in a terminal: SIGINT to make, the launcher and torchrun at once (the workers, in sessions of
    their own, hear of it from torchrun and the launcher). One rank (ONE_RANK)."""
    args = " ".join([*TINY, *PACED, f"run.dir={tmp_path}", "train.steps=400"])
    proc = subprocess.Popen(["make", "--no-print-directory", "train-local", "NPROC=1", f"ARGS={args}"], cwd=ROOT,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for(lambda: len(logged_steps(tmp_path)) >= 2, 180, "step 2")
    os.killpg(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc)
    assert "launch: stopped on SIGINT; the workers checkpointed: relaunch to continue (exit 75)" in err, err[-3000:]
    marker = json.loads((tmp_path / "STOPPED").read_text())
    assert marker["step"] == latest_state(tmp_path)["step"] >= 2
    assert "Traceback" not in err, err[-3000:]


# A process that logs as torchrun does, with torchrun's stop handler, and whose log call a stop signal lands
# in every time (what a second stop signal does one time in many: Ctrl-C reaches torchrun and the launcher,
# which passes it on). `logging` catches the SignalException and prints a "--- Logging error ---" block.
SIGNAL_IN_A_LOG_CALL = """
import logging, os, signal, sys
from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

signal.signal(signal.SIGTERM, _terminate_process_handler)

class Handler(logging.StreamHandler):
    def format(self, record):
        if record.args and record.args[-1] == "SIGINT":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here, inside emit()
        return super().format(record)

log = logging.getLogger("torchrun")
log.addHandler(Handler(sys.stderr))
print("before", file=sys.stderr, flush=True)
log.warning("Sending process %s closing signal %s", 1234, "SIGINT")
log.warning("Sending process %s closing signal %s", 1235, "SIGTERM")
log.warning("a record that cannot be formatted %s %s", 1)  # a logging error of another kind: shown
print("after", file=sys.stderr, flush=True)
"""


def test_a_stop_signal_inside_torchrun_s_log_call_is_not_shown_as_a_traceback():
    raw = subprocess.run([PY, "-c", SIGNAL_IN_A_LOG_CALL], env=clean_env(), capture_output=True, text=True).stderr
    assert raw.count("--- Logging error ---") == 2 and "SignalException" in raw, raw
    out = io.StringIO()
    passthrough = Passthrough(out)  # the launcher's filter of torchrun's stderr
    for line in raw.splitlines(keepends=True):
        passthrough.feed(line)
    passthrough.close()
    passed = out.getvalue()
    lines = passed.splitlines()
    assert lines[0] == "before" and lines[-1] == "after", passed
    assert "Sending process 1235 closing signal SIGTERM" in lines and "1234" not in passed, passed
    assert "SignalException" not in passed and passed.count("Traceback") == 1, passed
    assert "a record that cannot be formatted" in passed and "--- Logging error ---" in passed, passed


def _round_two(proc, first: dict[int, int]) -> dict[int, int]:
    """The workers of torchrun's second round: every rank of the first, none of them the first round's."""
    def restarted():
        found = workers(proc.pid)
        return found if len(found) == len(first) and not set(found.values()) & set(first.values()) else None

    return wait_for(restarted, 120, "the restarted workers")


def _round_one(run_dir, sig: signal.Signals, *overrides, env=None, ranks: int = 2):
    """Round 1 trains to step 2 and gets `sig` on its last rank alone (of 2: one node's kubelet, one srun task;
    SIGKILL: a crash), then torchrun restarts the group (--max-restarts=1). Returns the launch and round 2's
    workers."""
    proc = launch(run_dir, "train.steps=400", *overrides, launcher=(f"--nproc-per-node={ranks}", "--max-restarts=1"),
                  env=env)
    wait_for(lambda: len(logged_steps(run_dir)) >= 2, 120, "step 2")
    first = wait_for(lambda: w if len(w := workers(proc.pid)) == ranks else None, 60, "round 1's workers")
    os.kill(first[ranks - 1], sig)
    return proc, _round_two(proc, first)


def test_a_crash_after_torchrun_restarted_a_stopped_round_is_exit_1_not_75(tmp_path):
    """Round 1 stopped on one rank's SIGTERM and saved (exit 75, which torchrun restarts as a failure); round
    2 trains past it and crashes with no restart left: the steps since are lost, so the launcher says the
    crash (1), not round 1's stop (75: the scheduler would requeue it for ever without counting). Nor is
    the STOPPED marker of another launch taken for this one's, though it is dated in the future (another
    node's clock ahead of this one's)."""
    # LAUNCH_STANDBY=0: round 2's workers are started afresh, no standby beside either round
    proc, second = _round_one(tmp_path, signal.SIGTERM, env=clean_env(LAUNCH_STANDBY="0"))
    assert all(environ(p).get("TORCHELASTIC_RESTART_COUNT") == "1" for p in second.values()), second
    assert not [p for p in children(torchrun(proc.pid)) if is_standby(p)]
    stopped = json.loads((tmp_path / "STOPPED").read_text())["step"]
    wait_for(lambda: logged_steps(tmp_path).count(stopped + 2) == 1, 120, "a step of round 2")
    stale = {"step": stopped, "signal": "SIGTERM", "time": time.time() + 3600, "launch_id": "an-earlier-launch"}
    (tmp_path / "STOPPED").write_text(json.dumps(stale))
    os.kill(second[1], signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 1, err[-3000:]
    # One line, the last: torchrun names the rank it takes for the root cause, the killed rank 1, or rank 0, whose
    # next collective failed in the same instant (seen in CI); either way the crash, not round 1's stop, and the
    # restarts spent
    last = err.strip().splitlines()[-1]
    crash = (r"error: rank [01] on \S+ (" + KILLED + r"|exited with code 1), and torchrun gave up after 1 "
             r"restart\(s\) \(--max-restarts=1\); see its log in the run directory")
    assert re.fullmatch(crash, last), err[-3000:]


def test_torchrun_s_standbys_end_when_its_process_is_killed(tmp_path):
    """With a restart left, torchrun's process keeps a standby a local rank, named train-standby for `ps`
    (train/launch/standby.py). Killed outright (the OOM killer, a SIGKILL), it cannot end them: they see its pipe
    close, and exit."""
    proc = launch(tmp_path, "train.steps=400", launcher=("--nproc-per-node=2", "--max-restarts=1"))
    family = []
    try:
        agent = torchrun(proc.pid)
        waiting = wait_for(lambda: s if len(s := standbys(agent)) == 2 else None, 120, "two standbys")
        wait_for(lambda: all(_name(p) == "train-standby" for p in waiting), 30, "the standbys' names")
        family = descendants(agent)  # the workers outlive it: ended below
        os.kill(agent, signal.SIGKILL)
        wait_for(lambda: not [p for p in waiting if _name(p) == "train-standby"], 30, "the standbys' end")
    finally:
        kill_family(proc.pid)
        for p in family:
            kill_family(p)
        finish(proc, 60)


def test_a_standby_whose_imports_are_not_done_when_its_round_comes_starts_afresh_where_priorities_cannot_rise(
        tmp_path):
    """A standby imports on a thread of the lowest priority. Its round come, a process without CAP_SYS_NICE (most
    users of a cluster) cannot raise that thread again, and on busy cores the imports left would hold the round for
    minutes. Here they never end (held in the standbys' import of the trainer): each standby starts afresh as its
    rank's worker (the same process, exec'd), and the run ends."""
    env = after_import(tmp_path, "train.trainer", """
import threading, time
if threading.current_thread().name == "standby-preload":
    time.sleep(3600)""")
    run_dir = tmp_path / "run"
    without_nice = ("setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice")
    proc = launch(run_dir, "train.steps=12", launcher=("--nproc-per-node=2", "--max-restarts=1"), env=env,
                  prefix=without_nice)
    try:
        wait_for(lambda: len(logged_steps(run_dir)) >= 2, 120, "step 2")
        first = workers(proc.pid)
        waiting = wait_for(lambda: s if len(s := standbys(torchrun(proc.pid))) == 2 else None, 60, "two standbys")
        os.kill(first[1], signal.SIGKILL)
        second = _round_two(proc, first)
        assert sorted(second.values()) == sorted(waiting)
        rc, out, err = finish(proc, 120)
    finally:
        kill_family(proc.pid)
    assert rc == 0, err[-3000:]
    assert summary(run_dir)["steps"] == 12


def _name(pid: int) -> str:
    """A process's name (its comm), "" once it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return "" if stat.rsplit(")", 1)[1].split()[0] in "ZX" else stat[stat.index("(") + 1:stat.rindex(")")]


def test_a_stop_during_the_start_up_of_torchrun_s_second_round_is_exit_75(tmp_path):
    """Round 1 trained (its STARTED marker) and crashed; round 2's workers are still starting (held there)
    when the launcher is stopped: nothing was trained since the last checkpoint, so 75, not 1 (`raise
    STOP_TIMEOUT`, read from round 1's marker). One rank: its crash, its standby held."""
    # Round 2 never gets past its start-up: held when it calls the trainer (a standby, which imported the trainer
    # before its round, reads the round's variables only then)
    env = after_import(tmp_path, "train.trainer", """
import os, time
run = module.run
def held(*args, **kwargs):
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
        time.sleep(300)
    return run(*args, **kwargs)
module.run = held""")
    run_dir = tmp_path / "run"
    proc, second = _round_one(run_dir, signal.SIGKILL, "checkpoint.every=1", env=env, ranks=1)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    assert "before the workers began training" in err.strip().splitlines()[-1], err[-3000:]


def test_launches_in_a_row_that_fail_without_advancing_the_step_end_in_exit_2(tmp_path):
    """A worker that crashes at its start (a bad node, a data file) would be requeued or recreated for ever:
    the launch that makes MAX_FAILED_LAUNCHES in a row, all from the same checkpoint step, exits 2 with one
    line naming the step and the last failure. A launch that advanced the step, even one that then failed,
    starts the count again."""
    env = after_import(tmp_path, "train.stops.markers", """
import os
if os.environ.get("CRASH") == "start" and "RANK" in os.environ:  # a worker, not the launcher
    raise RuntimeError("a worker that crashes at its start")
if os.environ.get("CRASH") == "end":
    def finished(self, step):
        raise RuntimeError("a crash after the last save")
    module.Markers.finished = finished
""")
    run_dir = tmp_path / "run"

    def relaunch(crash: str, steps: int) -> tuple[int, str]:
        proc = launch(run_dir, f"train.steps={steps}", launcher=("--nproc-per-node=1",),
                      env=env | {"CRASH": crash, "MAX_FAILED_LAUNCHES": "2"})
        rc, out, err = finish(proc)
        return rc, err.strip().splitlines()[-1]

    assert relaunch("start", 2)[0] == 1  # the first at step 0
    assert relaunch("end", 2)[0] == 1  # it trained to a checkpoint at step 2 before it failed: not counted
    assert latest_state(run_dir)["step"] == 2
    rc, first = relaunch("start", 4)
    assert rc == 1 and first.startswith("error: rank 0 on "), first
    rc, last = relaunch("start", 4)
    assert rc == 2, last
    assert last == (f"error: 2 launches in a row failed without advancing the checkpoint past step 2 (the last: "
                    f"{first.removeprefix('error: ')}): not retried (exit 2); fix the cause and relaunch, or raise "
                    f"--max-failed-launches (MAX_FAILED_LAUNCHES)"), last
