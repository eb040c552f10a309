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
    "a folder that does not exist": "does not exist: check the path (a Hugging Face model folder, copied to this "
                                    "machine: nothing is downloaded)",
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
    if case == "a folder that does not exist":
        bad = tmp_path / "nowhere"
    elif case == "no config.json":
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


def test_prepare_with_a_hugging_face_tokenizer_writes_its_ids_with_documents_kept_apart(tmp_path, monkeypatch):
    """--tokenizer PATH (a model folder or its tokenizer.json): each file its post-processor's <|begin_of_text|>, its
    tokens, then the tokenizer's <|end_of_text|> (tokenizer_config.json's eos_token); read in blocks of 64 characters,
    4 encoded at a time, the tokens are those of the whole text; a .jsonl file is a document a line; a file that is
    no tokenizer, one without an end-of-text token, a line without "text": one line, exit 2, nothing written."""
    from tokenizers import Tokenizer, models

    from train import prepare as prepare_cmd
    from train.tasks import shards

    folder = hf_models.tiny_tokenizer(tmp_path / "model")
    (tmp_path / "in").mkdir()
    texts = [hf_models.TEXT * 3, "the lazy dog saves nine. " * 20]
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i}.txt").write_text(text)
    monkeypatch.setattr(prepare_cmd, "BLOCK_CHARS", 64)
    monkeypatch.setattr(prepare_cmd, "BATCH", 2)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for i, where in enumerate((folder, folder / "tokenizer.json")):
        assert prepare_cmd.main([str(tmp_path / "in"), str(tmp_path / f"out{i}"), "--tokenizer", str(where)]) == 0
        back = [shards.open_shard(p).tokens().tolist() for split in ("train", "val")
                for p in sorted((tmp_path / f"out{i}").glob(f"in_{split}_*.bin"))]
        assert sum(back, []) == [t for text in texts for t in [*tok.encode(text).ids, 1]]  # 1: <|end_of_text|>
        assert back[0][0] == 0  # <|begin_of_text|>
        assert tok.decode(sum(back, []), skip_special_tokens=False) == "".join(
            f"<|begin_of_text|>{text}<|end_of_text|>" for text in texts)

    docs = ["the quick brown fox.", "a stitch in time saves nine. " * 9, "all that glitters"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs * 4))
    assert prepare_cmd.main([str(tmp_path / "docs.jsonl"), str(tmp_path / "jsonl"), "--tokenizer", str(folder)]) == 0
    back = [shards.open_shard(p).tokens().tolist() for split in ("train", "val")
            for p in sorted((tmp_path / "jsonl").glob(f"docs_{split}_*.bin"))]
    assert sum(back, []) == [t for d in docs * 4 for t in [*tok.encode(d).ids, 1]]  # a document a line
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "b.jsonl").write_text(json.dumps({"text": "the dog"}) + "\n" + json.dumps({"txt": "x"}))

    chat = hf_models.chat_tokenizer(tmp_path / "chat", "llama3")  # eos_token <|eot_id|>: a turn's end, not a text's
    (tmp_path / "words").mkdir()
    (tmp_path / "words" / "w.txt").write_text("w1 w2 w3 " * 20)
    assert prepare_cmd.main([str(tmp_path / "words"), str(tmp_path / "chat-out"), "--tokenizer", str(chat)]) == 0
    back = [shards.open_shard(p).tokens().tolist() for split in ("train", "val")
            for p in sorted((tmp_path / "chat-out").glob(f"words_{split}_*.bin"))]
    assert sum(back, [])[-1] == 1 and Tokenizer.from_file(str(chat / "tokenizer.json")).id_to_token(1) == (
        "<|end_of_text|>")

    bare = Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0"))
    bare.save(str(tmp_path / "bare.json"))
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    for data, where, words in ((tmp_path / "in", tmp_path / "bare.json", "has no end-of-text token to put between"),
                               (tmp_path / "in", tmp_path / "bad.json", "does not read as a Hugging Face tokenizer"),
                               (tmp_path / "bad", folder, "b.jsonl:2: not a JSON object with \"text\"")):
        proc = subprocess.run([PY, "-m", "train.prepare", str(data), str(tmp_path / "o"), "--tokenizer",
                               str(where)], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_128256_token_vocabulary_prepares_uint32_shards_that_both_tasks_train_on(tmp_path):
    """Llama 3's vocabulary size: prepare writes llm.c's llama-3 shards (magic 20240801, version 7, uint32), whose
    tokens decode back to the text, ids over 65535 included; the built-in GPT and a Llama of that vocabulary train on
    them a few steps; nanoGPT's uint16 format is refused in one line."""
    import numpy as np
    from tokenizers import Tokenizer

    from train import prepare as prepare_cmd
    from train.tasks import shards

    vocab = 128_256
    model = hf_models.tiny_llama(tmp_path / "model", vocab=vocab, tokenizer=False)
    hf_models.word_tokenizer(model, vocab, ["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|>",
                             "<|end_of_text|>")
    rng = np.random.default_rng(0)
    (tmp_path / "in").mkdir()
    texts = [" ".join(f"w{i}" for i in rng.integers(0, vocab - 2, n)) for n in (1500, 700)]
    for i, text in enumerate(texts):
        (tmp_path / "in" / f"{i}.txt").write_text(text)
    out = tmp_path / "shards"
    assert prepare_cmd.main([str(tmp_path / "in"), str(out), "--tokenizer", str(model)]) == 0
    header = np.fromfile(out / "in_train_000000.bin", dtype="<i4", count=256)
    assert header[:2].tolist() == [20240801, 7]
    back = [shards.open_shard(p) for split in ("train", "val") for p in sorted(out.glob(f"in_{split}_*.bin"))]
    assert all(s.dtype == np.dtype("<u4") for s in back)
    ids = np.concatenate([s.tokens() for s in back])
    assert len(ids) == 1500 + 700 + 4 and ids.max() > 2**16
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert tok.decode(ids.tolist(), skip_special_tokens=False) == " ".join(
        f"<|begin_of_text|> {text} <|end_of_text|>" for text in texts)

    few = ["train.steps=2", "train.eval_every=2", "checkpoint.every=0"]
    gpt = [PY, "-m", "train", "--config", "configs/gpt.yaml", f"task.data={out}", f"task.vocab_size={vocab}",
           "task.model=nano", "task.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=4",
           "data.num_workers=0", "train.log_every=1", "log.wandb.mode=disabled", "log.report=false",
           f"run.dir={tmp_path / 'gpt'}", *few]
    for cmd in (gpt, [PY, "-m", "train", *HF, f"task.path={model}", f"task.data={out}", f"run.dir={tmp_path / 'hf'}",
                      "train.global_batch_size=4", "dist.strategy=ddp", *few]):
        proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for run in (tmp_path / "gpt", tmp_path / "hf"):
        losses = train_losses(run)
        assert len(losses) == 2 and all(10 < v < 13 for v in losses.values()), losses  # about ln(128256) = 11.76

    proc = subprocess.run([PY, "-m", "train.prepare", str(tmp_path / "in"), str(tmp_path / "o"), "--tokenizer",
                           str(model), "--format", "nanogpt"], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "more than nanoGPT's uint16 files hold" in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()


def chats(path: Path, conversations: list[list[tuple[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) + "\n"
                            for conv in conversations))
    return path


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_chat_prepare_masks_the_assistant_turns_through_the_tokenizers_own_template(tmp_path, style):
    """--chat renders each conversation with the tokenizer's chat template (a Llama-3-style and a ChatML-style one,
    neither with {% generation %} markers): the mask beside the shards counts the assistant's tokens and the end of
    each of its turns, nothing else; the windows hold one conversation each (a longer one split at window boundaries,
    still masked), padded, the targets that do not count IGNORE."""
    import numpy as np

    from train import prepare as prepare_cmd
    from train.tasks import shards

    folder = hf_models.chat_tokenizer(tmp_path / "model", style)
    conv = [("system", "w1 w2"), ("user", "w3 w4 w5"), ("assistant", "w6 w7"), ("user", "w8"), ("assistant", "w9")]
    long = [("user", " ".join(f"w{i}" for i in range(40))), ("assistant", " ".join(f"w{i}" for i in range(100, 140)))]
    data = chats(tmp_path / "chats.jsonl", [conv] * 6 + [long] + [conv] * 3)
    assert prepare_cmd.main([str(data), str(tmp_path / "out"), "--tokenizer", str(folder), "--chat",
                             "--val-fraction", "0.2"]) == 0
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "chats_train_000000.bin", "chats_train_000000.mask", "chats_val_000000.bin", "chats_val_000000.mask"]
    tokens = np.concatenate([shards.open_shard(out / f"chats_{s}_000000.bin").tokens() for s in ("train", "val")])
    mask = np.concatenate([np.fromfile(out / f"chats_{s}_000000.mask", np.uint8) for s in ("train", "val")])
    transformers = hf_models.transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = lambda text: tok.convert_tokens_to_ids(text.split())  # noqa: E731
    if style == "llama3":
        turn = lambda role, text, *, counted=False: [(t, False) for t in ids(  # noqa: E731
            f"<|start_header_id|> {role} <|end_header_id|>")] + [(t, counted) for t in ids(f"{text} <|eot_id|>")]
        first = [(ids("<|begin_of_text|>")[0], False)]
    else:
        turn = lambda role, text, *, counted=False: [(t, False) for t in ids(f"<|im_start|> {role}")] + [  # noqa: E731
            (t, counted) for t in ids(f"{text} <|im_end|>")]
        first = []
    expect = []
    for c in [conv] * 6 + [long] + [conv] * 3:
        one = first + [x for role, text in c for x in turn(role, text, counted=role == "assistant")]
        expect += [(t, int(counted) | (2 if i == 0 else 0)) for i, (t, counted) in enumerate(one)]
    assert list(zip(tokens.tolist(), mask.tolist(), strict=True)) == expect

    seq_len = 16
    train = shards.MaskedWindows([shards.open_shard(out / "chats_train_000000.bin")], seq_len)
    starts = np.flatnonzero(mask[:len(train.shards[0].tokens())] & 2).tolist() + [train.shards[0].count]
    expected = []  # independently: each conversation in windows of seq_len + 1 from its start, every seq_len tokens
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        expected += [(b, min(b + seq_len + 1, hi)) for b in range(lo, hi - 1, seq_len)]
    assert len(train) == len(expected) > 7
    for i, (b, e) in enumerate(expected):
        x, y = train[i]
        n = e - b - 1
        assert x[:n].tolist() == tokens[b:e - 1].tolist() and not x[n:].any()
        want = [t if m & 1 else shards.IGNORE for t, m in zip(tokens[b + 1:e], mask[b + 1:e], strict=True)]
        assert y.tolist() == want + [shards.IGNORE] * (seq_len - n)
    assert any(y.ne(shards.IGNORE).sum() > 0 for x, y in (train[i] for i in range(len(train))))


def test_chat_errors_are_one_line(tmp_path, capsys):
    """A tokenizer without a chat template, a line that is no conversation, one without an assistant turn, masks
    missing beside some shards: one line naming the cause."""
    from train import prepare as prepare_cmd
    from train.config import ConfigError
    from train.tasks import shards

    plain = hf_models.tiny_tokenizer(tmp_path / "plain")
    folder = hf_models.chat_tokenizer(tmp_path / "model", "chatml")
    ok = [("user", "w1"), ("assistant", "w2")]
    cases = [
        (plain, chats(tmp_path / "a.jsonl", [ok] * 4), "has no chat template"),
        (folder, tmp_path / "none.jsonl", "is not a file"),
        (folder, chats(tmp_path / "b.jsonl", [ok, [("user", "w1")]]), "b.jsonl:2: no assistant turn"),
    ]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n{oops\n")
    cases.append((folder, tmp_path / "c.jsonl", "c.jsonl:1: no assistant turn"))
    (tmp_path / "d.jsonl").write_text('{"text": "w1"}\n')
    cases.append((folder, tmp_path / "d.jsonl", "d.jsonl:1: not a JSON object with \"messages\""))
    for model, data, words in cases:  # in this process: transformers is imported once
        capsys.readouterr()
        rc = prepare_cmd.main([str(data), str(tmp_path / "o"), "--tokenizer", str(model), "--chat"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (words, lines)
        assert not (tmp_path / "o").exists()
    assert prepare_cmd.main([str(chats(tmp_path / "e.jsonl", [ok] * 10)), str(tmp_path / "e"), "--tokenizer",
                             str(folder), "--chat"]) == 0
    (tmp_path / "e" / "e_val_000000.mask").unlink()
    with pytest.raises(ConfigError, match="e_val_000000.bin has no loss mask"):
        shards.windows(str(tmp_path / "e"), "", "auto", 4, 300)


def test_a_masked_chat_run_learns_the_assistant_where_the_same_data_unmasked_does_not(tmp_path):
    """Conversations whose user turns are 12 random words of 200 and whose assistant turn is always the same 4 words:
    the built-in GPT (nano, windows of 32: a conversation each) trained 300 steps on the masked shards gets the
    evaluation loss on the assistant's tokens near 0; on the same shards without their masks, the loss over every
    token stays above 0.8 x the user words' share of the tokens x their entropy (ln 200)."""
    import math

    import numpy as np

    from tests.conftest import summary
    from train import prepare as prepare_cmd

    folder = hf_models.chat_tokenizer(tmp_path / "model", "chatml", words=204)
    rng = np.random.default_rng(0)
    convs = [[("user", " ".join(f"w{i}" for i in rng.integers(0, 200, 12))), ("assistant", "w200 w201 w202 w203")]
             for _ in range(1200)]
    out = tmp_path / "out"
    assert prepare_cmd.main([str(chats(tmp_path / "chats.jsonl", convs)), str(out), "--tokenizer", str(folder),
                             "--chat"]) == 0
    per_conv = 2 + 12 + 1 + 2 + 4 + 1  # <|im_start|> user (12 words) <|im_end|> <|im_start|> assistant (4) <|im_end|>
    bound = 0.8 * 12 / per_conv * math.log(200)
    runs = {}
    for name in ("masked", "unmasked"):
        if name == "unmasked":
            for mask in out.glob("*.mask"):
                mask.unlink()
        cmd = [PY, "-m", "train", "--config", "configs/gpt.yaml", f"task.data={out}", "task.vocab_size=210",
               "task.model=nano", "task.seq_len=32", "train.steps=300", "train.global_batch_size=16",
               "train.micro_batch_size=16", "train.eval_every=0", "train.log_every=50", "checkpoint.every=0",
               "data.num_workers=0", "log.wandb.mode=disabled", "log.report=false", f"run.dir={tmp_path / name}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = summary(tmp_path / name)["eval_loss"]
    assert runs["masked"] < 0.05 and runs["unmasked"] > bound, (runs, bound)


def test_the_hf_task_reads_the_masks_and_its_loss_counts_the_assistant_tokens_only(tmp_path):
    """The Hugging Face task on masked shards: its windows are a conversation each, its loss the mean cross entropy of
    transformers' logits over the assistant's targets alone, its evaluation summed over them and counting them."""
    import torch.nn.functional as F

    from train import config
    from train import prepare as prepare_cmd
    from train.tasks import shards

    folder = hf_models.tiny_llama(tmp_path / "model", vocab=206, tokenizer=False)
    hf_models.chat_tokenizer(folder, "chatml")
    conv = [("user", "w3 w4 w5"), ("assistant", "w6 w7"), ("user", "w8"), ("assistant", "w9 w10 w11")]
    assert prepare_cmd.main([str(chats(tmp_path / "chats.jsonl", [conv] * 20)), str(tmp_path / "out"),
                             "--tokenizer", str(folder), "--chat"]) == 0
    cfg = config.load("configs/hf.yaml", [f"task.path={folder}", f"task.data={tmp_path / 'out'}", "task.seq_len=32"])
    task = cfg.task_class(cfg.task, cfg.seed)
    train, val = task.datasets()
    assert isinstance(train, shards.MaskedWindows) and len(train) == 18 and len(val) == 2  # a conversation a window
    x, y = (torch.stack(t) for t in zip(*(train[i] for i in range(4)), strict=True))
    counted = y != shards.IGNORE
    assert counted.sum() == 4 * 7  # w6 w7 <|im_end|> w9 w10 w11 <|im_end|>
    _, model = task_model(folder)
    with torch.no_grad():
        logits = hf_models.logits_of(folder, x)
        expect = F.cross_entropy(logits[counted], y[counted])
        assert task.loss(model, (x, y)).item() == pytest.approx(expect.item(), rel=1e-5)
        ev = task.eval_step(model, (x, y))
    assert ev["count"] == 28 and ev["loss"].item() == pytest.approx(28 * expect.item(), rel=1e-5)
