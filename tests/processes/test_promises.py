"""Promises of the README and docs/ that no test guarded: the learning-rate schedule, AdamW, the launcher's debug
environment and stop-budget variables, ranks_in_sync saying no, and which samples the ranks read when
the world size changes. Real processes (python -m train, torchrun, the launcher), real files."""
from __future__ import annotations

import math
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    PY,
    ROOT,
    after_imports,
    clean_env,
    latest_state,
    metrics,
    run_train,
    summary,
    train_losses,
)
from tests.procs import environ, finish, kill_family, launch, launcher_command, wait_for, workers

PEAK, WARMUP, FLOOR_RATIO, STEPS = 0.002, 3, 0.1, 24


ADAMW = ["optim.name=adamw", f"optim.lr={PEAK}", f"optim.warmup_steps={WARMUP}", f"optim.min_lr_ratio={FLOOR_RATIO}",
         f"train.steps={STEPS}", "checkpoint.every=12", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def adamw_run(tmp_path_factory) -> Path:
    """One process, AdamW, 3 warm-up steps then cosine to 0.1 x the peak over 24 steps; checkpoints 12, 24."""
    run_dir = tmp_path_factory.mktemp("adamw")
    run_train(run_dir, *ADAMW)
    return run_dir


def expected_lr(step: int) -> float:
    """The rate of optimizer step `step` (1-based, as metrics.jsonl numbers them), from docs/configuration.md:
    a linear warm-up over the first WARMUP steps up to the peak, then half a cosine from the peak down to
    peak x min_lr_ratio, which the schedule reaches as the run ends (after its last step)."""
    if step <= WARMUP:
        return PEAK * step / WARMUP
    done = (step - 1 - WARMUP) / (STEPS - WARMUP)  # share of the decay behind this step: 0 at the first
    floor = PEAK * FLOOR_RATIO
    return floor + (PEAK - floor) * (1 + math.cos(math.pi * done)) / 2


def test_the_learning_rate_warms_up_then_decays_along_a_cosine_to_the_floor(adamw_run):
    logged = {m["step"]: m["lr"] for m in metrics(adamw_run) if "lr" in m}
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step, lr in logged.items():
        assert lr == pytest.approx(expected_lr(step), rel=1e-9, abs=1e-15), (step, lr, expected_lr(step))
    assert logged[1] == pytest.approx(PEAK / WARMUP) and logged[WARMUP] == logged[WARMUP + 1] == pytest.approx(PEAK)
    decay = [logged[s] for s in range(WARMUP + 1, STEPS + 1)]
    assert decay == sorted(decay, reverse=True) and min(decay) > PEAK * FLOOR_RATIO


def test_adamw_trains_saves_its_moments_and_resumes_bitwise(tmp_path, adamw_run):
    losses = train_losses(adamw_run)
    first, last = [losses[s] for s in range(1, 7)], [losses[s] for s in range(STEPS - 5, STEPS + 1)]
    # It learns (measured: the first 6 steps' losses average 2.45, the last 6's 1.63; eval loss 1.76 < ln 10).
    assert sum(last) / 6 < sum(first) / 6 - 0.4 and summary(adamw_run)["eval_loss"] < 2.0, losses
    state = latest_state(adamw_run)
    assert state["step"] == STEPS
    for group in state["optimizer"]["param_groups"]:
        assert group["betas"] == (0.9, 0.999) and "momentum" not in group, group  # AdamW's, not SGD's
    moments = state["optimizer"]["state"]
    assert len(moments) == sum(len(g["params"]) for g in state["optimizer"]["param_groups"])  # every parameter
    for st in moments.values():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and float(st["step"]) == STEPS, set(st)
        assert st["exp_avg_sq"].abs().sum() > 0
    # Continue from step 12 in a new run directory: the same weights, moments and losses as the run that went on.
    resumed = tmp_path / "resumed"
    proc = run_train(resumed, *ADAMW, f"resume={adamw_run / 'checkpoints' / 'step_00000012'}")
    assert "at step 12" in proc.stdout
    other = latest_state(resumed)
    for k, v in state["model"].items():
        assert torch.equal(v, other["model"][k]), k
    for i, st in moments.items():
        for k, v in st.items():
            assert torch.equal(v, other["optimizer"]["state"][i][k]), (i, k)
    assert train_losses(resumed) == {s: loss for s, loss in losses.items() if s > 12}


def test_a_checkpoint_resumes_across_a_switch_of_optim_fused_and_keeps_the_runs_own_kernels(tmp_path):
    """optim.fused switched at each resume (one process, AdamW, 12 steps): fused to step 4, a new run from that
    checkpoint with per-parameter kernels to step 8, one from there fused again to the end. Each resume loads
    the saved moments and counters into the other kernels, each run keeps its own choice (as its checkpoints
    say), and the end equals a run without a switch up to float rounding (the kernels round differently): the
    first run's, fused to its end (the chain's first segment is its first 4 steps)."""
    opts = ["optim.name=adamw", "optim.lr=0.002", "task.norm=group", "train.steps=12", "checkpoint.every=4",
            "checkpoint.keep=3"]
    source = None
    for fused, at in ((True, 4), (False, 8), (True, 12)):
        run = tmp_path / f"to{at}"
        run_train(run, *opts, f"optim.fused={str(fused).lower()}", *([f"resume={source}"] if source else []))
        source = run / "checkpoints" / f"step_{at:08d}"
        state = latest_state(run)
        assert {bool(g["fused"]) for g in state["optimizer"]["param_groups"]} == {fused}
        assert {float(st["step"]) for st in state["optimizer"]["state"].values()} == {12}
    plain = tmp_path / "to4"  # fused to step 12 without a switch
    a, b = latest_state(plain), latest_state(tmp_path / "to12")

    def apart(x: torch.Tensor, y: torch.Tensor, share: float) -> bool:
        return bool((x.float() - y.float()).norm() > share * x.float().norm())

    # GroupNorm (task.norm=group): batch statistics would amplify the two kernels' rounding by step 12 to 13% of a
    # tensor's norm on an AVX2-only CPU. Measured with it: the weights 2e-5 of their norm apart at most, the moments
    # 4e-4, as far as two runs that never switched, one fused and one not, are; a counter or a moment not restored
    # moves them by far more.
    moments, other = a["optimizer"]["state"], b["optimizer"]["state"]
    assert not [k for k, v in a["model"].items() if apart(v, b["model"][k], 1e-3)]
    assert not [(i, k) for i, st in moments.items() for k, v in st.items() if apart(v, other[i][k], 0.05)]


DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_CPP_LOG_LEVEL": "INFO", "NCCL_DEBUG": "INFO",
             "NCCL_DEBUG_SUBSYS": "INIT,COLL,NET", "LOGLEVEL": "INFO"}


def _worker_env(run_dir: Path, launcher: tuple[str, ...], env: dict) -> tuple[dict[int, dict], list[str]]:
    """Start the launcher, read its workers' environments and torchrun's command line from /proc, end it."""
    proc = launch(run_dir, "train.steps=500", launcher=launcher, env=env)
    try:
        ranks = wait_for(lambda: w if len(w := workers(proc.pid)) == 2 else None, 120, "two workers")
        envs = {rank: environ(pid) for rank, pid in ranks.items()}
        agent = Path(f"/proc/{ranks[0]}/stat").read_text().rsplit(")", 1)[1].split()[1]  # the workers' parent
        cmdline = Path(f"/proc/{agent}/cmdline").read_bytes().decode().split("\0")
    finally:
        kill_family(proc.pid)
        finish(proc, 30)
    return envs, cmdline


@pytest.mark.parametrize("how", ["--debug", "LAUNCH_DEBUG=1", "off"])
def test_debug_gives_the_workers_the_verbose_distributed_environment(tmp_path, how):
    """--debug or LAUNCH_DEBUG=1: every worker runs with torch.distributed's and NCCL's verbose settings
    (NCCL's log into the run directory), a variable the user set keeps its value; without them, none.
    The stop budget from TORCH_ELASTIC_SHUTDOWN_TIMEOUT is what torchrun really runs with."""
    env = clean_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="47")
    launcher = ("--nproc-per-node=2", "--debug") if how == "--debug" else ("--nproc-per-node=2",)
    if how == "LAUNCH_DEBUG=1":
        env |= {"LAUNCH_DEBUG": "1", "TORCH_CPP_LOG_LEVEL": "WARNING"}  # set by the user: it wins
    envs, cmdline = _worker_env(tmp_path, launcher, env)
    assert "--shutdown-timeout=47" in cmdline, cmdline
    assert sorted(envs) == [0, 1]
    for rank, got in envs.items():
        if how == "off":
            assert not {k: got[k] for k in (*DEBUG_ENV, "NCCL_DEBUG_FILE") if k in got}, (rank, got)
            continue
        want = DEBUG_ENV | ({"TORCH_CPP_LOG_LEVEL": "WARNING"} if how == "LAUNCH_DEBUG=1" else {})
        assert {k: got.get(k) for k in want} == want, rank
        assert got["NCCL_DEBUG_FILE"] == str(tmp_path.resolve() / "logs" / "nccl.%h.%p.log"), got["NCCL_DEBUG_FILE"]


def _stop_budget(**env: str) -> str:
    """--shutdown-timeout of the torchrun command the launcher composes from this environment (in this process:
    the first case runs `python -m train.launch --dry-run`, which prints that command)."""
    cmd = launcher_command(["--nproc-per-node=2", "--", "--config", "configs/default.yaml"], clean_env(**env))
    (flag,) = [a for a in cmd if a.startswith("--shutdown-timeout=")]
    return flag.split("=", 1)[1]


def test_the_stop_budget_falls_back_to_torchruns_variables_with_stop_timeout_first():
    proc = subprocess.run([PY, "-m", "train.launch", "--nproc-per-node=2", "--dry-run", "--", "--config",
                           "configs/default.yaml"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--shutdown-timeout=30" in proc.stderr.split() and _stop_budget() == "30"
    assert _stop_budget(PET_SHUTDOWN_TIMEOUT="45") == "45"
    assert _stop_budget(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="50") == "50"
    assert _stop_budget(PET_SHUTDOWN_TIMEOUT="45", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="50") == "45"
    assert _stop_budget(STOP_TIMEOUT="40", PET_SHUTDOWN_TIMEOUT="45", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="50") == "40"


MICRO, GLOBAL, SAMPLES = 4, 24, 64  # 24 divides over 1, 2 and 3 ranks


# (world size, train.steps at the end of the segment): 2 ranks to step 1 (24 samples of epoch 0), 1 to step 4
# (epoch 0 ends at 48, after its last whole step of 24; 48 of epoch 1), 3 to step 6 (16 left of epoch 1: no whole
# step, so epoch 2 begins; 48 of it).
SEGMENTS = [(2, 1), (1, 4), (3, 6)]


def expected_reads(segments: list[tuple[int, int]]) -> dict[int, int]:
    """{epoch: how many samples of it are read}: each step reads the next GLOBAL samples of the epoch's permutation
    (each rank every world-th one, DistributedSampler's strided shards); an epoch ends where the world size of the
    moment has no whole step left in it (each rank's share of the rest is less than GLOBAL / world)."""
    counts, epoch, done, step = {}, 0, 0, 0
    for world, until in segments:
        for _ in range(until - step):
            if (SAMPLES - done) // world < GLOBAL // world:
                epoch, done = epoch + 1, 0
            done += GLOBAL
            counts[epoch] = done
        step = until
    return counts


# A sitecustomize patch (conftest.after_import) of train.parallel.data: every training sample a rank reads (by the
# (index, epoch) key its data set is read by) appended to READS_DIR/<pid>.txt as "rank epoch index" (num_workers=0).
RECORD_READS = """
import os
real_loaders = module.loaders
def loaders(*args, **kwargs):
    stream, evaluation = real_loaders(*args, **kwargs)
    train = stream.loader.dataset
    base = type(train)
    log = open(os.path.join(os.environ["READS_DIR"], f"{os.getpid()}.txt"), "a", buffering=1)
    rank = os.environ.get("RANK", "0")
    class Recorded(base):
        def _seeded(self, index, epoch):
            log.write(f"{rank} {epoch} {index}\\n")
            return base._seeded(self, index, epoch)
    train.__class__ = Recorded
    return stream, evaluation
module.loaders = loaders
"""


def reads_by_epoch(folder: Path) -> dict[int, list[int]]:
    """{epoch: the sample indices read in it} from RECORD_READS' files, over every rank and launch."""
    by_epoch: dict[int, list[int]] = {}
    for path in folder.iterdir():
        for line in path.read_text().splitlines():
            _, epoch, index = map(int, line.split())
            by_epoch.setdefault(epoch, []).append(index)
    return by_epoch


# A sitecustomize patch (conftest.after_import) of train.trainer: rank 1 alone moves one element of one parameter by
# the smallest float step after the last optimizer step of its launch (train.steps), in the copy it holds (HSDP: its
# shard). A process without RANK (a single `python -m train`) trains as usual.
NUDGE_RANK_1 = """
import os
import torch
if os.environ.get("RANK") == "1":
    real = module.train_step
    def train_step(training, *args, **kwargs):
        loss = real(training, *args, **kwargs)
        if training.state.step == training.cfg.train.steps:
            with torch.no_grad():
                w = next(training.state.model.parameters())
                w = (w.to_local() if hasattr(w, "to_local") else w).view(-1)  # HSDP: this rank's shard
                w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))
        return loss
    module.train_step = train_step
"""

# The strategy of each segment of SEGMENTS: DDP on 2 ranks, HSDP in groups of one rank on 3 (each rank's shard a
# replica of the others': they must agree), the checkpoint resharded as it loads (a relaunch's "applied" rule).
STRATEGIES = {"ddp": ["dist.strategy=ddp"], "hsdp": ["dist.strategy=hsdp", "dist.shard_size=1"]}
SEGMENT_STRATEGY = ["ddp", "ddp", "hsdp"]


@pytest.fixture(scope="module")
def world_changes(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """One run over SEGMENTS (2 -> 1 -> 3 ranks across an epoch boundary, SEGMENT_STRATEGY's strategies), every
    training sample each rank reads recorded (RECORD_READS: in READS_DIR) and rank 1 nudged after the last step
    of each launch (NUDGE_RANK_1). The run, the reads' folder and each launch's summary.json: for
    test_the_ranks_read_each_sample_once_an_epoch_across_world_size_changes and
    test_ranks_in_sync_says_false_when_one_rank_holds_other_weights (a launch of 2 ranks under DDP, one of 3
    under HSDP)."""
    tmp = tmp_path_factory.mktemp("world-changes")
    reads_dir = tmp / "reads"
    reads_dir.mkdir()
    env = after_imports(tmp, {"train.parallel.data": RECORD_READS, "train.trainer": NUDGE_RANK_1})
    env["READS_DIR"] = str(reads_dir)
    run, summaries = tmp / "run", []
    for (world, steps), strategy in zip(SEGMENTS, SEGMENT_STRATEGY, strict=True):
        run_train(run, f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL}", "task.image_size=8",
                  f"task.train_samples={SAMPLES}", f"train.steps={steps}", *STRATEGIES[strategy], nproc=world, env=env)
        summaries.append(summary(run))
    return run, reads_dir, summaries


def test_the_ranks_read_each_sample_once_an_epoch_across_world_size_changes(world_changes):
    """Every training sample read (the data set's __getitem__, wrapped by a sitecustomize: num_workers=0, so
    in the rank processes) by every rank of every segment, 2 -> 1 -> 3 ranks across an epoch boundary: in
    each epoch, each sample at most once: the start of torch's DistributedSampler permutation of the epoch
    (seeded by seed + epoch), as far as the world sizes read it (none skipped but the last tail)."""
    run, reads_dir, _ = world_changes
    by_epoch: dict[int, list[int]] = {}
    processes = list(reads_dir.iterdir())
    ranks = set()
    for path in processes:
        for line in path.read_text().splitlines():
            rank, epoch, index = map(int, line.split())
            by_epoch.setdefault(epoch, []).append(index)
            ranks.add(rank)
    assert ranks == set(range(max(w for w, _ in SEGMENTS))) and len(processes) == sum(w for w, _ in SEGMENTS)
    expected = expected_reads(SEGMENTS)
    assert sorted(by_epoch) == sorted(expected), ({e: len(r) for e, r in by_epoch.items()}, expected)
    for epoch, read in sorted(by_epoch.items()):
        twice = sorted(i for i, n in Counter(read).items() if n > 1)
        assert not twice, f"epoch {epoch}: samples read twice: {twice}"
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0 + epoch)).tolist()
        wanted = order[:expected[epoch]]
        assert sorted(read) == sorted(wanted), (
            f"epoch {epoch}: {len(read)} read, {len(wanted)} expected; not read: {sorted(set(wanted) - set(read))}; "
            f"read, not expected: {sorted(set(read) - set(wanted))}")
    assert summary(run)["steps"] == SEGMENTS[-1][1] and summary(run)["world_size"] == SEGMENTS[-1][0]


@pytest.mark.parametrize("strategy", ["ddp", "hsdp"])
def test_ranks_in_sync_says_false_when_one_rank_holds_other_weights(world_changes, strategy):
    """Rank 1 alone moves one element of one parameter by the smallest float step after the last optimizer
    step (a sitecustomize in that process, NUDGE_RANK_1): summary.json says the ranks are not in sync. Under DDP
    (2 ranks), and under HSDP in groups of one rank (3), where rank 1's shard is a replica of rank 0's: launches
    of world_changes' run."""
    launch = {"ddp": 0, "hsdp": 2}[strategy]  # the launch of SEGMENTS under that strategy with rank 1 in it
    assert SEGMENT_STRATEGY[launch] == strategy
    s = world_changes[2][launch]
    assert s["world_size"] == SEGMENTS[launch][0] > 1 and s["steps"] == SEGMENTS[launch][1], s
    assert s["ranks_in_sync"] is False, s
