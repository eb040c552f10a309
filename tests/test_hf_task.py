"""The Hugging Face task (train.tasks.hf:CausalLM): a tiny random Llama folder and its tokenizer, saved by the tests
themselves (tests/hf_models.py; nothing is downloaded), built on the meta device, trained on shards of its own
tokenizer under every promise of the trainer (a stop and a bitwise resume, a world-size and strategy change), exported
back to a folder that transformers loads; and the folders and shards that do not fit it, one line each, exit 2."""

from __future__ import annotations

import json
import logging
import random
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, ROOT, clean_env, latest_state, metrics, train_losses
from tests.procs import finish, stop_at

hf_models = pytest.importorskip("tests.hf_models", reason="pip install -r requirements-hf.txt")

LOG = logging.getLogger("test")
# configs/hf.yaml shrunk to seconds a run: windows of 32 tokens, 8 a step (2 ranks: 2 micro-steps of 2), fp32 on the
# CPU, a constant learning rate (no warm-up, no decay: a run's schedule does not depend on the train.steps it ends
# at, so a run to step 8 is the first 8 steps of one to step 10), an evaluation every 4 steps, a checkpoint every 2.
HF = ["--config", "configs/hf.yaml", "task.seq_len=32", "train.precision=fp32", "train.global_batch_size=8",
      "train.micro_batch_size=2", "train.log_every=1", "train.eval_every=4", "optim.lr=1e-3", "optim.warmup_steps=0",
      "optim.min_lr_ratio=1.0", "checkpoint.every=2", "checkpoint.keep=5", "data.num_workers=0",
      "log.wandb.mode=disabled", "log.report=false"]


def prepare(folder: Path, out: Path, text: Path) -> Path:
    """python -m train.prepare TEXT OUT --tokenizer FOLDER (in this process: torch is imported already)."""
    from train import prepare as prepare_cmd

    assert prepare_cmd.main([str(text), str(out), "--tokenizer", str(folder)]) == 0
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama folder with its tokenizer, and shards of a text in words of that tokenizer's text made with it:
    about 7000 training tokens (200 windows of 32) and 800 validation tokens."""
    root = tmp_path_factory.mktemp("llama")
    folder = hf_models.tiny_llama(root / "model")
    words = hf_models.TEXT.split()
    rng = random.Random(0)
    text = root / "corpus.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(6000)))
    return folder, prepare(folder, root / "shards", text)


def task_model(folder: Path, state: dict | None = None, *overrides: str):
    """The task's model as the trainer makes it on one rank (no process group): built on meta, given its values
    (init_parameter), then the folder's weights (train.checkpoint.pretrained.load), or a checkpoint's `state`."""
    from train import config
    from train.checkpoint import pretrained
    from train.parallel import wrapping

    cfg = config.load("configs/hf.yaml", [f"task.path={folder}", "task.seq_len=32", *overrides])
    task = cfg.task_class(cfg.task, cfg.seed)
    model = task.model()
    assert wrapping.on_meta(model)
    wrapping.materialize(model, task, torch.device("cpu"), cfg.seed)
    pretrained.load(model, task, str(folder), LOG)
    if state is not None:
        model.load_state_dict(state)
    return task, model.eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_llama_folder_built_on_meta_gives_transformers_logits(tmp_path, tie):
    """The rotary embeddings' frequencies, in no file, are computed by init_parameter; the weights come from the
    folder through DCP (a tied lm_head.weight is not in the files): logits equal transformers' own, bit for bit."""
    folder = hf_models.tiny_llama(tmp_path / "llama", tie=tie)
    task, model = task_model(folder)
    assert [id(b) for b in task.blocks(model)] == [id(layer) for layer in model.model.layers]
    assert ("lm_head.weight" in task.hf_model(model).tensors) is not tie
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens).logits
    theirs = hf_models.logits_of(folder, tokens)
    assert (ours - theirs).abs().max() < 1e-6, (ours - theirs).abs().max()


def test_gpt2_as_the_hub_stores_it_without_the_transformer_prefix_gives_transformers_logits(tmp_path):
    """openai-community/gpt2's files name the base model's tensors without its prefix (wte.weight, not
    transformer.wte.weight), as transformers' from_pretrained takes them: the task loads them too."""
    folder = hf_models.tiny_gpt2(tmp_path / "gpt2")
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    theirs = hf_models.logits_of(folder, tokens)
    hf_models.without_prefix(folder)
    assert torch.equal(hf_models.logits_of(folder, tokens), theirs)  # transformers: the same model
    _, model = task_model(folder)
    with torch.no_grad():
        ours = model(tokens).logits
    assert (ours - theirs).abs().max() < 1e-6, (ours - theirs).abs().max()


def test_a_model_without_sdpa_attention_loads_with_task_attention_eager_and_transformers_logits(tmp_path):
    """GPT-Neo has no sdpa attention in transformers (refused in one line that says task.attention=eager): with
    eager attention the task computes transformers' logits."""
    folder = hf_models.tiny_other(tmp_path / "neo", "gpt_neo")
    _, model = task_model(folder, None, "task.attention=eager")
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens).logits
    theirs = hf_models.logits_of(folder, tokens)
    assert (ours - theirs).abs().max() < 1e-6, (ours - theirs).abs().max()


def test_activation_checkpointing_of_the_decoder_layers_gives_the_same_loss_and_gradients(tmp_path):
    """The blocks (the decoder layers) recomputed in the backward (train.activation_checkpointing: wrapping's
    torch.utils.checkpoint of each, whose forward transformers calls with keyword arguments): the same loss and
    gradients as without, to float rounding."""
    from train.parallel import wrapping

    folder = hf_models.tiny_llama(tmp_path / "llama")
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(3))
    batch = tokens[:, :-1], tokens[:, 1:]
    grads, calls = [], []
    for recompute in (False, True):
        task, model = task_model(folder)
        layer, forward, called = model.model.layers[0], model.model.layers[0].forward, []
        layer.forward = lambda *args, _f=forward, _c=called, **kwargs: _c.append(1) or _f(*args, **kwargs)
        if recompute:
            for block in task.blocks(model):
                wrapping._checkpoint(block)
        loss = task.loss(model.train(), batch)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        calls.append(len(called))
    assert calls == [1, 2]  # run again in the backward
    (a, ga), (b, gb) = grads
    assert torch.allclose(a, b, rtol=1e-6, atol=0) and ga.keys() == gb.keys()
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-8), n


def _launch(run_dir: Path, folder: Path, data: Path, *overrides: str, nproc: int = 2) -> subprocess.Popen:
    cmd = [PY, "-m", "train.launch", f"--nproc-per-node={nproc}", "--", *HF, f"task.path={folder}", f"task.data={data}",
           f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _state(run_dir: Path, step: int) -> dict:
    from train.checkpoint.dcp_io import read_state

    return read_state(run_dir / "checkpoints" / f"step_{step:08d}")


def test_fine_tuned_under_fsdp_stopped_resumed_bitwise_resized_and_exported_to_transformers(tmp_path, llama):
    """2 ranks FSDP from the folder's weights to step 10 (the reference). Another run: stopped by SIGTERM after step
    3, relaunched to step 8: bit for bit the reference's step 8 (its own checkpoint came first, not the folder
    again). Relaunched on 1 rank under DDP to step 10: the weights resharded from 2 ranks' FSDP checkpoint go on
    to the reference's step 10 but for the rounding of another batch split. The reference's export loads in
    transformers with the trained model's logits and the folder's tokenizer; a bf16 export says bfloat16."""
    from safetensors.torch import load_file

    folder, data = llama
    ref, run = tmp_path / "ref", tmp_path / "run"
    rc, out, err = finish(_launch(ref, folder, data, "train.steps=10"))
    assert rc == 0, err[-3000:]
    assert f"task.path={folder}: the first step starts from the weights of the Hugging Face model" in out + err
    assert "dist.strategy=fsdp" in out + err
    first = train_losses(ref)[1]
    assert 4.0 < first < 5.5, first  # a random model's, about ln(128) = 4.85
    assert any("eval_loss" in m for m in metrics(ref))

    stop_at(_launch(run, folder, data, "train.steps=8"), run, 3)
    rc, out, err = finish(_launch(run, folder, data, "train.steps=8"))
    assert rc == 0, err[-3000:]
    assert "the first step starts from the weights" not in out + err  # its own checkpoint came first
    a, b = _state(ref, 8), latest_state(run)
    assert b["step"] == 8 and a["model"].keys() == b["model"].keys()
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert {s: v for s, v in train_losses(run).items()} == {s: v for s, v in train_losses(ref).items() if s <= 8}

    rc, out, err = finish(_launch(run, folder, data, "train.steps=10", "dist.strategy=ddp", nproc=1))
    assert rc == 0, err[-3000:]
    assert "world size changed from 2 to 1" in out + err and "at step 8" in out + err, (out + err)[-3000:]
    assert train_losses(run)[9] == pytest.approx(train_losses(ref)[9], rel=1e-4)
    init = load_file(str(folder / "model.safetensors"))
    a, b = latest_state(ref)["model"], latest_state(run)["model"]
    for k in init:
        moved = (a[k] - init[k]).norm()
        assert moved > 0 and (a[k] - b[k]).norm() <= 0.01 * moved, f"{k} differs"

    from train import export

    assert export.main([str(ref), "--format", "hf"]) == 0
    exported = ref / "export" / "step_00000010-hf"
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 128
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (folder / name).read_bytes(), name
    _, trained = task_model(folder, a)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = trained(tokens).logits
    theirs = hf_models.logits_of(exported, tokens)
    assert (ours - theirs).abs().max() < 1e-6, (ours - theirs).abs().max()
    assert not torch.allclose(theirs, hf_models.logits_of(folder, tokens), atol=1e-3)  # trained: moved

    assert export.main([str(ref), "--format", "hf", "--dtype", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    # the folder's config.json (transformers 5 writes "dtype": "float32") does not say float32 over bf16 files
    assert hf_models.transformers.AutoConfig.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16


CASES = {
    "no config.json": "has no config.json",
    "an unknown model_type": "has model_type 'llama-from-the-future', which transformers",
    "shapes that do not fit": "model.layers.0.mlp.gate_proj.weight has the shape [64, 32], the model's "
                              "model.layers.0.mlp.gate_proj.weight needs [96, 32]",
    "a larger tokenizer in the folder": "tokenizer.json has a vocabulary of 300 tokens, more than the model's 128",
    "shards of a larger tokenizer": ">= the vocab_size of",
    "a missing shard": "lacks 1 of the 2 safetensors files that its model.safetensors.index.json names "
                       "(model-00002-of-00002.safetensors): a copy or a download that stopped early",
    "a git-lfs pointer": "model.safetensors is a git-lfs pointer file, not the weights (a git clone without git-lfs)",
    "GPT-NeoX, renamed on load": "has no tensor lm_head.weight (it has 28, e.g. embed_out.weight, "
                                 "gpt_neox.embed_in.weight, gpt_neox.final_layer_norm.bias): transformers renames or "
                                 "fuses the tensors of GPTNeoXForCausalLM as it loads them (^embed_out\\. -> lm_head.)",
    "GPT-Neo, without sdpa": "task.attention: transformers " + hf_models.transformers.__version__ + " has no sdpa "
                             "attention for the gpt_neo model of",
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_folder_or_shards_that_do_not_fit_the_model_are_one_line_exit_2(tmp_path, llama, case):
    folder, data = llama
    bad = hf_models.tiny_llama(tmp_path / "model", tokenizer=False,
                               max_shard_size="60KB" if case == "a missing shard" else None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes((folder / name).read_bytes())
    config = json.loads((bad / "config.json").read_text())
    if case == "no config.json":
        (bad / "config.json").unlink()
    elif case == "an unknown model_type":
        (bad / "config.json").write_text(json.dumps(config | {"model_type": "llama-from-the-future"}))
    elif case == "shapes that do not fit":
        (bad / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    elif case == "a missing shard":
        assert len(list(bad.glob("*.safetensors"))) == 2
        (bad / "model-00002-of-00002.safetensors").unlink()
    elif case == "a git-lfs pointer":
        (bad / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:"
                                               + "0" * 64 + "\nsize 123456\n")
    elif case.startswith("GPT-Neo"):
        hf_models.tiny_other(bad, "gpt_neox" if case.startswith("GPT-NeoX") else "gpt_neo")
        (bad / "model.safetensors.index.json").unlink(missing_ok=True)
    elif case == "a larger tokenizer in the folder":
        hf_models.tiny_tokenizer(bad, vocab=300)
    else:
        text = tmp_path / "corpus.txt"
        text.write_text(hf_models.TEXT * 40)
        data = prepare(hf_models.tiny_tokenizer(tmp_path / "large", vocab=300), tmp_path / "shards", text)
    proc = subprocess.run([PY, "-m", "train", *HF, f"task.path={bad}", f"task.data={data}",
                           f"run.dir={tmp_path / 'run'}", "train.steps=2"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and CASES[case] in lines[-1], proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_prepare_with_a_hugging_face_tokenizer_writes_its_ids_and_refuses_what_uint16_cannot_hold(tmp_path):
    """--tokenizer PATH (a model folder or its tokenizer.json): each file encoded whole as the tokenizer does it (its
    post-processor's <|begin_of_text|> first); a vocabulary beyond uint16, or a file that is no tokenizer: one line,
    exit 2, nothing written."""
    from tokenizers import Tokenizer, models

    from train import prepare as prepare_cmd
    from train.tasks import shards

    folder = hf_models.tiny_tokenizer(tmp_path / "model")
    (tmp_path / "in").mkdir()
    texts = [hf_models.TEXT * 3, "the lazy dog saves nine. " * 20]
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i}.txt").write_text(text)
    for i, where in enumerate((folder, folder / "tokenizer.json")):
        assert prepare_cmd.main([str(tmp_path / "in"), str(tmp_path / f"out{i}"), "--tokenizer", str(where)]) == 0
        back = [shards.open_shard(p).tokens().tolist() for split in ("train", "val")
                for p in sorted((tmp_path / f"out{i}").glob(f"in_{split}_*.bin"))]
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert sum(back, []) == [t for text in texts for t in tok.encode(text).ids]
        assert back[0][0] == 0  # <|begin_of_text|>

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    for where, words in ((tmp_path / "big.json", "has a vocabulary of 70000 tokens; shards hold uint16 token ids"),
                         (tmp_path / "bad.json", "does not read as a Hugging Face tokenizer")):
        proc = subprocess.run([PY, "-m", "train.prepare", str(tmp_path / "in"), str(tmp_path / "o"), "--tokenizer",
                               str(where)], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()
