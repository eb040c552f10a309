"""The Hugging Face task in one process: models built on meta, chat masks, the loss over assistant tokens."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

hf_models = pytest.importorskip("tests.hf_models", reason="pip install -r requirements-hf.txt")


LOG = logging.getLogger("test")


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
        x, y, doc = train[i]  # unpacked (task.pack=false): a piece a window, its padding a document of its own
        n = e - b - 1
        assert x[:n].tolist() == tokens[b:e - 1].tolist() and not x[n:].any()
        assert doc.tolist() == [0] * n + [shards.PAD_DOC] * (seq_len - n)
        want = [t if m & 1 else shards.IGNORE for t, m in zip(tokens[b + 1:e], mask[b + 1:e], strict=True)]
        assert y.tolist() == want + [shards.IGNORE] * (seq_len - n)
    assert any(y.ne(shards.IGNORE).sum() > 0 for x, y, _ in (train[i] for i in range(len(train))))


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


def test_the_hf_task_reads_the_masks_and_its_loss_counts_the_assistant_tokens_only(tmp_path):
    """The Hugging Face task on masked shards: its windows are a conversation each, its loss the summed cross entropy
    of transformers' logits over the assistant's targets alone and count() their number (the trainer divides by the
    step's count), its evaluation summed over them and counting them."""
    import torch.nn.functional as F

    from train import config
    from train import prepare as prepare_cmd
    from train.tasks import shards

    folder = hf_models.tiny_llama(tmp_path / "model", vocab=206, tokenizer=False)
    hf_models.chat_tokenizer(folder, "chatml")
    conv = [("user", "w3 w4 w5"), ("assistant", "w6 w7"), ("user", "w8"), ("assistant", "w9 w10 w11")]
    assert prepare_cmd.main([str(chats(tmp_path / "chats.jsonl", [conv] * 20)), str(tmp_path / "out"),
                             "--tokenizer", str(folder), "--chat"]) == 0
    cfg = config.load("configs/hf.yaml", [f"task.path={folder}", f"task.data={tmp_path / 'out'}", "task.seq_len=32",
                                          "task.pack=false"])  # packed: test_packed_conversations_...
    task = cfg.task_class(cfg.task, cfg.seed)
    train, val = task.datasets()
    assert isinstance(train, shards.MaskedWindows) and len(train) == 18 and len(val) == 2  # a conversation a window
    x, y, doc = (torch.stack(t) for t in zip(*(train[i] for i in range(4)), strict=True))
    counted = y != shards.IGNORE
    assert counted.sum() == 4 * 7  # w6 w7 <|im_end|> w9 w10 w11 <|im_end|>
    _, model = task_model(folder)
    with torch.no_grad():
        logits = hf_models.logits_of(folder, x)
        expect = F.cross_entropy(logits[counted], y[counted])
        assert task.loss(model, (x, y, doc)).item() == pytest.approx(28 * expect.item(), rel=1e-5)
        assert task.count((x, y, doc)) == 28
        ev = task.eval_step(model, (x, y, doc))
    assert ev["count"] == 28 and ev["loss"].item() == pytest.approx(28 * expect.item(), rel=1e-5)


def test_lora_adapters_start_as_the_model_itself_and_only_they_train(tmp_path):
    """task.lora_rank=4 (peft's default targets for Llama: q_proj and v_proj): the folder's weights load into the
    adapted layers' base_layer (the file's names), lora_B starts at zero so that the logits are transformers' own bit
    for bit, lora_A is drawn from the trainer's generator (the same for a seed, another for another seed), and only
    the adapters require a gradient and reach the optimizer. Targets that the model lacks, and adapter keys without a
    rank, are one line."""
    from train import config, optim
    from train.config import ConfigError

    folder = hf_models.tiny_llama(tmp_path / "llama")
    task, model = task_model(folder, None, "task.lora_rank=4")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained == [f"model.layers.{i}.self_attn.{m}_proj.lora_{ab}.default.weight"
                       for i in range(2) for m in "qv" for ab in "AB"]
    q, q_proj = model.model.layers[0].self_attn.q_proj, "model.layers.0.self_attn.q_proj"
    assert not q.lora_B.default.weight.any() and q.lora_A.default.weight.std() > 0.05
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, hf_models.logits_of(folder, tokens))
    hf = task.hf_model(model)
    assert hf.tensors[f"{q_proj}.base_layer.weight"].name == f"{q_proj}.weight"
    assert not any("lora_" in n for n in hf.tensors) and hf.adapters.tensors == tuple(trained)
    assert hf.adapters.about == "LoRA adapters of rank 4 on q_proj, v_proj (4 layers)"
    params = {id(p) for g in optim.build(config.load("configs/hf.yaml", []).optim, model).param_groups
              for p in g["params"]}
    assert params == {id(p) for p in model.parameters() if p.requires_grad}

    again = task_model(folder, None, "task.lora_rank=4")[1].model.layers[0].self_attn.q_proj
    other = task_model(folder, None, "task.lora_rank=4", "seed=1")[1].model.layers[0].self_attn.q_proj
    assert torch.equal(again.lora_A.default.weight, q.lora_A.default.weight)
    assert not torch.equal(other.lora_A.default.weight, q.lora_A.default.weight)
    every = task_model(folder, None, "task.lora_rank=2", "task.lora_targets=all-linear")[1]
    assert sum(p.requires_grad for p in every.parameters()) == 2 * 7 * 2  # 7 linear layers a block, lm_head not

    for overrides, words in ((["task.lora_rank=4", "task.lora_targets=q_proj,qkv_proj"],
                              "task.lora_targets: the LlamaForCausalLM of " + str(folder) + " has no module named "
                              "qkv_proj (its linear layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                              "down_proj, lm_head; or all-linear)"),
                             (["task.lora_alpha=16"], "task.lora_alpha is set, and task.lora_rank is 0")):
        with pytest.raises(ConfigError) as e:
            cfg = config.load("configs/hf.yaml", [f"task.path={folder}", "task.data=x", "task.seq_len=32", *overrides])
            t = cfg.task_class(cfg.task, cfg.seed)
            t.check()
            t.model()
        assert words in str(e.value)
