"""The language model task in one process: shards, prepare, the built-in corpus and GPT."""
from __future__ import annotations

import json
import math
import os
import pickle
import sys
import types
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from train import prepare
from train.config import ConfigError
from train.parallel import wrapping
from train.tasks import shards
from train.tasks.gpt import BUILTIN_VOCAB, LanguageModel, builtin_entropy, builtin_tokens
from train.tasks.gpt_model import GPT, PRESETS, preset


def task(**keys) -> LanguageModel:
    t = LanguageModel(LanguageModel.Config(**keys), seed=0)
    t.check()
    return t


def windows_of(tokens: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Independently of TokenWindows: the non-overlapping windows of seq_len + 1 tokens, stride seq_len."""
    return [tokens[s:s + seq_len + 1] for s in range(0, len(tokens) - seq_len, seq_len)]


@pytest.mark.parametrize("fmt", ["llmc", "nanogpt"])
def test_prepare_round_trip_gives_exactly_the_windows_of_the_text(tmp_path, fmt):
    (tmp_path / "txt" / "sub").mkdir(parents=True)
    rng = np.random.default_rng(1)
    texts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (5000, 3001)]
    (tmp_path / "txt" / "a.txt").write_bytes(texts[0])
    (tmp_path / "txt" / "sub" / "b.txt").write_bytes(texts[1])
    (tmp_path / "txt" / "ignored.md").write_text("not a .txt file")
    out = tmp_path / "shards"
    assert prepare.main([str(tmp_path / "txt"), str(out), "--format", fmt, "--shard-tokens", "2000",
                         "--val-fraction", "0.3"]) == 0
    tokens = np.frombuffer(b"".join(texts), dtype=np.uint8)  # a.txt then sub/b.txt: sorted paths
    n_val = round(len(tokens) * 0.3)
    train_tokens, val_tokens = tokens[:-n_val], tokens[-n_val:]
    names = sorted(p.name for p in out.glob("*.bin"))
    assert names == [f"txt_train_{i:06d}.bin" for i in range(3)] + ["txt_val_000000.bin", "txt_val_000001.bin"]
    assert sorted(json.loads((out / shards.TOKEN_MAX).read_text())) == names  # each shard's largest id, kept
    if fmt == "llmc":
        header = np.fromfile(out / "txt_train_000000.bin", dtype="<i4", count=256)
        assert header[:3].tolist() == [20240520, 1, 2000] and not header[3:].any()
    else:
        assert (out / "txt_train_000000.bin").stat().st_size == 2 * 2000

    seq_len = 64
    train, val = task(data=str(out), format=fmt, model="nano", seq_len=seq_len).datasets()
    for ds, toks in ((train, train_tokens), (val, val_tokens)):
        shard_parts = [toks[i:i + 2000] for i in range(0, len(toks), 2000)]  # windows never cross a shard
        expected = [w for part in shard_parts for w in windows_of(part, seq_len)]
        assert len(ds) == len(expected) > 0
        for i, w in enumerate(expected):
            x, y = ds[i]
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (seq_len,)
            assert x.tolist() == w[:-1].tolist() and y.tolist() == w[1:].tolist()
        with pytest.raises(IndexError):
            ds[len(ds)]


def test_auto_format_reads_both_and_a_glob_or_eval_data_selects_files(tmp_path):
    toks = np.arange(1000, dtype=np.uint16) % 200
    shards.write_shard(tmp_path / "c_train_000000.bin", toks, "llmc")
    shards.write_shard(tmp_path / "train.bin", toks[::-1], "nanogpt")
    shards.write_shard(tmp_path / "val.bin", toks[:300], "nanogpt")
    train, val = task(data=str(tmp_path), model="nano", seq_len=10).datasets()  # format auto, per file
    assert len(train) == 2 * 99 and len(val) == 29
    assert train[0][0].tolist() == toks[:10].tolist() and train[99][0].tolist() == toks[::-1][:10].tolist()
    train, val = task(data=str(tmp_path / "c_*.bin"), eval_data=str(tmp_path / "val.bin"), model="nano",
                      seq_len=10).datasets()
    assert len(train) == 99 and len(val) == 29
    with pytest.raises(ConfigError, match="named as a val shard"):
        task(data=str(tmp_path / "*train*.bin"), model="nano", seq_len=10).datasets()
    assert shards.split_of("fineweb_val_000001.bin") == "val" and shards.split_of("interval.bin") is None
    assert shards.split_of("val_notes_train_000000.bin") is None  # both: neither (prepare never writes such names)


def test_a_dataset_pickles_without_its_memory_maps(tmp_path):
    shards.write_shard(tmp_path / "x_train.bin", np.arange(5000, dtype=np.uint16), "llmc")
    ds = shards.TokenWindows([shards.open_shard(tmp_path / "x_train.bin")], 16)
    before = ds[3]
    blob = pickle.dumps(ds)
    assert len(blob) < 2000  # paths and lengths only, whatever the shard's size
    assert all(torch.equal(a, b) for a, b in zip(pickle.loads(blob)[3], before, strict=True))


def malformed(tmp_path: Path, case: str) -> tuple[Path, str, str]:
    """A bad shard, the task.format it is read with, and the words its error must have."""
    path = tmp_path / "bad_train_000000.bin"
    toks = np.arange(300, dtype=np.uint16) % 200
    if case == "bad magic":
        shards.write_shard(path, toks, "llmc")
        raw = bytearray(path.read_bytes())
        raw[0:4] = np.array([20240521], "<i4").tobytes()
        path.write_bytes(bytes(raw))
        return path, "llmc", "bad magic number 20240521"
    if case == "truncated":
        shards.write_shard(path, toks, "llmc")
        path.write_bytes(path.read_bytes()[:-10])
        return path, "auto", "truncated"
    if case == "truncated header":
        shards.write_shard(path, toks, "llmc")
        path.write_bytes(path.read_bytes()[:8])  # not even the token count
        return path, "auto", "truncated"
    if case == "odd size":
        path.write_bytes(toks.tobytes() + b"\0")
        return path, "nanogpt", "not a whole number of uint16 tokens"
    if case == "token id >= vocab":
        shards.write_shard(path, np.append(toks, 256), "llmc")  # nano's vocabulary is 256
        return path, "auto", "token id 256 >= task.vocab_size 256"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["bad magic", "truncated", "truncated header", "odd size", "token id >= vocab"])
def test_a_malformed_shard_is_one_line_naming_the_file(tmp_path, case):
    path, fmt, words = malformed(tmp_path, case)
    shards.write_shard(tmp_path / "good_val.bin", np.arange(300, dtype=np.uint16) % 200, "llmc")
    with pytest.raises(ConfigError) as e:
        task(data=str(tmp_path), format=fmt, model="nano", seq_len=16).datasets()
    msg = str(e.value)
    assert str(path) in msg and words in msg and "\n" not in msg, msg


def test_missing_or_empty_data_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        task(data=str(tmp_path / "nope"), model="nano").datasets()
    with pytest.raises(ConfigError, match="no shard matches"):
        task(data=str(tmp_path), model="nano").datasets()
    shards.write_shard(tmp_path / "train.bin", np.arange(100, dtype=np.uint16), "llmc")
    shards.write_shard(tmp_path / "val.bin", np.arange(10, dtype=np.uint16), "llmc")
    with pytest.raises(ConfigError, match="no window of seq_len"):
        task(data=str(tmp_path), model="nano", seq_len=16).datasets()


def llmc_header(magic: int, version: int, count: int) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, count
    return header.tobytes()


def test_llmc_evaluation_files_are_refused_by_name(tmp_path):
    """llm.c's HellaSwag/MMLU evaluation files: under format auto and a vocabulary large enough to take their
    bytes as uint16 tokens, one line naming what the file is."""
    toks = np.arange(2000) % 1000
    path = tmp_path / "edu_eval_train_000000.bin"  # its write_evalfile: magic 20240522, version 1, the examples
    path.write_bytes(llmc_header(20240522, 1, 10) + toks.astype("<u2").tobytes())
    shards.write_shard(tmp_path / "edu_val_000000.bin", toks, "llmc")
    with pytest.raises(ConfigError) as e:
        task(data=str(tmp_path), model="nano", seq_len=16, vocab_size=65536).datasets()
    msg = str(e.value)
    assert msg.startswith(f"{path}: an evaluation file (llm.c's magic 20240522") and "\n" not in msg, msg


def test_llmc_llama3_shards_with_ids_beyond_uint16_are_read(tmp_path):
    """llm.c's own llama-3 shards, written as its data_common.write_datafile does (magic 20240801, version 7,
    uint32 tokens): read as they are, ids over 65535 included; a wrong version or size is one line."""
    toks = (np.arange(3000, dtype=np.int64) * 7919) % 128_256
    assert toks.max() > 2**16
    (tmp_path / "edu_train_000000.bin").write_bytes(llmc_header(20240801, 7, len(toks)) + toks.astype("<u4").tobytes())
    shards.write_shard(tmp_path / "edu_val_000000.bin", toks[:100], "llmc", dtype=shards.TOKEN32)
    assert (tmp_path / "edu_val_000000.bin").read_bytes()[:1024] == llmc_header(20240801, 7, 100)
    train, val = task(data=str(tmp_path), model="nano", seq_len=16, vocab_size=128_256).datasets()
    expected = windows_of(toks, 16)
    assert len(train) == len(expected) and len(val) == 6
    for i in (0, 57, len(expected) - 1):
        assert train[i][0].tolist() == expected[i][:-1].tolist() and train[i][1].tolist() == expected[i][1:].tolist()
    with pytest.raises(ConfigError, match="token id 128211 >= task.vocab_size 65536"):
        task(data=str(tmp_path), model="nano", seq_len=16, vocab_size=65536).datasets()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x_train.bin").write_bytes(llmc_header(20240801, 1, len(toks)) + toks.astype("<u4").tobytes())
    (bad / "x_val.bin").write_bytes(llmc_header(20240801, 7, len(toks)) + toks.astype("<u2").tobytes())
    for name, words in (("x_train.bin", "version 1 with magic 20240801, expected 7 (32-bit tokens)"),
                        ("x_val.bin", "truncated: its header says 3000 tokens (13024 bytes)")):
        with pytest.raises(ConfigError) as e:
            shards.open_shard(bad / name)
        assert str(e.value).startswith(f"{bad / name}: ") and words in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="nanoGPT's bare format holds uint16 tokens only"):
        shards.write_shard(bad / "n.bin", toks, "nanogpt", dtype=shards.TOKEN32)


def test_the_largest_token_id_is_read_once_per_shard_file(tmp_path):
    """The vocabulary check reads a shard whole once: later starts take its largest id from the cache as
    long as the file's size and modification time are unchanged (here the content changes behind the
    cache's back, and is not seen), and read it again once they change."""
    toks = np.arange(3000, dtype=np.uint16) % 200
    train_path = tmp_path / "c_train_000000.bin"
    shards.write_shard(train_path, toks, "llmc")
    shards.write_shard(tmp_path / "c_val_000000.bin", toks[:500], "llmc")
    t = task(data=str(tmp_path), model="nano", seq_len=16)  # vocabulary 256
    t.datasets()
    assert (tmp_path / shards.TOKEN_MAX).is_file()
    before = train_path.stat()
    out_of_vocab = toks.copy()
    out_of_vocab[1234] = 300
    shards.write_shard(train_path, out_of_vocab, "llmc")  # same size
    os.utime(train_path, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same modification time
    train, _ = t.datasets()  # the second start: the cache's word, not a read of the shard
    assert train[1234 // 16][0].tolist()[1234 % 16] == 300
    os.utime(train_path, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    with pytest.raises(ConfigError, match=f"{train_path}: token id 300 >= task.vocab_size 256"):
        t.datasets()


def test_shards_in_a_folder_that_takes_no_cache_keep_theirs_in_the_users_cache_folder(tmp_path, monkeypatch):
    """Where the shards' folder cannot take the cache (read-only; here its name is taken by a folder, which
    stops root too), the largest ids are kept in $XDG_CACHE_HOME/train and read from there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "data"
    (data / shards.TOKEN_MAX).mkdir(parents=True)
    toks = np.arange(3000, dtype=np.uint16) % 200
    shards.write_shard(data / "train.bin", toks, "nanogpt")
    shards.write_shard(data / "val.bin", toks, "nanogpt")
    t = task(data=str(data), model="nano", seq_len=16)
    t.datasets()
    kept = list((tmp_path / "cache" / "train").glob("token_max-*.json"))
    assert len(kept) == 1 and sorted(json.loads(kept[0].read_text())) == ["train.bin", "val.bin"]
    before = (data / "train.bin").stat()
    toks[5] = 999
    shards.write_shard(data / "train.bin", toks, "nanogpt")
    os.utime(data / "train.bin", ns=(before.st_atime_ns, before.st_mtime_ns))
    t.datasets()  # the kept word, not a read


def test_prepare_gpt2_tokenizer_puts_an_end_of_text_before_each_file(tmp_path, monkeypatch):
    """tiktoken's plumbing, with a stand-in encoding (its real files may not be on this machine)."""
    fake = types.SimpleNamespace(eot_token=50256, encode_ordinary=lambda s: [50000 + ord(c) % 200 for c in s])
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=lambda name: fake))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "1.txt").write_text("abcdefgh" * 10)
    (tmp_path / "in" / "2.txt").write_text("xyz" * 10)
    assert prepare.main([str(tmp_path / "in"), str(tmp_path / "out"), "--tokenizer", "gpt2",
                         "--val-fraction", "0.3"]) == 0
    toks = [50256, *fake.encode_ordinary("abcdefgh" * 10), 50256, *fake.encode_ordinary("xyz" * 10)]
    back = [shards.open_shard(p).tokens().tolist() for p in sorted((tmp_path / "out").glob("in_train_*.bin"))]
    back += [shards.open_shard(p).tokens().tolist() for p in sorted((tmp_path / "out").glob("in_val_*.bin"))]
    assert sum(back, []) == toks


def test_builtin_corpus_is_deterministic_from_the_seed():
    a, b = builtin_tokens(0, 5000, "train"), builtin_tokens(0, 5000, "train")
    assert a.dtype == np.uint16 and len(a) == 5000 and np.array_equal(a, b)
    assert not np.array_equal(a, builtin_tokens(1, 5000, "train"))
    assert not np.array_equal(a, builtin_tokens(0, 5000, "val"))
    longer = builtin_tokens(0, 2_500_000, "train")  # three chunks of 256 runs of 4096 tokens
    assert np.array_equal(longer[:5000], a)  # a longer corpus only adds to it
    assert a.max() < BUILTIN_VOCAB
    t = task(model="nano", seq_len=32, train_tokens=5000, eval_tokens=1000)
    train, _ = t.datasets()
    assert len(train) == (5000 - 1) // 32 and train[2][0].tolist() == a[64:96].tolist()


def test_builtin_entropies_match_a_count_of_the_corpus():
    ent = builtin_entropy(0)
    toks = builtin_tokens(0, 1_000_000, "train").tolist()
    n = len(toks)
    unigram = -sum(c / n * math.log(c / n) for c in Counter(toks).values())
    pairs = Counter(zip(toks, toks[1:], strict=False))
    firsts = Counter(toks[:-1])
    bigram = -sum(c / (n - 1) * math.log(c / firsts[a]) for (a, _), c in pairs.items())
    assert abs(ent.unigram - unigram) < 0.01, (ent, unigram)
    assert abs(ent.bigram - bigram) < 0.02, (ent, bigram)
    assert ent.rate < 0.4 * ent.unigram < ent.bigram < 0.7 * ent.unigram  # room to learn, at two depths


def test_gpt2_preset_has_124m_parameters_and_tied_embeddings():
    with torch.device("meta"):
        m = GPT(PRESETS["gpt2"])
    assert m.num_params() == 123_689_472  # nanoGPT's "number of parameters: 123.69M" (vocab 50304)
    assert m.num_params(non_embedding=False) == 123_689_472 + 1024 * 768
    assert m.lm_head.weight is m.transformer.wte.weight


def test_weight_tying_holds_through_training_and_state_dict():
    torch.manual_seed(0)
    m = GPT(preset("nano"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()
    assert m.lm_head.weight is m.transformer.wte.weight
    m2 = GPT(preset("nano"))
    m2.load_state_dict(m.state_dict())
    assert m2.lm_head.weight is m2.transformer.wte.weight and torch.equal(m2.lm_head.weight, m.lm_head.weight)


def test_gpt_is_causal_and_initialised_as_gpt2():
    torch.manual_seed(0)
    m = GPT(preset("nano", n_layer=3)).eval()
    idx = torch.randint(0, 256, (2, 20))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    a, b = m(idx), m(changed)
    assert a.shape == (2, 20, 256)
    assert torch.equal(a[:, :12], b[:, :12]) and not torch.allclose(a[:, 12:], b[:, 12:])
    proj = m.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(proj - 0.02 / math.sqrt(6)) < 0.003 and abs(m.transformer.h[0].mlp.c_fc.weight.std() - 0.02) < 0.003


def test_the_task_builds_on_the_meta_device_and_gives_gpt2_s_initial_values():
    """The task's GPT is built on meta (no memory) and filled by init_parameter as GPT-2's constructor would:
    LayerNorms 1 and 0, biases 0, weights N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 n_layer)),
    the output layer tied to the embedding through the materialization."""
    t = task(model="nano", n_layer=3, n_embd=64, n_head=2)
    assert wrapping.on_meta(t.model())
    m = wrapping.whole_model(t, torch.device("cpu"), 0)
    assert not wrapping.on_meta(m) and m.lm_head.weight is m.transformer.wte.weight
    block = m.transformer.h[1]
    assert torch.equal(block.ln_1.weight, torch.ones(64)) and torch.equal(block.ln_1.bias, torch.zeros(64))
    assert torch.equal(block.attn.c_attn.bias, torch.zeros(192))
    assert abs(block.attn.c_proj.weight.std().item() - 0.02 / math.sqrt(6)) < 0.002
    assert abs(block.mlp.c_fc.weight.std().item() - 0.02) < 0.002
    assert torch.equal(wrapping.whole_model(t, torch.device("cpu"), 0).transformer.wte.weight, m.transformer.wte.weight)


def test_task_flops_and_metrics_follow_nanogpt():
    t = task(model="gpt2", data="/nowhere")  # the data is read by datasets() only
    with torch.device("meta"):
        m = t.model()
    N, L, C, T = m.num_params(), 12, 768, 1024
    assert t.units_per_sample() == 1024 and t.unit == "tokens"
    assert t.flops_per_sample(m) == T * (6 * N + 12 * L * C * T)  # nanoGPT's estimate_mfu per window
    assert t.summarize({"loss": 2.0})["perplexity"] == pytest.approx(math.exp(2.0))


def test_config_errors_name_the_key():
    for keys, words in [({"n_embd": 100, "n_head": 3}, "task.n_embd"), ({"dropout": 1.0}, "task.dropout"),
                        ({"seq_len": -1}, "task.seq_len"), ({"vocab_size": 10}, "task.vocab_size"),
                        ({"train_tokens": 50}, "task.train_tokens"), ({"eval_data": "x"}, "task.eval_data")]:
        with pytest.raises(ConfigError, match=words):
            task(**keys)


def test_a_few_steps_of_the_nano_model_on_the_builtin_corpus_reduce_the_loss():
    t = task(model="nano", seq_len=32, train_tokens=20_000, eval_tokens=4096)
    train, val = t.datasets()
    m = wrapping.whole_model(t, torch.device("cpu"), 0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    batch = [torch.stack(z) for z in zip(*(val[i] for i in range(len(val))), strict=True)]
    with torch.no_grad():
        before = t.eval_step(m, batch)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        idx = torch.randint(len(train), (16,), generator=g).tolist()
        loss = t.loss(m, [torch.stack(z) for z in zip(*(train[i] for i in idx), strict=True)])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = t.eval_step(m, batch)
    assert before["count"] == after["count"] == len(val) * 32
    first, last = (r["loss"].item() / r["count"] for r in (before, after))
    assert first == pytest.approx(math.log(BUILTIN_VOCAB), abs=0.1)  # GPT-2's init: uniform predictions
    assert last < 0.85 * builtin_entropy(0).unigram, (first, last)


def test_forward_is_one_graph_for_torch_compile():
    """No graph break (fullgraph=True fails on one): what torch.compile needs to be fast. The eager backend
    checks the tracing only, without a compiler."""
    torch.manual_seed(0)
    m = GPT(preset("nano"))
    x = torch.randint(0, 256, (2, 16))
    assert torch.allclose(torch.compile(m, backend="eager", fullgraph=True)(x), m(x))
