"""Text files -> token shards for train.tasks.gpt, in llm.c's format (or nanoGPT's bare uint16).

    python -m train.prepare corpus.txt data/corpus                    # bytes, llm.c shards, 10% validation
    python -m train.prepare books/ data/books --tokenizer gpt2 --format nanogpt --shard-tokens 50000000
    python -m train.prepare corpus.txt data/corpus --tokenizer models/my-model   # a Hugging Face model's tokenizer

INPUT is a text file or a folder of .txt files (all of them, recursively, in sorted order). The tokens of
all files, one after the other, are split in two: the last --val-fraction of them is the validation split
(as nanoGPT's prepare scripts do), the rest the training split; each split is written as shards of at most
--shard-tokens tokens, named like llm.c's: <name>_val_000000.bin, <name>_train_000000.bin, ... Every shard
is read back and compared with what was meant to be written before the command succeeds.

Tokenizers: `bytes` (default): each byte is a token, vocabulary 256, nothing to download. `gpt2`: tiktoken's
GPT-2 encoding (vocabulary 50257, an <|endoftext|> before each file as llm.c does), when tiktoken is
installed and its encoding files are in its cache (TIKTOKEN_CACHE_DIR) or downloadable. A PATH: a Hugging Face
tokenizer, its tokenizer.json (the file, or a model folder holding it) read by the `tokenizers` library (pip install
-r requirements-hf.txt), nothing downloaded; each file is one document, with the special tokens its post-processor
adds (Llama's <|begin_of_text|> first); vocabularies up to 65536 (uint16 shards).

The tokens are held in memory (2 bytes each): for corpora larger than that, use llm.c's or nanoGPT's own
scripts, whose shards this template reads as they are. Usage errors: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

from train.config import OneLineParser, UsageError

VOCAB = {"bytes": 256, "gpt2": 50257}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m train.prepare", description="Text files -> llm.c/nanoGPT token shards.")
    p.add_argument("input", help="a text file, or a folder of .txt files")
    p.add_argument("outdir", help="the folder to write the shards into (created; must hold no .bin yet)")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|gpt2|PATH",
                   help="bytes: vocabulary 256, no download; gpt2: tiktoken's GPT-2 encoding; PATH: a Hugging Face "
                        "tokenizer.json, or a model folder holding one (default: bytes)")
    p.add_argument("--format", choices=("llmc", "nanogpt"), default="llmc",
                   help="llmc: 1024-byte header then uint16; nanogpt: bare uint16 (default: llmc)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                   help="at most N tokens per shard (default: 100M, as llm.c's fineweb shards)")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="the last F of the tokens is the validation split, 0 < F < 1 (default: 0.1)")
    p.add_argument("--name", default="", help="the shards' name prefix (default: INPUT's name)")
    a = p.parse_args(argv)
    if a.shard_tokens <= 0:
        raise UsageError(f"--shard-tokens must be > 0, got {a.shard_tokens}")
    if not 0 < a.val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1 (exclusive), got {a.val_fraction}")
    return a


def text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise UsageError(f"{path} holds no .txt file")
        return files
    raise UsageError(f"{path} does not exist (give a text file or a folder of .txt files)")


def shard_name(stem: str) -> str:
    """The shards' prefix without the words that name a split ("val_notes.txt" would make val_notes_train_0.bin,
    both splits at once to train.tasks.shards.split_of)."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", stem) if w and w.lower() not in {"train", "val", "valid",
                                                                                   "validation"}]
    return "_".join(words) or "shard"


def tokenizer(name: str):
    """(a function bytes -> token ids (a numpy array), the vocabulary's size)."""
    if name == "bytes":
        return (lambda data: np.frombuffer(data, dtype=np.uint8)), VOCAB["bytes"]
    if name != "gpt2":
        return hf_tokenizer(Path(name))
    try:
        import tiktoken

        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # not installed, or its files neither cached nor downloadable
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise UsageError(f"--tokenizer gpt2 needs tiktoken and its GPT-2 encoding files (pip install tiktoken; "
                         f"offline, TIKTOKEN_CACHE_DIR must hold them): {why}") from None
    eot = enc.eot_token  # <|endoftext|> starts each document, as in llm.c's fineweb.py
    return (lambda data: np.array([eot, *enc.encode_ordinary(data.decode("utf-8", errors="replace"))])), VOCAB["gpt2"]


def hf_tokenizer(path: Path):
    """A Hugging Face tokenizer.json (the file, or a folder holding it), read by `tokenizers` alone."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no tokenizer.json" if path.is_dir() else f"{path} does not exist"
        raise UsageError(f"--tokenizer: {where} (bytes, gpt2, or a Hugging Face tokenizer.json or model folder)")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise UsageError(f"--tokenizer {path} needs the tokenizers library ({e}): pip install -r requirements-hf.txt"
                         ) from None
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise UsageError(f"--tokenizer: {file} does not read as a Hugging Face tokenizer ({why})") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > 2**16:
        raise UsageError(f"--tokenizer: {file} has a vocabulary of {vocab} tokens; shards hold uint16 token ids "
                         f"(at most 65536)")
    return (lambda data: np.array(tok.encode(data.decode("utf-8", errors="replace")).ids, dtype=np.int64)), vocab


def write_split(tokens: np.ndarray, outdir: Path, name: str, split: str, args, vocab: int, bar) -> list[Path]:
    from train.tasks import shards  # imports torch: only once the arguments are known to be good

    paths = []
    for i, start in enumerate(range(0, len(tokens), args.shard_tokens)):
        part = tokens[start:start + args.shard_tokens]
        path = outdir / f"{name}_{split}_{i:06d}.bin"
        shards.write_shard(path, part, args.format)
        back = shards.open_shard(path, args.format)  # read back: the header, the size, every token
        shards.check_vocab([back], vocab)  # and keeps its largest id (TOKEN_MAX)
        if back.count != len(part) or not np.array_equal(back.tokens(), part):
            raise RuntimeError(f"{path}: reading the shard back does not give the tokens written")
        paths.append(path)
        bar.update(len(part))
    return paths


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        files = text_files(Path(args.input))
        outdir = Path(args.outdir)
        if outdir.exists() and not outdir.is_dir():
            raise UsageError(f"{outdir} exists and is not a folder")
        if outdir.is_dir() and any(outdir.glob("*.bin")):
            raise UsageError(f"{outdir} already holds .bin shards: remove them or choose another folder "
                             "(the trainer reads every shard there)")
        encode, vocab = tokenizer(args.tokenizer)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    name = shard_name(args.name or Path(args.input).resolve().stem)
    parts = []
    size = sum(f.stat().st_size for f in files)
    with tqdm(total=size, unit="B", unit_scale=True, desc="tokenize", disable=None) as bar:  # None: on a terminal
        for f in files:
            data = f.read_bytes()
            parts.append(encode(data).astype(np.uint16))
            bar.update(len(data))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    n_val = int(round(len(tokens) * args.val_fraction))
    if n_val == 0 or n_val == len(tokens):
        print(f"error: {args.input} has {len(tokens)} tokens: too few for a train and a validation split "
              f"with --val-fraction {args.val_fraction}", file=sys.stderr)
        return 2
    outdir.mkdir(parents=True, exist_ok=True)
    with tqdm(total=len(tokens), unit="tok", unit_scale=True, desc="write", disable=None) as bar:
        val = write_split(tokens[len(tokens) - n_val:], outdir, name, "val", args, vocab, bar)
        train = write_split(tokens[:len(tokens) - n_val], outdir, name, "train", args, vocab, bar)
    print(f"{len(tokens) - n_val} training tokens in {len(train)} shard(s), {n_val} validation tokens in "
          f"{len(val)}, vocabulary {vocab} ({args.tokenizer}), {args.format} format: {outdir}")
    if args.tokenizer in VOCAB:  # the built-in GPT pads the vocabulary to a multiple of 64 (50304)
        print(f"train on them: task.data={outdir} task.vocab_size={vocab} task.format={args.format}")
    else:  # the model whose tokenizer it is: its config.json says its vocabulary
        folder = Path(args.tokenizer) if Path(args.tokenizer).is_dir() else Path(args.tokenizer).parent
        print(f"train on them: python -m train --config configs/hf.yaml task.path={folder} task.data={outdir} "
              f"task.format={args.format} (the model whose tokenizer it is)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
