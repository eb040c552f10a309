"""The Hugging Face task (train.tasks.hf:CausalLM): a tiny random Llama folder and its tokenizer, saved by the tests
themselves (tests/hf_models.py; nothing is downloaded), built on the meta device, trained on shards of its own
tokenizer under every promise of the trainer (a stop and a bitwise resume, a world-size and strategy change), exported
back to a folder that transformers loads; and the folders and shards that do not fit it, one line each, exit 2."""
from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import PY, ROOT, clean_env, latest_state, metrics, train_losses
from tests.procs import finish, stop_at
from tests.quick.test_hf_task import chats, hf_models, task_model

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


def _launch(run_dir: Path, folder: Path, data: Path, *overrides: str, nproc: int = 2) -> subprocess.Popen:
    """`python -m train.launch` on nproc ranks; nproc=1: `python -m train`, one process (no torchrun)."""
    launcher = ["-m", "train.launch", f"--nproc-per-node={nproc}", "--"] if nproc > 1 else ["-m", "train"]
    cmd = [PY, *launcher, *HF, f"task.path={folder}", f"task.data={data}", f"run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _state(run_dir: Path, step: int) -> dict:
    from train.checkpoint.dcp_io import read_state

    return read_state(run_dir / "checkpoints" / f"step_{step:08d}")


def test_fine_tuned_under_fsdp_stopped_resumed_bitwise_resized_and_exported_to_transformers(tmp_path, llama):
    """2 ranks FSDP from the folder's weights to step 10 (the reference). Another run: stopped by SIGTERM after step
    3, relaunched to step 8: bit for bit the reference's step 8 (its own checkpoint came first, not the folder
    again). Relaunched as one process (`python -m train`, no torchrun) under DDP to step 10: the weights resharded
    from 2 ranks' FSDP checkpoint go on to the reference's step 10 but for the rounding of another batch split. The
    reference's export loads in transformers with the trained model's logits and the folder's tokenizer; a bf16
    export says bfloat16."""
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


def test_lora_under_fsdp_hsdp_and_ddp_resumes_bitwise_and_exports_for_peft_and_merged(tmp_path, llama):
    """task.lora_rank=4 (dropout 0.1 on the adapters' input): 2 ranks FSDP to step 6 (the reference): only the 8
    adapter tensors train (the log says so) and hold optimizer state, every frozen weight is still the folder's.
    Another run stopped after step 3 and relaunched under HSDP (2 replicas) to 6: bit for bit the reference
    (adapters, optimizer, losses); it goes on under DDP to step 8: after each, the frozen weights still the
    folder's, the ranks in sync. The reference's export: its adapters as peft saves them, which
    PeftModel.from_pretrained loads over the folder with the trained model's logits bit for bit; --merged, a folder
    transformers loads alone with those logits, peft's own merge_and_unload's bit for bit."""
    import peft
    from safetensors.torch import load_file

    from tests.conftest import summary
    from train import export

    folder, data = llama
    lora = ["task.lora_rank=4", "task.lora_dropout=0.1"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    rc, out, err = finish(_launch(ref, folder, data, "train.steps=6", *lora))
    assert rc == 0, err[-3000:]
    assert "(dist.strategy=fsdp); 896 of them trained, the rest frozen" in out + err, (out + err)[-3000:]
    init, a = load_file(str(folder / "model.safetensors")), _state(ref, 6)
    adapters = sorted(k for k in a["model"] if ".lora_" in k)
    assert len(adapters) == 8 and sorted(a["optimizer"]["state"]) == adapters
    for k, v in a["model"].items():
        if k not in adapters:
            assert torch.equal(v, init[k.replace(".base_layer.", ".")]), f"{k} moved"
    assert all(a["model"][k].any() for k in adapters)  # lora_B too: trained away from its zero

    # stopped under FSDP, resumed under HSDP (2 replicas of 1 shard): on 2 ranks each gradient is the same sum of
    # two halves either way, so the resharded resume is bit for bit the FSDP reference too
    stop_at(_launch(run, folder, data, "train.steps=6", *lora), run, 3)
    for steps, strategy in (("6", ["dist.strategy=hsdp", "dist.shard_size=1"]), ("8", ["dist.strategy=ddp"])):
        rc, out, err = finish(_launch(run, folder, data, f"train.steps={steps}", *lora, *strategy))
        assert rc == 0, err[-3000:]
        assert f"(dist.{strategy[0][5:]}" in out + err and "; 896 of them trained" in out + err, (out + err)[-3000:]
        b = latest_state(run)
        assert all(torch.equal(v, init[k.replace(".base_layer.", ".")]) for k, v in b["model"].items()
                   if k not in adapters)
        assert summary(run)["ranks_in_sync"] and len(train_losses(run)) == int(steps)
        if steps == "6":
            assert b["step"] == 6 and a["model"].keys() == b["model"].keys()
            for k, v in a["model"].items():
                assert torch.equal(v, b["model"][k]), k
            for k, v in a["optimizer"]["state"].items():
                assert all(torch.equal(t, b["optimizer"]["state"][k][n]) for n, t in v.items()), k
            assert train_losses(run) == train_losses(ref)

    assert export.main([str(ref), "--format", "hf"]) == 0
    exported = ref / "export" / "step_00000006-hf"
    assert sorted(p.name for p in exported.iterdir()) == [".train-export.json", "README.md", "adapter_config.json",
                                                          "adapter_model.safetensors"]
    assert json.loads((exported / "adapter_config.json").read_text())["r"] == 4
    _, trained = task_model(folder, a["model"], *lora)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    base = hf_models.transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ours = trained(tokens).logits
        with_peft = peft.PeftModel.from_pretrained(base, exported).eval()
        assert torch.equal(with_peft(tokens).logits, ours)
        peft_merged = with_peft.merge_and_unload()(tokens).logits
    assert not torch.allclose(ours, hf_models.logits_of(folder, tokens), atol=1e-4)  # trained: moved
    assert export.main([str(ref), "--format", "hf", "--merged"]) == 0
    merged = hf_models.logits_of(ref / "export" / "step_00000006-hf-merged", tokens)
    assert torch.equal(merged, peft_merged) and (merged - ours).abs().max() < 1e-5


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
