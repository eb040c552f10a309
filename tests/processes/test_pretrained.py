"""Models built on the meta device, and weights in and out: task.init_from (a local Hugging Face folder or
another run's checkpoint) and `python -m train.export --format hf`, with the built-in GPT and tiny random
GPT-2 folders that the tests save themselves (tests/hf_models.py; nothing is downloaded)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, ROOT, clean_env, latest_state, metrics
from tests.procs import finish, stop_at
from tests.quick.test_pretrained import gpt_from, hf_models

# The built-in GPT from a tiny GPT-2 folder (vocabulary 100, padded to 128 rows; 64 positions), on the built-in
# corpus (64 tokens), in windows of 32: seconds per run.
LM = ["--config", "configs/gpt.yaml", "task.seq_len=32", "task.train_tokens=20000", "task.eval_tokens=4096",
      "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1", "train.eval_every=0",
      "optim.warmup_steps=2", "data.num_workers=0", "log.wandb.mode=disabled", "log.report=false"]


# The built-in GPT that writes the name of each tensor it draws at its init to $INIT_LOG (tests/init_log_task.py).
LOGGED_INIT = f"task.name={ROOT / 'tests' / 'init_log_task.py'}:LoggedInit"


def _launch(run_dir: Path, *overrides: str, nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    cmd = [PY, "-m", "train.launch", f"--nproc-per-node={nproc}", "--", *LM, f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def draws(log: Path) -> dict[int, list[str]]:
    """{rank: the tensors it drew, in order} from an $INIT_LOG (LoggedInit's lines: RANK NAME)."""
    ranks: dict[int, list[str]] = {}
    for line in log.read_text().splitlines():
        rank, name = line.split()
        ranks.setdefault(int(rank), []).append(name)
    return ranks


def export(*args) -> int:
    """`python -m train.export ARGS`, in this process (torch and transformers are imported already; the command
    line itself is tests/processes/test_export_hf.py's): its exit code, its lines in pytest's captured output."""
    from train import export as export_cmd

    return export_cmd.main([str(a) for a in args])


@pytest.fixture(scope="module")
def fine_tune(tmp_path_factory) -> dict:
    """task.init_from a GPT-2 folder of 48 positions (the tiny preset has 128), 2 ranks FSDP, 8 steps, a checkpoint
    every 2, each launch's draws logged (LoggedInit): `ref` uninterrupted; `run` stopped by SIGTERM after step 3, the
    folder then moved away, the same command relaunched to its end; `ddp` the same fine-tune under DDP, from the
    moved folder. Launched once for the three tests that read them: {name: (exit code, stdout + stderr)}, the
    folders and the logs."""
    root = tmp_path_factory.mktemp("fine_tune")
    folder, moved = hf_models.tiny_gpt2(root / "gpt2", positions=48), root / "moved"
    opts = [LOGGED_INIT, f"task.init_from={folder}", "dist.strategy=fsdp", "train.steps=8", "checkpoint.every=2"]
    runs = {"root": root, "folder": folder, "moved": moved, "opts": opts}

    def launch(name: str, run: str, *overrides: str) -> subprocess.Popen:
        (root / f"{name}.log").write_text("")
        return _launch(root / run, *overrides, env=clean_env(INIT_LOG=str(root / f"{name}.log")))

    rc, out, err = finish(launch("ref", "ref", *opts))
    runs["ref"] = rc, out + err
    stop_at(launch("stopped", "run", *opts), root / "run", 3)
    folder.rename(moved)
    rc, out, err = finish(launch("resumed", "run", *opts))
    runs["resumed"] = rc, out + err
    ddp = [o for o in opts if o not in (f"task.init_from={folder}", "dist.strategy=fsdp")]
    rc, out, err = finish(launch("ddp", "ddp", *ddp, f"task.init_from={moved}", "dist.strategy=ddp"))
    runs["ddp"] = rc, out + err
    return runs


def test_fine_tuned_from_gpt2_under_fsdp_resumed_bitwise_then_exported_to_transformers(fine_tune):
    """task.init_from a GPT-2 folder, 2 ranks FSDP: a run stopped by SIGTERM and relaunched ends bit for bit where
    the uninterrupted one does (the relaunch resumes its own checkpoint, not init_from again); under DDP the
    same first loss and weights within 1% of how far training moved them; the export loads in transformers
    with the trained model's logits; bf16 export too."""
    root, folder, ref, run, ddp = (fine_tune["root"], fine_tune["moved"], fine_tune["root"] / "ref",
                                   fine_tune["root"] / "run", fine_tune["root"] / "ddp")
    rc, out = fine_tune["ref"]
    assert rc == 0, out[-3000:]
    assert f"task.init_from={fine_tune['folder']}: the first step starts from the weights of the Hugging Face model" \
        in out
    first = next(m["loss"] for m in metrics(ref) if "loss" in m)
    assert first < 4.9, first  # GPT-2's random weights: about ln(128); not the 0.02-init of a fresh model
    hf_init = gpt_from(folder).state_dict()

    rc, out = fine_tune["resumed"]
    assert rc == 0, out[-3000:]
    assert "the first step starts from the weights" not in out  # its own checkpoint came first
    a, b = latest_state(ref), latest_state(run)
    assert a["step"] == b["step"] == 8
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k

    rc, out = fine_tune["ddp"]  # the same fine-tune under DDP: the same weights loaded, the same training
    assert rc == 0, out[-3000:]
    assert "dist.strategy=ddp" in out, out[-3000:]
    assert next(m["loss"] for m in metrics(ddp) if "loss" in m) == pytest.approx(first, rel=1e-6)
    for k, v in latest_state(ddp)["model"].items():
        moved = (a["model"][k] - hf_init[k]).norm() if k in hf_init else v.norm()
        assert (v - a["model"][k]).norm() <= 0.01 * moved + 1e-6, k

    assert export(ref, "--format", "hf") == 0
    exported = ref / "export" / "step_00000008-hf"
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["vocab_size"] == 100
    trained = gpt_from(folder)
    trained.load_state_dict(a["model"])
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = trained(tokens)[..., :100]
    theirs = hf_models.logits_of(exported, tokens)
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
    assert not torch.allclose(theirs, hf_models.logits_of(folder, tokens), atol=1e-3)  # trained: moved

    assert export(ref, "--format", "hf", "--dtype", "bf16", "--out", root / "bf16") == 0
    assert json.loads((root / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (hf_models.logits_of(root / "bf16", tokens) - theirs).abs().max() < 0.05  # bf16 rounding


# A GPT-2 folder the built-in GPT would load into other numbers than transformers computes: refused, with why
OTHERWISE = {
    "untied": ({"tie_word_embeddings": False}, "is a GPT-2 with an output layer of its own (tie_word_embeddings: "
                                               "false, its lm_head.weight), and the built-in GPT ties it"),
    "layer_norm_epsilon": ({"layer_norm_epsilon": 1e-3}, "computes otherwise than the built-in GPT "
                                                         "(layer_norm_epsilon: 0.001;"),
    "scale_attn_weights": ({"scale_attn_weights": False}, "computes otherwise than the built-in GPT "
                                                          "(scale_attn_weights: false;"),
}


@pytest.mark.parametrize("case", ["no config.json", "a llama folder", "another vocabulary", "not a model", "missing",
                                  *OTHERWISE, "fp8 with its quantization_config", "fp8 weights alone"])
def test_a_pretrained_folder_that_does_not_fit_is_one_line_exit_2(tmp_path, case):
    folder = hf_models.tiny_gpt2(tmp_path / "gpt2", **OTHERWISE.get(case, ({},))[0])
    overrides = [f"task.init_from={folder}"]
    if case in OTHERWISE:
        words = OTHERWISE[case][1]
    elif case == "fp8 with its quantization_config":
        hf_models.fp8(folder)
        words = "holds a quantized model (fp8 in its config.json), whose weights mean nothing without their scales"
    elif case == "fp8 weights alone":
        hf_models.fp8(folder, scales=False)
        words = "transformer.wte.weight is stored as float8_e4m3fn, not as float32, bfloat16 or float16"
    elif case == "no config.json":
        (folder / "config.json").unlink()
        words = "has no config.json"
    elif case == "a llama folder":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"model_type": "llama",
                                                                 "architectures": ["LlamaForCausalLM"]}))
        words = "holds a llama (LlamaForCausalLM), and the built-in GPT loads GPT-2 folders"
    elif case == "another vocabulary":
        overrides.append("task.vocab_size=64")  # 64 rows; the folder has 100
        words = "transformer.wte.weight has the shape [100, 32], the model's transformer.wte.weight needs [64, 32]"
    elif case == "missing":
        overrides = [f"task.init_from={tmp_path / 'nowhere'}"]
        words = (f"task.init_from: {tmp_path / 'nowhere'} does not exist: check the path (a Hugging Face model folder, "
                 "or a run directory or checkpoint folder of this project, on this machine: nothing is downloaded)")
    else:
        overrides = [f"task.init_from={tmp_path}"]
        words = "is neither a Hugging Face model folder (config.json and *.safetensors) nor a run directory"
    proc = subprocess.run([PY, "-m", "train", *LM, f"run.dir={tmp_path / 'run'}", "train.steps=2", *overrides],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert words in lines[-1] and lines[-1].startswith("error: task.init_from"), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def _build(tmp_path: Path, name: str, *args: str) -> dict:
    """python -m bench.suite.build_memory: the trainer's build on real ranks; its figures (and --save's weights)."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([PY, "-m", "bench.suite.build_memory", "--only", "meta", "--json", str(out), *args], cwd=ROOT,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_fsdp_build(tmp_path_factory) -> tuple[dict, dict]:
    """The built-in GPT of 2 layers, width 64, built on the meta device by 3 ranks under FSDP (shards of unequal
    sizes): its figures and its whole initial weights, for the two tests below."""
    where = tmp_path_factory.mktemp("tiny_fsdp_build")
    figures = _build(where, "fsdp-3", "--nproc=3", "--strategy=fsdp", "--layers=2", "--embd=64",
                     "--save", str(where / "fsdp-3.pt"))
    return figures, torch.load(where / "fsdp-3.pt", weights_only=True)


def test_a_meta_built_model_starts_from_the_same_weights_whatever_the_strategy_and_world_size(tmp_path,
                                                                                              tiny_fsdp_build):
    """The built-in GPT is built on the meta device and given its values shard by shard: one rank under DDP and
    3 ranks under FSDP (shards of unequal sizes) start from the same bits, so comparing FSDP with DDP, or
    one world size with another, still compares like with like."""
    _build(tmp_path, "ddp-1", "--nproc=1", "--strategy=ddp", "--layers=2", "--embd=64", "--save",
           str(tmp_path / "ddp-1.pt"))
    weights = {"ddp-1": torch.load(tmp_path / "ddp-1.pt", weights_only=True), "fsdp-3": tiny_fsdp_build[1]}
    ref = weights["ddp-1"]
    for name, w in weights.items():
        assert w.keys() == ref.keys(), name
        for k in ref:
            assert torch.equal(w[k], ref[k]), f"{name}: {k} differs from one rank's"
    fc = ref["transformer.h.0.mlp.c_fc.weight"]
    assert not torch.equal(fc[: len(fc) // 2], fc[len(fc) // 2:])  # no rank repeats another's rows
    assert abs(fc.std().item() - 0.02) < 0.002 and torch.equal(ref["transformer.h.0.ln_1.weight"],
                                                              torch.ones(64))


def test_a_model_built_on_meta_costs_each_rank_about_its_share_of_host_memory(tmp_path, tiny_fsdp_build):
    """A 200M-parameter GPT (770 MiB of fp32 weights, M) under FSDP on 2 ranks: each rank's peak RSS while the
    trainer builds it stays under M / 2 plus a constant, where a model built whole on each rank's CPU costs
    every rank M. The constant is measured: what the build of a tiny model under FSDP costs a rank (the modules
    FSDP imports at its first use, 120 MiB here; the tiny build of the test above, on 3 ranks: the same per rank
    as on 2, within 1 MiB), plus 128 MiB for one whole tensor while it is initialized and the allocator's slack
    (measured: 40)."""
    small = tiny_fsdp_build[0]
    big = _build(tmp_path, "big", "--nproc=2", "--strategy=fsdp", "--layers=16", "--embd=1024")
    m = big["build_model_mib"]
    assert 700 < m < 900, m
    assert big["build_peak_mib_meta"] < m / 2 + small["build_peak_mib_meta"] + 128, (big, small)


@pytest.fixture(scope="module")
def empty_init_from(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One process, task.init_from= (empty), 1 step, launched from a folder holding a Llama's config.json and
    model.safetensors, its draws logged (LoggedInit): the process and its log."""
    where = tmp_path_factory.mktemp("empty_init_from")
    hf_models.tiny_llama(where, tokenizer=False)  # config.json and model.safetensors in the working directory
    log = where / "init.log"
    proc = subprocess.run([PY, "-m", "train", "--config", str(ROOT / "configs/gpt.yaml"), *LM[2:], LOGGED_INIT,
                           f"run.dir={where / 'run'}", "train.steps=1", "task.init_from="],
                          cwd=where, env=clean_env(PYTHONPATH=str(ROOT), INIT_LOG=str(log)), capture_output=True,
                          text=True, timeout=300)
    return proc, log


def test_an_empty_init_from_is_no_folder_even_where_the_working_directory_holds_a_model(empty_init_from):
    """task.init_from= (empty) is the model's own init: launched from a folder holding another model's config.json,
    the built-in GPT neither refuses it nor takes its sizes."""
    proc, _ = empty_init_from
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model: 805,632 parameters" in proc.stdout, proc.stdout[-3000:]  # the tiny preset, 64 tokens


def test_a_run_from_a_gpt2_folder_resumes_and_exports_after_the_folder_moved(fine_tune, tmp_path):
    """The sizes read from task.init_from's config.json are recorded in the run (config.yaml, the checkpoints'
    config): the same command relaunched after the folder moved resumes, and the run exports."""
    run = fine_tune["root"] / "run"  # its folder of 48 positions moved away after the stop, before the relaunch
    assert not fine_tune["folder"].exists()
    rc, out = fine_tune["resumed"]
    assert rc == 0, out[-3000:]
    assert [m["step"] for m in metrics(run) if "loss" in m] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert export(run, "--format", "hf", "--out", tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["n_positions"], config["n_layer"], config["vocab_size"]) == (48, 2, 100)


def test_a_launch_draws_no_init_for_what_a_checkpoint_or_init_from_fills(fine_tune, empty_init_from):
    """The random init of a tensor that the launch then loads whole is skipped: a run from a GPT-2 folder draws only
    the embedding (its padding rows, 28 of 128, are in no file) on each rank, under FSDP and under DDP, its relaunch
    resuming a checkpoint draws nothing, a fresh run draws every tensor. The resumed run ends where the
    uninterrupted one does."""
    from train import config

    cfg = config.load("configs/gpt.yaml", LM[2:])
    every = [n for n, _ in cfg.task_class(cfg.task, cfg.seed).model().named_parameters()]
    proc, log = empty_init_from
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(every) == 52 and draws(log) == {0: every}
    root = fine_tune["root"]
    for name in ("ref", "stopped", "ddp"):
        assert draws(root / f"{name}.log") == {0: ["transformer.wte.weight"], 1: ["transformer.wte.weight"]}, name
    assert fine_tune["resumed"][0] == 0 and draws(root / "resumed.log") == {}
    a, b = latest_state(root / "ref"), latest_state(root / "run")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
