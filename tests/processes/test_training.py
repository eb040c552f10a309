"""The training core on real processes: DDP averaging, accumulation, precision, evaluation, learning."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    GROUPNORM,
    TINY,
    after_import,
    after_imports,
    assert_trained_alike,
    copy_run,
    latest_state,
    run_train,
    summary,
)
from train import config
from train.parallel import data

# Two ranks x 8 traced by the profiler for two steps (which changes no number): the all-reduce count.
TRACED = ["profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=2"]


@pytest.fixture(scope="module")
def groupnorm_runs(tmp_path_factory):
    """The runs the averaging tests compare against, made once: one process with the whole batch of 16
    ("whole"), and 2 ranks x 8 under the profiler ("two")."""
    runs = tmp_path_factory.mktemp("groupnorm")
    run_train(runs / "whole", *GROUPNORM, "train.micro_batch_size=16")
    run_train(runs / "two", *GROUPNORM, *TRACED, nproc=2)
    return runs


def test_ddp_two_ranks_equal_one_process_with_the_whole_batch(groupnorm_runs):
    one, two = groupnorm_runs / "whole", groupnorm_runs / "two"
    assert summary(one)["world_size"] == 1 and summary(two)["world_size"] == 2
    assert_trained_alike(latest_state(one)["model"], latest_state(two)["model"])
    assert summary(two)["ranks_in_sync"] is True  # every rank ends with bitwise the same weights


def test_gradient_accumulation_equals_a_larger_batch(tmp_path, groupnorm_runs):
    accum = tmp_path / "accum"
    run_train(accum, *GROUPNORM, "train.micro_batch_size=4")  # 4 micro-steps of 4
    assert_trained_alike(latest_state(groupnorm_runs / "whole")["model"], latest_state(accum)["model"])


def _all_reduces(run_dir) -> int:
    """gloo all-reduces in rank 0's profiler trace (the traced steps: DDP's buckets plus our own few)."""
    (trace,) = (run_dir / "profile").glob("rank0.*.json")
    return sum(e.get("name") == "gloo:all_reduce" for e in json.loads(trace.read_text())["traceEvents"])


def test_accumulation_skips_the_all_reduce_with_two_ranks(tmp_path, groupnorm_runs):
    """2 ranks x 2 micro-steps x 4 all-reduce the gradients once per step, like 2 ranks x 1 x 8: the first
    micro-step runs under no_sync (counted in the profiler's trace of two steps; the final weights of
    the two would be equal either way)."""
    plain, accum = groupnorm_runs / "two", tmp_path / "accum"
    run_train(accum, *GROUPNORM, *TRACED, "train.micro_batch_size=4", nproc=2)
    assert _all_reduces(plain) >= 4 and _all_reduces(accum) == _all_reduces(plain)


def _traced_ops(run_dir) -> list[tuple[str, list]]:
    """(op name, input types) of rank 0's traced steps, in the order they ran."""
    (trace,) = (run_dir / "profile").glob("rank0.*.json")
    events = sorted((e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"),
                    key=lambda e: e["ts"])
    return [(e["name"], e.get("args", {}).get("Input type", [])) for e in events]


@pytest.mark.parametrize("precision,dtype", [("bf16", "c10::BFloat16"), ("fp16", "c10::Half")])
def test_autocast_computes_in_the_precision_asked_and_clips_unscaled_gradients(tmp_path, precision, dtype):
    """On 2 ranks under FSDP: the convolutions really run in bf16/fp16 (the profiler records their input types),
    the parameters are all-gathered in that dtype too (FSDP's MixedPrecisionPolicy: half the traffic; BatchNorm's
    in fp32, beside its fp32 statistics, which torch's batch_norm does not mix with bf16 weights), while
    the gradients are reduce-scattered and kept in fp32, as the weights the checkpoint holds; and the gradients
    are clipped only after the loss scaler divided them back (fp16: clipping the scaled gradients to 1.0 would
    shrink every step by the scale, 65536)."""
    traced = ["profile.enabled=true", "profile.wait=1", "profile.warmup=0", "profile.active=1"]
    tiny = ["task.image_size=8", "train.steps=3"]  # half-precision convolutions are slow on CPU
    run_train(tmp_path, f"train.precision={precision}", "train.grad_clip=1.0", "dist.strategy=fsdp", *traced, *tiny,
              nproc=2)
    s = summary(tmp_path)
    assert s["precision"] == precision and math.isfinite(s["train_loss"]) and math.isfinite(s["eval_loss"])
    ops = _traced_ops(tmp_path)
    convs = [types[0] for name, types in ops if name == "aten::convolution"]
    assert convs and all(t == dtype for t in convs), convs  # forward and backward
    gathers = [types[0] for name, types in ops if name == "c10d::_allgather_base_"]
    scatters = [types[0] for name, types in ops if name == "c10d::_reduce_scatter_base_"]
    assert set(gathers) == {dtype, "float"}, gathers  # float: the BatchNorm layers' own units
    assert scatters and all(t == "float" for t in scatters), scatters
    assert all(v.dtype == torch.float32 for v in latest_state(tmp_path)["model"].values() if v.is_floating_point())
    names = [name for name, _ in ops]
    assert "aten::_foreach_norm" in names  # clip_grad_norm_ ran
    if precision == "fp16":
        assert names.index("aten::_amp_foreach_non_finite_check_and_unscale_") < names.index("aten::_foreach_norm")


# 201 evaluation samples (an odd count: one rank's shard holds a sample more) and a model that learns in 12 steps
EVALUATED = [*GROUPNORM, "task.eval_samples=201", "optim.lr=0.05"]


def test_eval_accuracy_is_all_reduced_over_every_rank(quiet_ddp):
    """The reported accuracy is that of the whole eval set, recomputed here from the final weights (2 ranks, 12 steps:
    the quiet-step test's DDP run, quiet_ddp)."""
    tmp_path = quiet_ddp / "run"
    assert summary(tmp_path)["steps"] == 12 and latest_state(tmp_path)["step"] == 12
    cfg = config.load("configs/default.yaml", [*TINY, "task.eval_samples=201", *GROUPNORM])  # the run's task
    task = cfg.task_class(cfg.task, cfg.seed)
    eval_set = data.SeededSamples(task.datasets()[1], cfg.seed)
    net = task.model()
    net.load_state_dict(latest_state(tmp_path)["model"])
    net.eval()
    correct = []
    with torch.no_grad():
        for i in range(len(eval_set)):
            x, y = eval_set[(i, 0)]
            correct.append(int(net(task.pixels(x[None])).argmax(1).item() == y))  # uint8 pixels, normalized
    whole = sum(correct) / len(correct)
    rank0_shard = sum(correct[0::2]) / len(correct[0::2])
    assert summary(tmp_path)["eval_accuracy"] == pytest.approx(whole, abs=1.5 / len(correct))
    assert len(correct) == 201
    # a count over exactly the 201 samples: not rank 0's 101 alone, nor 202 with a sample padded in
    acc = summary(tmp_path)["eval_accuracy"]
    assert 0 < acc < 1 and acc == round(acc * 201) / 201, acc
    print(f"whole set {whole:.3f}, rank 0's shard alone {rank0_shard:.3f}")


def test_run_directory_holds_what_a_user_needs(finished_two_ranks):
    run = finished_two_ranks  # 2 ranks, 6 steps
    assert (run / "config.yaml").exists() and (run / "run_info.json").exists()
    assert (run / "logs" / "rank0.log").exists() and (run / "logs" / "rank1.log").exists()
    s = summary(run)
    assert {"steps", "world_size", "train_loss", "eval_loss", "eval_accuracy", "samples_per_s", "wall_s"} <= s.keys()
    info = (run / "run_info.json").read_text()
    assert '"torch"' in info and '"git_commit"' in info and '"hardware"' in info
    loaded = config.load(str(run / "config.yaml"), [])
    assert loaded.train.steps == 6 and loaded.task.image_size == 16  # the resolved config, reloadable


def test_sync_batchnorm_on_cpu_is_a_usage_error(tmp_path):
    proc = run_train(tmp_path / "run", "dist.sync_bn=true", expect=2)
    assert "dist.sync_bn needs CUDA GPUs" in proc.stderr and "task.norm=group" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
def test_gpu_nccl_fp16_channels_last_compile_sync_bn(tmp_path):
    n = torch.cuda.device_count()
    run_train(tmp_path, "train.precision=fp16", "train.channels_last=true", "train.compile=true",
              "dist.sync_bn=true", f"train.global_batch_size={8 * n}", nproc=n, timeout=900)
    s = summary(tmp_path)
    assert s["world_size"] == n and math.isfinite(s["train_loss"]) and s["ranks_in_sync"]
    assert "nccl" in json.loads((tmp_path / "run_info.json").read_text())["versions"]
    state = latest_state(tmp_path)
    assert state["scaler"]["scale"] > 0  # the GradScaler ran and was saved


@pytest.mark.gpu
def test_gpu_ddp_matches_single_process(tmp_path):
    """The averaging math on NCCL: 2 GPUs x half batch == 1 GPU x whole batch (TF32 off)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(one, *GROUPNORM, "train.tf32=false", "train.micro_batch_size=16")
    run_train(two, *GROUPNORM, "train.tf32=false", nproc=2)
    assert_trained_alike(latest_state(one)["model"], latest_state(two)["model"], rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------- no wait for the device in a quiet step

# A patch of train/trainer.py in every rank (conftest.after_import): each read of a tensor's value by the template's
# own code (a call from a file under train/), which on a GPU waits for the device to finish all the work queued
# before it, is written to $READS_DIR/rank<R>.jsonl with the step it falls in (from one train_step to the next).
# (.numpy() is no such read: it refuses a GPU tensor.)
# So is a tensor made from Python numbers on a device (torch.tensor(..., device=...): a blocking copy from the
# host on a GPU) and torch.cuda.synchronize. The data pipeline works on host tensors by design (the loader, its
# sampler): reads under it are not counted.
COUNT_READS = """
import json, os, sys
from pathlib import Path
import torch
TRAIN = str(Path(module.__file__).parent) + os.sep
HOST = (os.sep + os.path.join("torch", "utils", "data") + os.sep, os.path.join(TRAIN, "parallel", "data.py"))
out = Path(os.environ["READS_DIR"]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
step = [0]
def template_caller():
    f = sys._getframe(3)  # template_caller <- record <- the patched function <- its caller
    if not f.f_code.co_filename.startswith(TRAIN):
        return None
    g = f
    while g is not None:
        if any(h in g.f_code.co_filename for h in HOST):
            return None
        g = g.f_back
    return f"train/{os.path.relpath(f.f_code.co_filename, TRAIN)}:{f.f_lineno}"
def record(name):
    if (where := template_caller()) is not None:
        with out.open("a") as fh:
            fh.write(json.dumps({"step": step[0], "read": f"{where} {name}"}) + "\\n")
def counted(name, real, when=lambda a, k: True):
    def read(*a, **k):
        if when(a, k):
            record(name)
        return real(*a, **k)
    return read
for name in ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__"):
    setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
torch.tensor = counted("torch.tensor(device=)", torch.tensor, lambda a, k: k.get("device") is not None)
torch.cuda.synchronize = counted("torch.cuda.synchronize", torch.cuda.synchronize)
real_step = module.train_step
def train_step(training, *a, **k):
    step[0] = training.state.step + 1
    return real_step(training, *a, **k)
module.train_step = train_step
"""
STEPS, LOG_EVERY, EVAL_EVERY, SAVE_EVERY = 12, 4, 6, 5


def _quiet(step: int) -> bool:
    """A step that logs, evaluates and saves nothing, and does not follow a save (a stop there ends with it)."""
    return (step % LOG_EVERY and step % EVAL_EVERY and step % SAVE_EVERY and step != STEPS
            and not (step > SAVE_EVERY and (step - 1) % SAVE_EVERY == 0))


def _quiet_run(runs: Path, *overrides: str, patches: dict[str, str] | None = None) -> Path:
    """2 ranks of 2 micro-batches each for STEPS steps, their reads counted (COUNT_READS) into runs/reads, `patches`
    ({module: patch}, conftest.after_imports) besides; the run in runs/run."""
    (reads := runs / "reads").mkdir()
    env = after_imports(runs, {"train.trainer": COUNT_READS} | (patches or {})) | {
        "READS_DIR": str(reads), "RUN_DIR_FOR_TEST": str(runs / "run")}
    run_train(runs / "run", "train.micro_batch_size=4", f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}",
              f"train.eval_every={EVAL_EVERY}", f"checkpoint.every={SAVE_EVERY}", *overrides, nproc=2, env=env)
    return runs


@pytest.fixture(scope="module")
def quiet_ddp(tmp_path_factory) -> Path:
    """The quiet-step test's DDP run, made once: it also records whether a DDP model is left at the process group's
    teardown (DDP_AT_TEARDOWN: the run that ends done), and evaluates 201 samples with a model that learns (EVALUATED:
    the evaluation's all-reduce)."""
    return _quiet_run(tmp_path_factory.mktemp("quiet_ddp"), "dist.strategy=ddp", *EVALUATED,
                      patches={"train.parallel.distributed": DDP_AT_TEARDOWN})


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_step_that_logs_evaluates_and_saves_nothing_waits_for_no_device_work(tmp_path, request, strategy):
    """On a GPU the host queues a step's work and goes on to the next step's without waiting for the device:
    no read of a tensor's value by the template's own code (its loss sum, the stop agreement) in a step that
    logs, evaluates and saves nothing, 2 ranks of 2 micro-batches each (counted by a patch in each rank:
    COUNT_READS). The steps that do log, evaluate or save read, as they must: the count sees them. (The DDP run,
    with GROUPNORM, serves two more tests: quiet_ddp.)"""
    if strategy == "ddp":
        reads = request.getfixturevalue("quiet_ddp") / "reads"
    else:
        reads = _quiet_run(tmp_path, "dist.strategy=fsdp") / "reads"
    for rank in (0, 1):
        lines = [json.loads(line) for line in (reads / f"rank{rank}.jsonl").read_text().splitlines()]
        quiet = [f"step {r['step']}: {r['read']}" for r in lines if r["step"] and _quiet(r["step"])]
        assert quiet == [], quiet
        loud = {r["step"] for r in lines}
        assert {LOG_EVERY, EVAL_EVERY, SAVE_EVERY, STEPS} <= loud, sorted(loud)


# The same on a GPU, by torch's own detector: torch.cuda.set_sync_debug_mode("warn") warns at each operation that
# makes the host wait for the device; the warnings raised from the template's files (under train/) are recorded
# with their step, as COUNT_READS does.
SYNC_WARNINGS = """
import json, os, warnings
from pathlib import Path
import torch
TRAIN = str(Path(module.__file__).parent) + os.sep
out = Path(os.environ["READS_DIR"]) / "rank0.jsonl"
step = [0]
shown = warnings.showwarning
def show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message) and filename.startswith(TRAIN):
        with out.open("a") as fh:
            fh.write(json.dumps({"step": step[0], "read": f"{filename}:{lineno}"}) + "\\n")
    else:
        shown(message, category, filename, lineno, file, line)
warnings.showwarning = show
warnings.filterwarnings("always", message=".*synchroniz")
real_step = module.train_step
def train_step(training, *a, **k):
    step[0] = training.state.step + 1
    torch.cuda.set_sync_debug_mode("warn")
    return real_step(training, *a, **k)
module.train_step = train_step
"""


@pytest.mark.gpu
def test_gpu_a_quiet_step_makes_no_synchronizing_call_of_the_template(tmp_path):
    (reads := tmp_path / "reads").mkdir()
    env = after_import(tmp_path, "train.trainer", SYNC_WARNINGS) | {"READS_DIR": str(reads)}
    run_train(tmp_path / "run", "train.precision=bf16", "train.micro_batch_size=4", f"train.steps={STEPS}",
              f"train.log_every={LOG_EVERY}", f"train.eval_every={EVAL_EVERY}", f"checkpoint.every={SAVE_EVERY}",
              env=env, timeout=600)
    lines = [json.loads(line) for line in (reads / "rank0.jsonl").read_text().splitlines()] \
        if (reads / "rank0.jsonl").exists() else []
    quiet = [f"step {r['step']}: {r['read']}" for r in lines if r["step"] and _quiet(r["step"])]
    assert quiet == [], quiet
    assert LOG_EVERY in {r["step"] for r in lines}  # the log steps' reads are seen: the detector works


# In each rank, just before the process group is destroyed: whether a DDP model is still alive (its reducer holds
# the group), written to <run dir>/ddp_at_teardown.<rank>.
DDP_AT_TEARDOWN = """
import gc, os
from pathlib import Path
teardown = module.teardown
def recorded():
    from torch.nn.parallel import DistributedDataParallel
    gc.unfreeze()  # the trainer froze what it built before its loader workers forked: gc.get_objects() skips those
    gc.collect()
    alive = any(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    run_dir = Path(os.environ["RUN_DIR_FOR_TEST"])
    (run_dir / f"ddp_at_teardown.{os.environ.get('RANK', '0')}").write_text(str(alive))
    teardown()
module.teardown = recorded
"""


@pytest.mark.parametrize("end", ["done", "diverged", "refused relaunch"])
def test_the_model_is_freed_before_the_process_group(tmp_path, request, end):
    """Two ranks under DDP: no DDP model is left when the trainer destroys the process group, whether the run ends
    done, diverged (exit 2, raised in fit) or refused as it resumes (another optimizer: exit 2, raised in the
    resume). Freed after it (when trainer.run returned, or with an exception's frames holding it), DDP's reducer
    destroyed the gloo group itself, holding the GIL while it joined gloo's threads, one of which waited for the GIL
    to free the last all-gather's tensors: torch 2.11 hung after "done" in 8 of 44 runs on a busy 2-core machine, 0
    of 48 with the model freed first. This checks the order, which decides it, in every run (the race itself needs
    a gloo thread paused at the wrong moment). Done: the quiet-step test's DDP run (quiet_ddp), which ends with an
    evaluation; refused: a copy of the session's finished_two_ranks (SGD) relaunched with AdamW."""
    run_dir = tmp_path / "run"
    env = after_import(tmp_path, "train.parallel.distributed", DDP_AT_TEARDOWN) | {"RUN_DIR_FOR_TEST": str(run_dir)}
    if end == "refused relaunch":
        copy_run(request.getfixturevalue("finished_two_ranks"), run_dir)  # its checkpoint at the end: SGD's state
        last = run_train(run_dir, "train.steps=8", "checkpoint.every=2", "checkpoint.keep=3", "train.eval_every=2",
                         "optim.name=adamw", nproc=2, env=env, expect=1)  # torchrun's 1
        assert "with optim.name sgd -> adamw refused" in last.stderr, last.stderr[-2000:]
    elif end == "diverged":
        last = run_train(run_dir, "train.steps=4", "optim.lr=1e30", nproc=2, env=env, expect=1)  # the ranks' 2
        assert "training diverged" in last.stderr, last.stderr[-2000:]
    else:
        run_dir = request.getfixturevalue("quiet_ddp") / "run"
        assert summary(run_dir)["steps"] == STEPS and STEPS % EVAL_EVERY == 0  # ended done, after an evaluation
    seen = {p.name: p.read_text() for p in run_dir.glob("ddp_at_teardown.*")}
    assert seen == {"ddp_at_teardown.0": "False", "ddp_at_teardown.1": "False"}, seen
