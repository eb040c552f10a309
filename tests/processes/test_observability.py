"""Observability with real processes: W&B offline files and resume, throughput fields, rank-0-only
progress (plain lines off a terminal, a bar on one), the straggler warning, the report, profiling."""
from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import termios
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import (
    OBSERVED,
    PACED,
    PY,
    ROOT,
    clean_env,
    copy_run,
    latest_state,
    metrics,
    run_train,
    summary,
    train_cmd,
)
from train.observe import report_writer

STEP_LINE = re.compile(r"step \d+/\d+")


BAR = re.compile(r"\d+/\d+ \[\d\d:\d\d<")  # tqdm: " 3/6 [00:01<00:02, 1.52step/s, loss ...]"


def obs_env(tmp_path: Path, **extra: str) -> dict:
    """No W&B credentials, and W&B's own cache and config out of the home directory."""
    env = clean_env(WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
                    WANDB_DATA_DIR=str(tmp_path / "wandb-data"), NETRC=str(tmp_path / "no-netrc"), **extra)
    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        env.pop(k, None)
    env.update(extra)
    return env


def wandb_records(path: Path) -> list:
    """The records of a .wandb file (a LevelDB-style log of protobuf records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, out, buf, pos, block = path.read_bytes(), [], b"", 7, 32768
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6] if left >= 7 else 0
        if kind == 0:  # the zero padding at the end of a block
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def wandb_history(records: list) -> list[dict]:
    """The rows passed to wandb.log, in order."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def torchrun_per_rank(run_dir: Path, logs: Path, *overrides: str, env: dict) -> dict[int, tuple[str, str]]:
    """2 ranks, each one's stdout and stderr captured in its own files (torchrun --redirects 3)."""
    cmd = train_cmd(run_dir, *overrides, nproc=2)
    i = cmd.index("--standalone")
    cmd[i:i] = [f"--log-dir={logs}", "--redirects=3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = {}
    for rank in (0, 1):
        (d,) = logs.glob(f"*/attempt_0/{rank}")
        out[rank] = tuple(_read_raw(d / name) for name in ("stdout.log", "stderr.log"))
    return out


def _read_raw(path: Path) -> str:
    with open(path, newline="") as f:  # keeps carriage returns: a progress bar's mark
        return f.read()


def assert_no_progress(text: str, who: str) -> None:
    assert not STEP_LINE.search(text) and not BAR.search(text), f"{who} prints progress:\n{text[-2000:]}"
    assert "\r" not in text and "\x1b[" not in text, f"{who} has terminal control codes:\n{text[-2000:]!r}"


WB = ["log.wandb.mode=offline", "log.wandb.project=obs-test", "log.wandb.tags=alpha, beta", "log.wandb.group=g1",
      "run.name=obs"]
PROFILED = ["profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=2"]


@pytest.fixture(scope="module")
def observed_two_ranks(tmp_path_factory) -> tuple[Path, dict[int, tuple[str, str]]]:
    """Two ranks under torchrun, TINY's 6 steps with W&B (WB's project, tags, group and name), the end-of-run
    report and the profiler on, each rank's stdout and stderr in files of its own (torchrun_per_rank). W&B asked
    for online with a key but no reachable server: it records offline instead. The run directory and
    {rank: (stdout, stderr)}: test_offline_wandb_records_under_the_run_dir_and_a_resume_continues_the_same_run and
    test_two_ranks_throughput_fields_rank0_plain_lines_report_and_profile check the one run (neither changes it)."""
    tmp = tmp_path_factory.mktemp("observed")
    run_dir = tmp / "run"
    # A key but no reachable server: the run warns once and records offline instead, before the other rank,
    # waiting in its next collective, reaches a short dist.timeout_s (W&B's own init timeout is 90 s).
    env = obs_env(tmp, WANDB_API_KEY="a" * 40, WANDB_BASE_URL="http://127.0.0.1:9")
    out = torchrun_per_rank(run_dir, tmp / "torchrun-logs", *OBSERVED, *PROFILED, *WB, "log.wandb.mode=online",
                            "dist.timeout_s=20", env=env)
    return run_dir, out


def test_offline_wandb_records_under_the_run_dir_and_a_resume_continues_the_same_run(tmp_path, observed_two_ranks):
    first_dir, out = observed_two_ranks
    (first, _), _ = out[0], out[1]  # rank 0's stdout
    assert "wandb online did not start" in first and "recording offline instead" in first
    (piece1,) = offline_runs(first_dir)
    run_id = latest_state(first_dir)["tracker"]["run_id"]
    assert run_id and piece1.name.endswith(f"-{run_id}") and (piece1 / f"run-{run_id}.wandb").is_file()
    assert f"upload with: wandb sync {first_dir}/wandb/offline-run-*-{run_id}" in first

    recs = wandb_records(piece1 / f"run-{run_id}.wandb")
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name, run.run_group) == (run_id, "obs-test", "obs", "g1")
    assert list(run.tags) == ["alpha", "beta"]
    uploaded = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert uploaded["train"]["steps"] == 6 and uploaded["log"]["wandb"]["project"] == "obs-test"  # resolved config
    history = wandb_history(recs)
    assert [h["step"] for h in history if "train/loss" in h] == [1, 2, 3, 4, 5, 6]
    assert all(h["perf/samples_per_s"] > 0 for h in history if "train/loss" in h)
    assert any("eval/accuracy" in h for h in history)

    # The same command with more steps resumes (in a copy of the run: the fixture's is shared): a second offline
    # piece of the same W&B run.
    run_dir = copy_run(first_dir, tmp_path / "run")
    second = run_train(run_dir, *WB, "train.steps=8", env=obs_env(tmp_path))
    assert "wandb online did not start" not in second.stdout
    pieces = offline_runs(run_dir)
    assert len(pieces) == 2 and all(p.name.endswith(f"-{run_id}") for p in pieces), pieces
    assert latest_state(run_dir)["tracker"]["run_id"] == run_id and summary(run_dir)["wandb_run_id"] == run_id
    new = [p for p in pieces if p.name != piece1.name][0] / f"run-{run_id}.wandb"
    steps = [h["step"] for h in wandb_history(wandb_records(new)) if "train/loss" in h]
    assert steps == [7, 8], steps

    # Starting another run directory from this run's checkpoint is a new W&B run.
    other = tmp_path / "other"
    proc = run_train(other, *WB, f"resume={run_dir}", "train.steps=9", "log.report=false", env=obs_env(tmp_path))
    other_id = latest_state(other)["tracker"]["run_id"]
    assert other_id and other_id != run_id and f"a new W&B run, not {run_id}" in proc.stdout
    assert [p.name.endswith(f"-{other_id}") for p in offline_runs(other)] == [True]


def test_online_without_an_api_key_is_one_line_and_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "log.wandb.mode=online", expect=2, env=obs_env(tmp_path))
    assert proc.stderr.strip().splitlines() == [
        "error: log.wandb.mode=online but no W&B API key is set for api.wandb.ai: export WANDB_API_KEY (or run "
        "`wandb login` once), or train with log.wandb.mode=offline and `wandb sync` the run later"], proc.stderr
    assert not run_dir.exists()


def test_two_ranks_throughput_fields_rank0_plain_lines_report_and_profile(observed_two_ranks):
    run_dir, out = observed_two_ranks  # W&B offline (its online start failed), the report and the profiler on
    (out0, _), (out1, err1) = out[0], out[1]
    # Off a terminal rank 0 prints plain lines, one per log step; rank 1 prints nothing but warnings.
    assert len(re.findall(r"INFO step \d+/6 epoch 0 loss [\d.]+ lr \S+ [\d.]+ images/s", out0)) == 6, out0
    assert "\r" not in out0 and "\x1b[" not in out0
    assert out1 == "", out1
    assert_no_progress(err1, "rank 1's stderr")
    assert "INFO" not in err1, err1

    train = [m for m in metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5, 6]
    for m in train:
        assert {"epoch", "loss", "lr", "samples_per_s", "step_time_s"} <= m.keys()  # the keys tools rely on
        assert m["samples_per_s"] > 0 and m["step_time_s"] > 0
        assert m["images_per_s"] == m["samples_per_s"]  # the task's unit: one image a sample
        assert len(m["samples_per_s_rank"]) == 2 and min(m["samples_per_s_rank"]) > 0
        assert 0 <= m["data_wait_share"] < 1 and m["straggler_ratio"] >= 1 and m["slowest_rank"] in (0, 1)
        # A rank alone is never slower than the job, which waits for the slowest rank.
        assert min(m["samples_per_s_rank"]) >= m["samples_per_s"] / 2 * 0.99
        assert "peak_mem_gib" not in m and "mfu" not in m  # GPU only
    # Rank 0 starts W&B while rank 1 waits: start-up, not a straggler (the ranks start timing together).
    assert max(m["straggler_ratio"] for m in train) < 3, [m["straggler_ratio"] for m in train]
    assert len(offline_runs(run_dir)) == 1
    evals = [m for m in metrics(run_dir) if "eval_accuracy" in m]
    assert evals and set(evals[0]) - {"time"} == {"step", "eval_loss", "eval_accuracy"}  # no throughput there

    # The end-of-run report, from rank 0.
    assert_report(run_dir)
    assert "report: " in out0 and "throughput" in (run_dir / "report.txt").read_text()

    # A profiler trace of steps 3 and 4 (wait 1, warm up 1, record 2) on each rank, in Chrome/Perfetto JSON.
    for rank in (0, 1):
        (trace,) = (run_dir / "profile").glob(f"rank{rank}.*.pt.trace.json")
        events = json.loads(trace.read_text())["traceEvents"]
        steps = sorted(n for e in events if (n := e.get("name", "")).startswith("ProfilerStep#"))
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"], steps  # numbered from 0 in the trace
        assert any("conv" in e.get("name", "") for e in events)
    assert "profiler: steps 3-4 (ProfilerStep#2-#3 in the trace)" in out0


SLOW_RANK_1 = """
import os
if os.environ.get("RANK") == "1":  # rank 1 loads its training data slowly: the straggler
    import time
    import train.tasks.image

    _get = train.tasks.image.ArrayDataset.__getitem__

    def _slow(self, key):
        if self.augment:  # the training set, not the evaluation set
            time.sleep(0.08)  # 0.64 s a step: more than a step's work even on a busy machine
        return _get(self, key)

    train.tasks.image.ArrayDataset.__getitem__ = _slow
"""


def test_a_slow_rank_is_named_once_and_other_ranks_print_no_progress_even_when_forced(tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SLOW_RANK_1)
    env = obs_env(tmp_path, PYTHONPATH=f"{inject}{os.pathsep}{ROOT}")
    run_dir = tmp_path / "run"
    out = torchrun_per_rank(run_dir, tmp_path / "torchrun-logs", "log.progress_bar=always", env=env)
    (out0, err0), (out1, err1) = out[0], out[1]
    train = [m for m in metrics(run_dir) if "loss" in m][1:]  # the first window is start-up
    assert Counter(m["slowest_rank"] for m in train).most_common(1)[0][0] == 1, train
    ratios = sorted(m["straggler_ratio"] for m in train)
    assert ratios[len(ratios) // 2] > 1.25, ratios
    rank1 = [m["samples_per_s_rank"] for m in train]
    assert sum(r[1] < r[0] for r in rank1) > len(rank1) / 2, rank1
    warnings = re.findall(r"WARNING straggler: rank (\d) on (\S+) needs ([\d.]+)x the time of the fastest rank",
                          out0 + err0)
    assert len(warnings) == 1 and warnings[0][0] == "1", out0  # once, then quiet for 10 log steps
    assert warnings[0][1] == socket.gethostname(), warnings  # its host: ranks' hostnames are gathered at start
    # log.progress_bar=always: rank 0 draws the bar, rank 1 still prints nothing.
    assert BAR.search(out0) and "\r" in out0, out0[-2000:]
    assert out1 == "", out1
    assert_no_progress(err1, "rank 1's stderr")
    assert "straggler" not in err1


def run_in_terminal(cmd: list[str], env: dict, rows: int, cols: int, timeout: float = 300) -> tuple[int, str]:
    """Run cmd with a pseudo-terminal of that size as stdin/stdout/stderr; returns (exit code, output)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks, deadline = [], time.time() + timeout
    try:
        while time.time() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.send_signal(signal.SIGKILL)
    finally:
        os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_a_progress_bar_instead_of_step_lines(tmp_path):
    code, out = run_in_terminal(train_cmd(tmp_path, "log.wandb.mode=disabled", "log.report=false"),
                                obs_env(tmp_path, TERM="xterm"), rows=30, cols=120)
    assert code == 0, out[-3000:]
    # Without W&B and report: no wandb/ and no report files, metrics.jsonl all the same.
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "report.png").exists()
    assert [m["step"] for m in metrics(tmp_path) if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert latest_state(tmp_path)["tracker"]["run_id"] is None
    assert BAR.search(out) and "\r" in out, out[-3000:]
    assert re.search(r"6/6 \[.*loss [\d.]+, [\d.]+ images/s", out), out[-3000:]
    assert not re.search(r"INFO step \d+/6", out), out[-3000:]  # the bar replaces the per-step lines...
    assert "INFO eval step 6" in out and "INFO done: 6 steps" in out  # ...and other lines print above it
    assert len(re.findall(r"INFO step \d+/6", (tmp_path / "logs" / "rank0.log").read_text())) == 6  # the log has all


def assert_report(run_dir: Path) -> None:
    from PIL import Image

    png = run_dir / "report.png"
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.format == "PNG" and img.size == (1000, 700)
        unit = "images" if any("images_per_s" in r for r in report_writer.load(run_dir)[0]) else "samples"
        assert img.text["Description"] == f"panels: loss, eval accuracy, learning rate, throughput ({unit}/s)"
        rgb = img.convert("RGB")
        w, h = rgb.size
        # Every quadrant (one panel each) holds a plotted line or marker in matplotlib's first colour.
        for x0, y0 in ((0, 0), (w // 2, 0), (0, h // 2), (w // 2, h // 2)):
            quadrant = rgb.crop((x0, y0, x0 + w // 2, y0 + h // 2))
            blue = sum(n for n, (r, g, b) in quadrant.getcolors(w * h)
                       if abs(r - 31) + abs(g - 119) + abs(b - 180) < 30)  # C0, #1f77b4
            assert blue > 20, f"the panel at {(x0, y0)} has no data drawn"


def test_report_cli_on_any_run_dir_and_one_line_errors(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "epoch": 0, "loss": 2.0 / s, "lr": 0.1, "samples_per_s": 100.0 + s, "step_time_s": 0.5}
             for s in range(1, 11)] + [{"step": 10, "eval_loss": 1.5, "eval_accuracy": 0.4}]
    text = "".join(json.dumps(rec) + "\n" for rec in lines) + '{"step": 11, "lo'  # cut short by a kill
    (run_dir / "metrics.jsonl").write_text(text)
    proc = subprocess.run([PY, "-m", "train.report", str(run_dir)], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "incomplete" in proc.stdout and "last logged step 10" in proc.stdout
    assert "eval loss 1.5000, accuracy 0.4000 (best eval loss 1.5000 at step 10)" in proc.stdout
    assert "throughput 106.0 samples/s" in proc.stdout
    assert (run_dir / "report.txt").read_text() in proc.stdout
    assert_report(run_dir)

    for bad, message in ((tmp_path / "nope", "is not a directory"), (tmp_path, "has no metrics.jsonl")):
        proc = subprocess.run([PY, "-m", "train.report", str(bad)], cwd=ROOT, env=clean_env(), capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_terminal_of_unknown_size_still_shows_the_bar(tmp_path):
    """`script`, or `docker run -t` before the size arrives: 0 x 0, where tqdm would draw nothing."""
    code, out = run_in_terminal(train_cmd(tmp_path, "train.steps=2"),
                                obs_env(tmp_path, TERM="xterm"), rows=0, cols=0)
    assert code == 0, out[-3000:]
    assert re.search(r"2/2 \[.*loss [\d.]+, [\d.]+ images/s", out), out[-3000:]


def test_wandb_continues_one_run_across_a_torchrun_restart_and_a_requeue(tmp_path):
    """A worker SIGKILLed (torchrun restarts the group from the last checkpoint), then a stop relaunched as a
    requeue would be: one W&B run in three offline pieces, each logging from the step it resumed at, the
    steps after the checkpoint logged again with the values of the first time (the resume is exact). The
    requeued job is one process (python -m train, paced as the first launch: the same config): the pieces'
    promise is W&B's, which holds at any world size (the restart's piece is the several ranks')."""
    from tests.processes.test_stops import finish, launch, logged_steps, wait_for, workers

    run_dir = tmp_path / "run"
    every = ["train.steps=30", "checkpoint.every=4", "log.wandb.mode=offline"]
    proc = launch(run_dir, *every, launcher=("--nproc-per-node=2", "--max-restarts=1"))
    wait_for(lambda: max(logged_steps(run_dir), default=0) >= 10, 180, "step 10")
    os.kill(workers(proc.pid)[1], signal.SIGKILL)
    wait_for(lambda: len(offline_runs(run_dir)) == 2 and max(logged_steps(run_dir), default=0) >= 18, 240,
             "the restarted group at step 18")
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    run_train(run_dir, *PACED, *every)  # the requeued job (exit 0 asserted)

    run_id = summary(run_dir)["wandb_run_id"]
    pieces = offline_runs(run_dir)
    assert len(pieces) == 3 and all(p.name.endswith(f"-{run_id}") for p in pieces), pieces
    logged = [[(h["step"], h["train/loss"]) for h in wandb_history(wandb_records(p / f"run-{run_id}.wandb"))
               if "train/loss" in h] for p in pieces]
    steps = [[s for s, _ in piece] for piece in logged]
    for piece in steps:
        assert piece == list(range(piece[0], piece[-1] + 1)), steps  # each piece logs consecutive steps
    assert steps[0][0] == 1 and steps[2][-1] == 30
    assert (steps[1][0] - 1) % 4 == 0 and steps[1][0] <= steps[0][-1] + 1  # from the checkpoint before the kill
    assert steps[2][0] == steps[1][-1] + 1  # the stop saved the step it stopped at
    first = {}
    for piece in logged:
        for step, loss in piece:
            assert first.setdefault(step, loss) == loss, f"step {step} logged again with another loss"
    assert sorted(first) == list(range(1, 31))


def test_w_and_b_dying_mid_run_does_not_stop_training(tmp_path):
    """W&B's service process (wandb-core, rank 0's child) killed mid-run, as an OOM kill or a crash would:
    training goes on to its end and metrics.jsonl holds every step."""
    from tests.procs import descendants, logged_steps, wait_for

    proc = subprocess.Popen(train_cmd(tmp_path, *OBSERVED, *PACED, "log.report=false", "train.steps=12"), cwd=ROOT,
                            env=obs_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(logged_steps(tmp_path)) >= 3, 120, "step 3")
    service = [p for p in descendants(proc.pid) if b"wandb-core" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert service, "no wandb-core process under the run"
    for pid in service:
        os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert logged_steps(tmp_path) == list(range(1, 13)) and summary(tmp_path)["steps"] == 12
    assert "Traceback" not in err, err[-3000:]
    warnings = [line for line in (out + err).splitlines() if "WARNING wandb" in line]
    assert len(warnings) == 1, warnings  # one warning, then no more W&B in this run
