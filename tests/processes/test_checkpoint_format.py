"""The checkpoint folders (torch.distributed.checkpoint): every rank's share survives a kill and a flipped byte,
a resume reshards onto another world size, the weights export to one plain file, and a checkpoint of an
earlier version is refused in one line until converted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib

import torch

from tests.conftest import (
    BUILT_IN,
    GROUPNORM,
    PY,
    ROOT,
    TINY,
    after_import,
    assert_trained_alike,
    clean_env,
    copy_run,
    latest_state,
    metrics,
    run_train,
    summary,
    train_cmd,
    train_losses,
)
from tests.processes.test_promises import RECORD_READS, reads_by_epoch
from tests.procs import children, environ, is_stopped, wait_for
from train import config, export, optim
from train.checkpoint import convert, dcp_io, storage


def _rank_pid(proc: subprocess.Popen, rank: int) -> int | None:
    for pid in children(proc.pid):  # torchrun's workers
        if environ(pid).get("RANK") == str(rank):
            return pid
    return None


def test_sigkill_of_rank_1_during_a_sharded_save_resumes_the_previous_checkpoint(tmp_path):
    """Rank 1 is killed while a checkpoint folder is being written (rank 1's share in it or not yet): the
    dead save never counts, `latest` names the one before, and the relaunch (one process: DCP reads both ranks'
    shares) resumes from it."""
    ckpts = tmp_path / "checkpoints"
    args = [BUILT_IN, "checkpoint.every=1", "checkpoint.keep=2", "train.steps=200"]  # ResNet-18's 90 MB saves
    proc = subprocess.Popen(train_cmd(tmp_path, *args, nproc=2), cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, killed = time.time() + 120, None
    while time.time() < deadline and proc.poll() is None and killed is None:
        saving = list(ckpts.glob(".step_*.tmp")) if ckpts.is_dir() else []
        if (ckpts / "latest").exists() and saving and (pid := _rank_pid(proc, 1)):
            # Rank 1 paused (SIGSTOP): no save completes without its share, so a folder still there without
            # its manifest now is a save in progress at the kill (it may have been renamed between the look and
            # the pause: then go on and look again).
            os.kill(pid, signal.SIGSTOP)
            wait_for(lambda p=pid: is_stopped(p), 60, "rank 1 to stop")
            if saving[0].exists() and not (saving[0] / storage.MANIFEST).exists():
                killed = saving[0]
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
    proc.communicate(timeout=60)  # torchrun ends the group once a worker died
    assert proc.returncode != 0
    assert killed is not None and killed.exists(), "the kill never landed during a save"
    name = (ckpts / "latest").read_text().strip()
    assert int(name[5:]) < int(killed.name[6:14]), (name, killed.name)  # `latest` names the save before
    step = latest_state(tmp_path)["step"]  # checks every file's CRC, loads with weights_only
    resumed = run_train(tmp_path, BUILT_IN, "checkpoint.every=0", f"train.steps={step + 1}")
    assert f"resumed from {ckpts / name} at step {step}" in resumed.stdout, resumed.stdout
    assert not list(ckpts.glob(".*.tmp*"))  # the dead save's leftovers are gone
    assert summary(tmp_path)["steps"] == step + 1


def test_a_flipped_byte_in_rank_1s_shard_falls_back_in_one_line_on_every_rank(tmp_path, finished_two_ranks):
    copy_run(finished_two_ranks, tmp_path)  # checkpoints at steps 2, 4 and 6, written by 2 ranks
    ckpts = tmp_path / "checkpoints"
    shard = ckpts / "step_00000006" / "__1_0.distcp"  # rank 1's share of the tensors
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(bytes(raw))
    proc = run_train(tmp_path, "checkpoint.every=2", "checkpoint.keep=3", "train.steps=8", nproc=2)
    for rank in (0, 1):  # every rank says it once, the same, and resumed from the same, previous checkpoint
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        warnings = [line for line in log.splitlines() if "step_00000006" in line and "WARNING" in line]
        assert len(warnings) == 1, log[-3000:]
        assert "fails its checksum (__1_0.distcp: CRC-32 differs)" in warnings[0], warnings
        assert "all ranks trying the previous one" in warnings[0], warnings
        assert f"resumed from {ckpts / 'step_00000004'} at step 4" in log, log[-3000:]
    assert f"resumed from {ckpts / 'step_00000004'} at step 4" in proc.stdout  # what the console shows
    s = summary(tmp_path)
    assert s["steps"] == 8 and s["ranks_in_sync"], s


# 24 samples a step (2 ranks x 3 micro-steps of 4, 1 x 6, 3 x 2) of 120 an epoch: 5 steps an epoch at each of
# these world sizes, no tail dropped, so a resized run reads the samples of an uninterrupted one. GroupNorm (no
# batch statistics) and a constant learning rate (warm-up 0, no decay: the schedule does not depend on the
# train.steps each segment ends at), so that it also ends with the same weights, up to rounding.
RESIZED = [*GROUPNORM, "task.image_size=8", "task.train_samples=120", "task.eval_samples=16",
           "train.global_batch_size=24", "train.micro_batch_size=4", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0"]


def test_world_size_2_then_1_then_3_ends_with_the_samples_and_weights_of_an_uninterrupted_run(tmp_path):
    """2 ranks under FSDP to step 3, one process (DDP) to step 7, across the end of epoch 0, then 3 ranks under
    FSDP to step 9. Each resume reads tensors saved by another number of ranks (DCP reshards on load) and
    continues after the samples seen: each epoch's samples are those of an uninterrupted 2-rank run, none
    twice, and the weights are its weights but for the rounding of another batch split."""
    env = after_import(tmp_path, "train.parallel.data", RECORD_READS)
    ref, run = tmp_path / "ref", tmp_path / "run"
    for name in ("ref", "run"):
        (tmp_path / f"{name}-reads").mkdir()
    run_train(ref, *RESIZED, "train.steps=9", nproc=2, env=env | {"READS_DIR": str(tmp_path / "ref-reads")})
    said = []
    for world, steps, strategy in ((2, 3, "fsdp"), (1, 7, "ddp"), (3, 9, "fsdp")):
        proc = run_train(run, *RESIZED, f"train.steps={steps}", f"dist.strategy={strategy}", nproc=world,
                         env=env | {"READS_DIR": str(tmp_path / "run-reads")})
        said.append(proc.stdout + proc.stderr)
    assert "world size changed from 2 to 1" in said[1] and "at step 3 (epoch 0, 72 samples into it)" in said[1]
    assert "world size changed from 1 to 3" in said[2] and "at step 7 (epoch 1, 48 samples into it)" in said[2]
    state = latest_state(run)
    assert state["step"] == 9 and state["world_size"] == 3 and len(state["rng"]) == 3
    assert (state["data"]["epoch"], state["data"]["samples_in_epoch"]) == (1, 96), state["data"]
    assert sorted(train_losses(run)) == list(range(1, 10)) and summary(run)["ranks_in_sync"]
    a, b = reads_by_epoch(tmp_path / "ref-reads"), reads_by_epoch(tmp_path / "run-reads")
    assert sorted(a) == sorted(b) == [0, 1] and len(a[0]) == 120 and len(a[1]) == 96
    for epoch in a:
        assert sorted(b[epoch]) == sorted(a[epoch]), f"epoch {epoch}: samples read twice, or others"
    losses, ref_losses = train_losses(run), train_losses(ref)
    assert [losses[s] for s in (1, 2, 3)] == [ref_losses[s] for s in (1, 2, 3)]  # FSDP on 2 ranks: DDP's, bitwise
    assert_trained_alike(latest_state(ref)["model"], state["model"])


def test_the_export_loads_in_a_bare_interpreter(tmp_path, capsys, finished_resnet18):
    """python -m train.export writes the model of a checkpoint (saved by 2 ranks) as one plain state dict:
    a fresh, isolated interpreter (python -I, outside the project) loads it with weights_only into a plain
    torchvision resnet18 with the CIFAR stem (16-px images); `train` is never imported. (finished_resnet18: the
    built-in ResNet-18, not TINY's small model of the tests' own.)"""
    out = tmp_path / "weights.pt"
    proc = subprocess.run([PY, "-m", "train.export", str(finished_resnet18), "--step", "4", "--out", str(out)],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"wrote {out}" in proc.stdout and proc.stderr == "", proc.stderr  # nothing else
    script = f"""
import json, sys
import torch, torchvision
state = torch.load({str(out)!r}, weights_only=True)
net = torchvision.models.resnet18(num_classes=10)
net.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
net.maxpool = torch.nn.Identity()
net.load_state_dict(state)  # strict: every key, every shape
net.eval()
with torch.no_grad():
    logits = net(torch.zeros(2, 3, 16, 16))
print(json.dumps({{"train": sorted(m for m in sys.modules if m.split(".")[0] == "train"),
                  "logits": list(logits.shape), "sum": float(sum(v.double().sum() for v in state.values()))}}))
"""
    proc = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["train"] == [] and got["logits"] == [2, 10], got
    saved = dcp_io.read_state(finished_resnet18 / "checkpoints" / "step_00000004")["model"]
    assert got["sum"] == float(sum(v.double().sum() for v in saved.values()))  # step 4's weights
    # The usage errors: exit 2 and one line, from the same main() in this process (the process itself, run above,
    # says nothing on stderr).
    for bad, says in [(tmp_path / "nowhere", "does not exist"), (tmp_path, "holds no complete checkpoint")]:
        assert export.main([str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert export.main([str(finished_resnet18), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {finished_resnet18} holds no complete checkpoint of step 3 (it has steps 2, 4, 6)\n", err


def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_step_to_export_instead(tmp_path, capsys,
                                                                                          finished_run):
    """The latest checkpoint's trainer.pt cut short (an interrupted copy; the issue: torch's text cut mid-word, no
    fix): exit 2, one line naming the file, what is wrong with it (by the size the save recorded) and the earlier
    steps to export instead, which then exports. A tensor file that fails its checksum names the earlier steps too;
    the first checkpoint has none to name; a trainer.pt as saved that does not load says torch's first sentence.
    The checkpoints stay as they were, nothing is written but the export it names."""
    run = copy_run(finished_run, tmp_path / "run")
    ckpt = run / "checkpoints"
    step = {n: ckpt / f"step_{n:08d}" for n in (2, 4, 6)}
    trainer = step[6] / "trainer.pt"
    saved = trainer.stat().st_size
    trainer.write_bytes(trainer.read_bytes()[:1000])
    files = lambda: {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    proc = subprocess.run([PY, "-m", "train.export", str(run)], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, ""), proc
    assert proc.stderr == (f"error: checkpoint {step[6]} is damaged (its trainer.pt is truncated: 1000 bytes where "
                           f"the save wrote {saved}): export an earlier one with --step 4 (saved: steps 2, 4), or "
                           f"restore step_00000006 from a copy\n"), proc.stderr
    assert files() == before
    assert export.main([str(run), "--step", "4"]) == 0  # the step the line names exports
    assert (run / "export" / "step_00000004.pt").is_file()
    capsys.readouterr()

    shard = step[4] / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert export.main([str(run), "--step", "4"]) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint {step[4]} fails its checksum (__0_0.distcp: CRC-32 differs): export an earlier one with "
        f"--step 2 (saved: step 2), or restore step_00000004 from a copy\n")
    manifest = json.loads((step[2] / "manifest.json").read_text())
    garbage = (step[2] / "trainer.pt").read_bytes()[:1000]  # recorded as what the save wrote: as saved, unloadable
    manifest["files"]["trainer.pt"] = {"bytes": len(garbage), "crc32": zlib.crc32(garbage)}
    (step[2] / "manifest.json").write_text(json.dumps(manifest))
    (step[2] / "trainer.pt").write_bytes(b"")
    before = files()
    assert export.main([str(run), "--step", "2"]) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint {step[2]} is damaged (its trainer.pt is truncated: 0 bytes where the save wrote "
        f"{len(garbage)}): the run holds no earlier checkpoint to export instead: restore step_00000002 from a copy\n")
    (step[2] / "trainer.pt").write_bytes(garbage)
    assert export.main([str(run), "--step", "2"]) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint {step[2]} does not load (its trainer.pt: RuntimeError: PytorchStreamReader failed reading "
        f"zip archive: failed finding central directory): the run holds no earlier checkpoint to export instead: "
        f"restore step_00000002 from a copy\n")
    assert files() == {**before, step[2] / "trainer.pt": garbage}


def _old_checkpoint(run_dir, step: int) -> dict:
    """A checkpoint as the earlier version wrote it (format 1): one torch.save'd dict, its .json (size,
    CRC-32), `latest` naming it; the model and optimizer after one step (momentum buffers exist)."""
    cfg = config.load("configs/default.yaml", [*TINY, f"run.dir={run_dir}"])
    torch.manual_seed(0)
    model = cfg.task_class(cfg.task, cfg.seed).model()
    opt = optim.build(cfg.optim, model)
    model(torch.randn(8, 3, 16, 16)).sum().backward()
    opt.step()
    state = {"format": 1, "model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": {}, "step": step,
             "data": {"epoch": 0, "samples_in_epoch": step * 16, "world_size": 1, "seed": 0},
             "rng": [dcp_io.rng_state(torch.device("cpu"))], "window": [{"loss": 0.0, "steps": 0}],
             "eval_pending": False, "world_size": 1, "config": config.to_dict(cfg), "tracker": {"run_id": None}}
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True)
    path = folder / f"step_{step:08d}.pt"
    torch.save(state, path)
    raw = path.read_bytes()
    path.with_suffix(".json").write_text(json.dumps({"crc32": zlib.crc32(raw), "bytes": len(raw), "step": step,
                                                     "file": path.name}))
    (folder / "latest").write_text(f"{path.name}\n")
    return state


def test_a_checkpoint_of_the_earlier_format_is_refused_in_one_line_until_converted(tmp_path, capsys):
    old = _old_checkpoint(tmp_path, 2)
    proc = run_train(tmp_path, "train.steps=4", expect=2)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'checkpoints' / 'step_00000002.pt'} is a checkpoint of an earlier version of this "
        f"project (one .pt file): convert it with `python -m train.checkpoint --convert {tmp_path / 'checkpoints'}`, "
        f"then resume"), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()
    # The command the line names, its main() in this process (the command itself: tests/processes/test_compat.py).
    capsys.readouterr()
    assert convert.main(["--convert", str(tmp_path)]) == 0
    said = capsys.readouterr()
    assert "converted 1 checkpoint(s)" in said.out and said.err == "", said
    new = latest_state(tmp_path)  # the converted folder: the same tensors, by parameter name
    assert all(torch.equal(v, new["model"][k]) for k, v in old["model"].items())
    first = new["optimizer"]["param_groups"][0]["params"][0]
    assert torch.equal(old["optimizer"]["state"][0]["momentum_buffer"],
                       new["optimizer"]["state"][first]["momentum_buffer"]), first
    proc = run_train(tmp_path, "train.steps=4")
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_00000002'} at step 2" in proc.stdout, proc.stdout
    assert [m["step"] for m in metrics(tmp_path) if "loss" in m] == [3, 4]
