"""`python -m train.export --format hf` writes what transformers' save_pretrained writes: files split at
--max-shard-size with their index, the tokenizer and generation config of the folder the run started from, a
proper architectures list, --dtype on floating tensors only; a checkpoint or a config.json that does not fit the
model is refused in one line before anything is written. Tiny models (the memory bound:
bench/suite/export_memory.py)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, ROOT, clean_env, latest_state

hf_models = pytest.importorskip("tests.hf_models", reason="pip install -r requirements-hf.txt")

LM = ["--config", "configs/gpt.yaml", "task.seq_len=32", "task.train_tokens=20000", "task.eval_tokens=4096",
      "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1", "train.eval_every=0",
      "optim.warmup_steps=0", "data.num_workers=0", "log.wandb.mode=disabled", "log.report=false", "train.steps=2",
      "checkpoint.every=2"]


def export(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m train.export ARGS`, as the user types it."""
    return subprocess.run([PY, "-m", "train.export", *map(str, args)], cwd=ROOT, env=clean_env(**env),
                          capture_output=True, text=True, timeout=300)


def export_here(capsys, *args) -> tuple[int, str]:
    """The same command's main in this process (its exit code and stderr), without a start-up of its own: for the
    cases that check what one export writes or refuses, once the command itself is tested above."""
    from train import export as command

    capsys.readouterr()
    code = command.main([*map(str, args)])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> tuple[Path, Path]:
    """(folder, run): a tiny GPT-2 folder with a tokenizer, a generation config and `"architectures": null`, and
    the built-in GPT fine-tuned from it under FSDP on 2 ranks to step 2."""
    root = tmp_path_factory.mktemp("gpt_run")
    folder = hf_models.tiny_gpt2(root / "gpt2")
    hf_models.tiny_tokenizer(folder, 100)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": None}))
    run = root / "run"
    proc = subprocess.run([PY, "-m", "train.launch", "--nproc-per-node=2", "--", *LM, f"task.init_from={folder}",
                           "dist.strategy=fsdp", f"run.dir={run}"], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, run


def trained_logits(folder: Path, run: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of the model the run's latest checkpoint holds, computed by the built-in GPT."""
    from train import config
    from train.parallel import wrapping

    cfg = config.load("configs/gpt.yaml", [f"task.init_from={folder}", "task.seq_len=32"])
    task = cfg.task_class(cfg.task, cfg.seed)
    model = wrapping.whole_model(task, torch.device("cpu"), cfg.seed)
    model.load_state_dict(latest_state(run)["model"])
    with torch.no_grad():
        return model.eval()(tokens)[..., :100]


def test_a_sharded_export_is_what_save_pretrained_writes_and_gives_the_trained_logits(tmp_path, capsys, gpt_run):
    """--max-shard-size 20KB: model-0000i-of-0000N.safetensors and model.safetensors.index.json, the same file names,
    split and index (total_size, total_parameters, weight_map) as transformers' save_pretrained of the model it
    builds from the exported config.json, at that size; the files hold exactly the index's keys; from_pretrained
    gives the trained logits. The folder's tokenizer and generation config are copied, and its "architectures":
    null is written as GPT-2's."""
    from safetensors import safe_open

    folder, run = gpt_run
    out = tmp_path / "hf"
    proc = export(run, "--format", "hf", "--max-shard-size", "20KB", "--out", out)
    assert proc.returncode == 0, proc.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n > 4 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert f"in {n} safetensors files" in proc.stdout, proc.stdout
    held = {}
    for name in files:
        with safe_open(out / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            held |= {k: name for k in f.keys()}
            assert (out / name).stat().st_size < 20_000 + 2_000 or len(list(f.keys())) == 1, name
    assert held == index["weight_map"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["tie_word_embeddings"] is True

    t = hf_models.transformers  # the model as transformers builds it from this config.json, saved at 20KB
    t.AutoModelForCausalLM.from_config(t.AutoConfig.from_pretrained(out)).save_pretrained(tmp_path / "theirs",
                                                                                          max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").read_text() == \
        (tmp_path / "theirs" / "model.safetensors.index.json").read_text()
    assert files == sorted(p.name for p in (tmp_path / "theirs").glob("*.safetensors"))

    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(2))
    theirs = hf_models.logits_of(out, tokens)
    assert (trained_logits(folder, run, tokens) - theirs).abs().max() < 1e-5
    assert not torch.allclose(theirs, hf_models.logits_of(folder, tokens), atol=1e-3)  # trained: moved
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name

    code, err = export_here(capsys, run, "--format", "hf", "--out", tmp_path / "one")  # 5GB: one file, no index
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "one").glob("*.safetensors*")) == ["model.safetensors"]
    assert (hf_models.logits_of(tmp_path / "one", tokens) - theirs).abs().max() == 0


@pytest.fixture(scope="module")
def counted_run(tmp_path_factory) -> Path:
    """The built-in GPT with an integer buffer (tests/export_task.py), one process, to step 2."""
    run = tmp_path_factory.mktemp("counted") / "run"
    proc = subprocess.run([PY, "-m", "train", *LM, f"task.name={ROOT / 'tests' / 'export_task.py'}:Counted",
                           f"run.dir={run}"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dtype_casts_the_floating_tensors_and_keeps_an_integer_buffer(tmp_path, capsys, counted_run, dtype):
    from safetensors.torch import load_file

    code, err = export_here(capsys, counted_run, "--format", "hf", "--dtype", dtype, "--out", tmp_path / "hf")
    assert code == 0, err
    files = load_file(tmp_path / "hf" / "model.safetensors")
    state = latest_state(counted_run)["model"]
    assert files["transformer.counts"].dtype == torch.int64 and files["transformer.counts"].tolist() == [70000, 3,
                                                                                                           65537]
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    for key, t in files.items():
        if key != "transformer.counts":
            assert t.dtype == want, key
            stored = state[key].t() if key.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else state[key]
            assert torch.equal(t, stored[:t.shape[0]].to(want)), key


@pytest.mark.parametrize("case", ["config", "model"])
def test_keys_or_shapes_that_do_not_fit_are_refused_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                               counted_run, case):
    """The task's config.json names one layer more than the files hold (checked against the model transformers
    builds from it), or the task's model has one layer more than the checkpoint: one line, exit 2, no file."""
    out = tmp_path / "hf"
    monkeypatch.setenv("EXPORT_BREAK", case)
    code, err = export_here(capsys, counted_run, "--format", "hf", "--max-shard-size", "20KB", "--out", out)
    says = {"config": "would lack 12 tensor(s) of the GPT2LMHeadModel that transformers builds from its config.json, "
                      "e.g. transformer.h.4.ln_1.weight",
            "model": "holds no tensor model.transformer.h.4.ln_1.weight, which the task's model has"}[case]
    assert code == 2 and says in err and err.count("\n") == 1, err
    assert "nothing written" in err
    assert list(tmp_path.iterdir()) == []


def test_the_hf_task_exports_a_folder_whose_architectures_is_null(tmp_path):
    """A Llama folder whose config.json says "architectures": null trains, and exports as LlamaForCausalLM (the
    class the task built), in files that from_pretrained loads."""
    from train import prepare

    folder = hf_models.tiny_llama(tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": None}))
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(random.Random(0).choice(hf_models.TEXT.split()) for _ in range(2000)))
    assert prepare.main([str(text), str(tmp_path / "shards"), "--tokenizer", str(folder)]) == 0
    run = tmp_path / "run"
    proc = subprocess.run([PY, "-m", "train", "--config", "configs/hf.yaml", "task.seq_len=32", "train.precision=fp32",
                           "train.global_batch_size=4", "train.micro_batch_size=4", "train.steps=1",
                           "train.eval_every=0", "checkpoint.every=1", "data.num_workers=0", "log.wandb.mode=disabled",
                           "log.report=false", f"task.path={folder}", f"task.data={tmp_path / 'shards'}",
                           f"run.dir={run}"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = export(run, "--format", "hf", "--max-shard-size", "30KB", "--out", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert "a Hugging Face LlamaForCausalLM" in proc.stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    assert hf_models.logits_of(tmp_path / "hf", tokens).isfinite().all()


def test_a_max_shard_size_that_is_no_size_or_for_pt_is_one_line_exit_2(tmp_path, capsys, counted_run):
    for args, says in ((["--format", "hf", "--max-shard-size", "5XB"], "--max-shard-size 5XB: give a size such as "
                                                                       "5GB or 100MB"),
                       (["--format", "hf", "--max-shard-size", "0MB"], "--max-shard-size 0MB: give a size"),
                       (["--max-shard-size", "1GB"], "--max-shard-size splits --format hf's safetensors files")):
        code, err = export_here(capsys, counted_run, *args, "--out", tmp_path / "out")
        assert code == 2 and says in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []
