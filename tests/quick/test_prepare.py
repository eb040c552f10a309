"""python -m train.prepare in one process: the tokens of each whole document, whatever the tokenizer; the shard
sizes the format holds."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from train import prepare
from train.tasks import shards

WORDS = ("the quick brown fox jumps over lazy dog a stitch in time saves nine all that glitters is not gold early "
         "bird catches worm").split()


def corpus(chars: int, seed: int = 0) -> str:
    """Words, punctuation and newlines, `chars` characters or so."""
    rng = np.random.default_rng(seed)
    out, n = [], 0
    while n < chars:
        w = str(rng.choice(WORDS)) + str(rng.choice(["", "", "", ",", ".", ".\n", "\n\n"]))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def sentencepiece_style(folder: Path, style: str) -> Path:
    """A tokenizer that marks the start of a text as Llama 2's and Mistral v0.1's do: a "▁" in front of it. `first`,
    `always`: a Metaspace pre-tokenizer with that prepend_scheme; `legacy`: Llama 2's tokenizer.json, a Prepend("▁")
    normalizer and no pre-tokenizer (the whole text one word to the BPE). <s> first (its post-processor), </s> its
    end of text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first" if style == "legacy" else style)
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([corpus(20_000, seed=9)], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    if style == "legacy":
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def tokens_of(out: Path) -> list[int]:
    return [t for split in ("train", "val") for p in sorted(out.glob(f"*_{split}_*.bin"))
            for t in shards.open_shard(p).tokens().tolist()]


@pytest.mark.parametrize("style", ["first", "always", "legacy"])
def test_a_sentencepiece_style_tokenizer_gives_the_tokens_of_each_whole_document(tmp_path, monkeypatch, style):
    """Documents longer than a block (files, and .jsonl lines; words and spaces, or lines without a space): their
    tokens are the whole text's encoding (one "▁" in front, none at a block's cut) then </s>."""
    from tokenizers import Tokenizer

    folder = sentencepiece_style(tmp_path / "model", style)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    monkeypatch.setattr(prepare, "BLOCK_CHARS", 4096)
    monkeypatch.setattr(prepare, "BATCH", 2)
    rng = np.random.default_rng(3)
    lines = "\n".join(str(rng.choice(WORDS)) for _ in range(2000))  # no space: a block ends after a newline
    docs = [corpus(30_000, seed=1), lines, corpus(9_000, seed=2)]
    assert all(len(d) > 2 * prepare.BLOCK_CHARS for d in docs)
    assert tok.encode(docs[0][:4000]).tokens[:2] == ["<s>", "▁" + docs[0].split()[0]]  # the "▁" a text starts with
    eos = tok.token_to_id("</s>")
    expected = [t for d in docs for t in [*tok.encode(d).ids, eos]]

    (tmp_path / "in").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "in" / f"{i}.txt").write_text(d)
    assert prepare.main([str(tmp_path / "in"), str(tmp_path / "out"), "--tokenizer", str(folder)]) == 0
    assert tokens_of(tmp_path / "out") == expected

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert prepare.main([str(tmp_path / "docs.jsonl"), str(tmp_path / "jsonl"), "--tokenizer", str(folder)]) == 0
    assert tokens_of(tmp_path / "jsonl") == expected


@pytest.mark.parametrize("fmt, ok", [("llmc", False), ("nanogpt", True)])
def test_shards_larger_than_the_format_holds_are_refused_before_any_tokenizing(tmp_path, monkeypatch, capsys, fmt,
                                                                                ok):
    """llm.c's header counts a shard's tokens in an int32: --shard-tokens 2**31 is one line, exit 2, before anything
    is read or written. nanoGPT's headerless files count nothing: any size."""
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 100)
    read = []
    monkeypatch.setattr(prepare, "tokenizer", lambda name: read.append(name) or prepare.Encoder(
        lambda blocks: [np.frombuffer(b, dtype=np.uint8) for b in blocks], 256, [], [], binary=True))
    code = prepare.main([str(text), str(tmp_path / "o"), "--shard-tokens", str(2**31), "--format", fmt])
    err = capsys.readouterr().err
    if ok:
        assert code == 0 and read and len(list((tmp_path / "o").glob("*.bin"))) == 2
        return
    assert code == 2 and not read and not (tmp_path / "o").exists()
    assert err.count("\n") == 1 and err.startswith("error: --shard-tokens 2147483648 ") and "2147483647" in err
    assert prepare.main([str(text), str(tmp_path / "o"), "--shard-tokens", str(2**31 - 1)]) == 0


def test_a_tokenizer_whose_tokens_span_spaces_still_gives_the_whole_documents_tokens(tmp_path, monkeypatch):
    """A BPE without a pre-tokenizer learns tokens across spaces, newlines and punctuation ("all that "): no cut is
    a token boundary for it, none passes the check, and the document is encoded whole rather than changed."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.train_from_iterator([corpus(20_000, seed=9)], trainer=trainers.BpeTrainer(vocab_size=400,
                                                                                 special_tokens=["</s>"]))
    assert any(" " in t.strip() for t in tok.get_vocab())
    (tmp_path / "model").mkdir()
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    monkeypatch.setattr(prepare, "BLOCK_CHARS", 4096)
    doc = corpus(30_000, seed=1)
    (tmp_path / "doc.txt").write_text(doc)
    assert prepare.main([str(tmp_path / "doc.txt"), str(tmp_path / "out"), "--tokenizer",
                         str(tmp_path / "model")]) == 0
    assert tokens_of(tmp_path / "out") == [*tok.encode(doc).ids, tok.token_to_id("</s>")]
