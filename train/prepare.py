"""Text files or conversations -> token shards for the language model tasks, in llm.c's format (or nanoGPT's).

    python -m train.prepare corpus.txt data/corpus                    # bytes, llm.c shards, 10% validation
    python -m train.prepare books/ data/books --tokenizer gpt2 --format nanogpt --shard-tokens 50000000
    python -m train.prepare corpus.txt data/corpus --tokenizer models/my-model   # a Hugging Face model's tokenizer
    python -m train.prepare chats.jsonl data/chats --tokenizer models/my-model --chat   # the assistant's turns only

INPUT is a text file or a folder of .txt files (all of them, recursively, in sorted order): each file is one document;
a .jsonl file (or one in the folder) holds a document a line, {"text": ...}.
The tokens of all documents, one after the other, are split in two: the last --val-fraction of them is the validation
split (as nanoGPT's prepare scripts do), the rest the training split; each split is written as shards of at most
--shard-tokens tokens, named like llm.c's: <name>_val_000000.bin, <name>_train_000000.bin, ... Every shard is read
back and compared with what was meant to be written before the command succeeds.

Tokenizers: `bytes` (default): each byte is a token, vocabulary 256, nothing to download, nothing between documents
(no id is left for one). `gpt2`: tiktoken's GPT-2 encoding (vocabulary 50257, an <|endoftext|> before each document as
llm.c does), when tiktoken is installed and its encoding files are in its cache (TIKTOKEN_CACHE_DIR) or downloadable.
A PATH: a Hugging Face tokenizer, its tokenizer.json (the file, or a model folder holding it) read by the `tokenizers`
library (pip install -r requirements-hf.txt), nothing downloaded: each document gets the special tokens its
post-processor adds (Llama's <|begin_of_text|> first) and its end-of-text token last (<|endoftext|> or <|end_of_text|>
where it has one, else tokenizer_config.json's eos_token, else </s>, <eos>, ...), so that a model learns where a
document ends.
Vocabularies up to 65536 are written as uint16 (llm.c's gpt-2 format, magic 20240520), larger ones as uint32 (its
llama-3 format, magic 20240801; nanoGPT's headerless format has no way to say so and stays uint16).

Each document is read in blocks of about BLOCK_CHARS characters and its tokens are exactly those of the whole
document with any tokenizer (a sentencepiece-style one's "▁" included): a block ends only where a cut is checked to
change no token (join()), and each block but a document's first is encoded after the CONTEXT characters before it,
whose tokens are then dropped (see encode_documents). The blocks of a batch are encoded together on every core (the
fast tokenizer's encode_batch_fast, tiktoken's encode_ordinary_batch). The tokens go to a file in OUTDIR as they come,
and the shards are copied from it: memory is one batch of blocks and a few bytes a token
(bench/studies/prepare_memory.py measures it), whatever the corpus' size (a document with no checked cut in a block,
one long word, grows its block until one comes).

--chat: INPUT is JSON lines of {"messages": [{"role": ..., "content": ...}, ...]}, rendered through the tokenizer's own
chat template (transformers' apply_chat_template; tokenizer_config.json's chat_template or chat_template.jinja). Beside
each shard NAME.bin, NAME.mask holds a byte a token (train/tasks/shards.py): which tokens count in the loss (the
assistant's turns, their end-of-turn token included), where a conversation starts. The assistant's turns are found by
rendering the conversation turn by turn: the text between the render of the turns before it with the generation
prompt and the render of the turns up to it (most templates, Llama 3's and Qwen's among them, mark no {% generation %}).

Usage errors: one line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from train.config import OneLineParser, UsageError

VOCAB = {"bytes": 256, "gpt2": 50257}
BLOCK_CHARS = 1 << 18  # characters (bytes for `bytes`) a block: encoded apart, BATCH at a time
CONTEXT = 1024  # characters before a cut encoded with the block after it (at most a quarter of BLOCK_CHARS)
TRIES = 4  # cuts of each kind checked in a block before it grows
BATCH = max(2, os.cpu_count() or 1)  # blocks encoded together: one a core
CHATS = 512  # conversations encoded together
COPY = 1 << 22  # tokens a read when the shards are copied from the token file and read back
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")  # where no eos_token is set
LLMC_MAX = 2**31 - 1  # tokens an llm.c shard's header can count (an int32)
TMP = ".prepare-{}.tmp"  # the token file (and mask) in OUTDIR while the command runs


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m train.prepare", description="Text files -> llm.c/nanoGPT token shards.")
    p.add_argument("input", help="a text file, or a folder of .txt files (.jsonl: {\"text\": ...} a line); with "
                                 "--chat, a .jsonl file of conversations")
    p.add_argument("outdir", help="the folder to write the shards into (created; must hold no .bin yet)")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|gpt2|PATH",
                   help="bytes: vocabulary 256, no download; gpt2: tiktoken's GPT-2 encoding; PATH: a Hugging Face "
                        "tokenizer.json, or a model folder holding one (default: bytes)")
    p.add_argument("--format", choices=("llmc", "nanogpt"), default="llmc",
                   help="llmc: 1024-byte header then uint16 (uint32 for vocabularies over 65536); nanogpt: bare "
                        "uint16 (default: llmc)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                   help="at most N tokens per shard (default: 100M, as llm.c's fineweb shards)")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="the last F of the tokens is the validation split, 0 < F < 1 (default: 0.1)")
    p.add_argument("--name", default="", help="the shards' name prefix (default: INPUT's name)")
    p.add_argument("--chat", action="store_true",
                   help="INPUT is JSON lines of {\"messages\": [...]}: rendered by the tokenizer's chat template, "
                        "a loss mask beside the shards that counts the assistant's tokens only")
    a = p.parse_args(argv)
    if a.shard_tokens <= 0:
        raise UsageError(f"--shard-tokens must be > 0, got {a.shard_tokens}")
    if a.format == "llmc" and a.shard_tokens > LLMC_MAX:  # the header's count is an int32
        raise UsageError(f"--shard-tokens {a.shard_tokens} is more than an llm.c shard holds ({LLMC_MAX} tokens: "
                         f"its header's count is an int32): give at most {LLMC_MAX}")
    if not 0 < a.val_fraction < 1:
        raise UsageError(f"--val-fraction must be between 0 and 1 (exclusive), got {a.val_fraction}")
    if a.chat and a.tokenizer in VOCAB:
        raise UsageError("--chat needs --tokenizer PATH: a Hugging Face model folder whose tokenizer has a chat "
                         "template")
    return a


def text_files(path: Path, chat: bool = False) -> list[Path]:
    if chat:
        if not path.is_file():
            raise UsageError(f"{path} is not a file (--chat reads one .jsonl file of conversations)")
        return [path]
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise UsageError(f"{path} holds no .txt or .jsonl file")
        return files
    raise UsageError(f"{path} does not exist (give a text file or a folder of .txt files)")


def shard_name(stem: str) -> str:
    """The shards' prefix without the words that name a split ("val_notes.txt" would make val_notes_train_0.bin,
    both splits at once to train.tasks.shards.split_of)."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", stem) if w and w.lower() not in {"train", "val", "valid",
                                                                                   "validation"}]
    return "_".join(words) or "shard"


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


class Encoder:
    """A tokenizer as prepare uses it: blocks of a document -> token ids, the ids that go before and after each
    document, the vocabulary's size."""

    def __init__(self, encode_batch, vocab: int, begin: list[int], end: list[int], binary: bool = False):
        self.encode_batch, self.vocab, self.begin, self.end, self.binary = encode_batch, vocab, begin, end, binary


def tokenizer(name: str) -> Encoder:
    if name == "bytes":
        return Encoder(lambda blocks: [np.frombuffer(b, dtype=np.uint8) for b in blocks], VOCAB["bytes"], [], [],
                       binary=True)
    if name != "gpt2":
        return hf_tokenizer(Path(name))
    try:
        import tiktoken

        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # not installed, or its files neither cached nor downloadable
        raise UsageError(f"--tokenizer gpt2 needs tiktoken and its GPT-2 encoding files (pip install tiktoken; "
                         f"offline, TIKTOKEN_CACHE_DIR must hold them): {_one_line(e)}") from None
    batch = getattr(enc, "encode_ordinary_batch", None) or (lambda blocks: [enc.encode_ordinary(b) for b in blocks])
    # <|endoftext|> starts each document, as in llm.c's fineweb.py
    return Encoder(lambda blocks: [np.array(ids, dtype=np.int64) for ids in batch(blocks)], VOCAB["gpt2"],
                   [enc.eot_token], [])


def tokenizer_file(path: Path) -> Path:
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no tokenizer.json" if path.is_dir() else f"{path} does not exist"
        raise UsageError(f"--tokenizer: {where} (bytes, gpt2, or a Hugging Face tokenizer.json or model folder)")
    return file


def hf_tokenizer(path: Path) -> Encoder:
    """A Hugging Face tokenizer.json (the file, or a folder holding it), read by `tokenizers` alone; its
    end-of-text token from the tokenizer_config.json beside it, else from its vocabulary."""
    file = tokenizer_file(path)
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise UsageError(f"--tokenizer {path} needs the tokenizers library ({e}): pip install -r requirements-hf.txt"
                         ) from None
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:
        raise UsageError(f"--tokenizer: {file} does not read as a Hugging Face tokenizer ({_one_line(e)})") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    added = set(tok.get_added_tokens_decoder())
    probes = [tok.decode([next((i for i in range(vocab) if i not in added), 0)]), "a", " the"]  # first: a word of it
    plain, full = next(((p, f) for p, f in ((tok.encode(w, add_special_tokens=False).ids, tok.encode(w).ids)
                                            for w in probes) if p and not added & set(p)), ([], []))  # no unknown
    at = next((i for i in range(len(full) - len(plain) + 1) if plain and full[i:i + len(plain)] == plain), None)
    begin, end = (full[:at], full[at + len(plain):]) if at is not None else ([], [])  # what the post-processor adds
    if not end:
        eos = end_of_text(tok, file.parent / "tokenizer_config.json")
        if eos is None:
            raise UsageError(f"--tokenizer: {file} has no end-of-text token to put between documents (no eos_token in "
                             f"a tokenizer_config.json beside it, none of {', '.join(EOS_NAMES)} in its vocabulary): "
                             f"set eos_token in its tokenizer_config.json")
        end = [eos]
    fast = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: a fraction of the memory

    def encode(blocks: list[str]) -> list[np.ndarray]:
        return [np.array(e.ids, dtype=np.int64) for e in fast(blocks, add_special_tokens=False)]

    return Encoder(encode, vocab, begin, end)


def end_of_text(tok, config: Path) -> int | None:
    """The id of the tokenizer's end of a document: <|endoftext|> or <|end_of_text|> where it has one (a chat model's
    eos_token may be its end of a turn: Llama 3's <|eot_id|>, ChatML's <|im_end|>), else tokenizer_config.json's
    eos_token, else the first of EOS_NAMES the vocabulary has."""
    try:
        eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        eos = None
    if isinstance(eos, dict):
        eos = eos.get("content")
    for name in [*EOS_NAMES[:2], *([eos] if isinstance(eos, str) else []), *EOS_NAMES[2:]]:
        if (i := tok.token_to_id(name)) is not None:
            return i
    return None


def context() -> int:
    return min(CONTEXT, BLOCK_CHARS // 4)


# Where a block may end, most likely first: before a space between two non-spaces (where pre-tokenizers cut), after
# a newline, beside punctuation (text without spaces). A position is a match's start.
CUTS = [re.compile(r"(?<=\S) (?=\S)"), re.compile(r"(?<=\n)(?=\S)"),
        re.compile(r"(?<=\w)(?=[^\w\s])|(?<=[^\w\s])(?=\w)")]


def join(encode_batch, text: str, at: int) -> bool:
    """Whether a cut of `text` at `at` changes no token: the CONTEXT characters before it encode alone as they do
    followed by the CONTEXT after it (the cut is a token boundary), and the tokens after it are the same after a
    context half as long (they depend on nothing further back)."""
    k = context()
    right, ctx, half = text[at:at + k], text[at - k:at], text[at - k // 2:at]
    a, b, c, d = encode_batch([ctx + right, ctx, half + right, half])
    return starts_with(a, b) and starts_with(c, d) and np.array_equal(a[len(b):], c[len(d):])


def starts_with(ids: np.ndarray, head: np.ndarray) -> bool:
    return len(ids) >= len(head) and np.array_equal(ids[:len(head)], head)


def cut(text: str, encode_batch) -> int:
    """Where to end a block of `text`: the last of TRIES positions of each of CUTS' kinds in its second half (with
    CONTEXT characters after it) where join() holds; 0 where none does."""
    k = context()
    lo, hi = max(len(text) // 2, k), len(text) - k
    for kind in CUTS:
        span = 4096
        while True:  # the last TRIES, searched from the end
            found = [m.start() for m in kind.finditer(text, max(lo, hi - span), hi)]
            if len(found) >= TRIES or hi - span <= lo:
                break
            span *= 4
        for at in found[::-1][:TRIES]:
            if join(encode_batch, text, at):
                return at
    return 0


def pieces(chunks: Iterator[str], encode_batch) -> Iterator[tuple[str, str]]:
    """A document's text, given as chunks, in (context, block) pieces of about BLOCK_CHARS: each block ends at a cut
    (cut()), each context is the CONTEXT characters before its block ("" for the first)."""
    carry, ctx = "", ""
    for chunk in chunks:
        text = carry + chunk
        at = cut(text, encode_batch) if len(text) >= BLOCK_CHARS else 0
        if at:
            yield ctx, text[:at]
            ctx, carry = text[at - context():at], text[at:]
        else:  # no cut yet: the block grows
            carry = text
    if carry:
        yield ctx, carry


def split(text: str, enc: Encoder) -> Iterator[tuple[str | bytes, str | bytes]]:
    """A document held in memory (a line of a .jsonl) as blocks() gives a file's."""
    chunks = (text[i:i + BLOCK_CHARS] for i in range(0, len(text), BLOCK_CHARS))
    if enc.binary:  # bytes: any cut changes no token
        yield from ((b"", c.encode()) for c in chunks)
    else:
        yield from pieces(chunks, enc.encode_batch)


def documents(path: Path, enc: Encoder) -> Iterator[Iterator[tuple[str | bytes, str | bytes]]]:
    """A file's documents, each as its (context, block) pieces: a .jsonl file's lines ({"text": ...} each), else the
    whole file."""
    if path.suffix != ".jsonl":
        yield blocks(path, enc)
        return
    for n, text in json_lines(path, "text"):
        if not isinstance(text, str):
            raise UsageError(f"{path}:{n}: \"text\" is a {type(text).__name__}, not a string")
        yield split(text, enc)


def json_lines(path: Path, key: str) -> Iterator[tuple[int, object]]:
    """(line number, the value of `key`) of each non-empty line of a JSON-lines file; a line that is not a JSON
    object holding `key` is a UsageError naming the file and line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)[key]
            except (ValueError, KeyError, TypeError) as e:
                raise UsageError(f"{path}:{n}: not a JSON object with \"{key}\" ({_one_line(e)})") from None
            yield n, value


def blocks(path: Path, enc: Encoder) -> Iterator[tuple[str | bytes, str | bytes]]:
    """A file's text as (context, block) pieces of about BLOCK_CHARS (pieces())."""
    if enc.binary:
        with open(path, "rb") as f:
            while data := f.read(BLOCK_CHARS):
                yield b"", data
        return
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        yield from pieces(iter(lambda: f.read(BLOCK_CHARS), ""), enc.encode_batch)


class TokenFile:
    """The tokens (and their mask bytes) as they come, in OUTDIR's temporary files: nothing held in memory."""

    def __init__(self, outdir: Path, dtype: np.dtype, masked: bool, bar):
        self.path, self.mask_path = outdir / TMP.format("tokens"), outdir / TMP.format("mask")
        self.dtype, self.bar, self.count, self.top = dtype, bar, 0, -1
        self.f = open(self.path, "wb")
        self.m = open(self.mask_path, "wb") if masked else None

    def write(self, ids, mask: np.ndarray | None = None) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size:
            self.top = max(self.top, int(ids.max()))
            self.f.write(ids.astype(self.dtype).tobytes())
            if self.m is not None:
                self.m.write(np.asarray(mask, dtype=np.uint8).tobytes())
            self.count += ids.size

    def close(self) -> None:
        self.f.close()
        if self.m is not None:
            self.m.close()

    def remove(self) -> None:
        self.close()
        for p in (self.path, self.mask_path):
            p.unlink(missing_ok=True)


def encode_documents(files: list[Path], enc: Encoder, out: TokenFile, bar) -> None:
    """Each document: the tokenizer's begin tokens, its blocks' tokens, its end tokens; 2 x BATCH blocks encoded at
    once."""
    pending: list = []  # token arrays and (context, block) pieces, in order

    # A block that does not start its document is encoded after its context (the text before the cut), and the
    # context's own tokens are dropped: a tokenizer that marks the start of a text (a sentencepiece-style "▁" in front,
    # Llama 2's and Mistral's; a byte-level add_prefix_space; a Strip) marks the context's start, which goes, not the
    # block's, whatever the tokenizer's make. The cut was checked to be a token boundary (join()); the context encodes
    # to the same tokens at the head of the block's encoding, or prepare stops rather than write other tokens.
    def flush():
        texts = [t for p in pending if isinstance(p, tuple) for t in ((p[0] + p[1], p[0]) if p[0] else (p[1],))]
        encoded = iter(enc.encode_batch(texts) if texts else [])
        for p in pending:
            if not isinstance(p, tuple):
                out.write(p)
                continue
            ids = next(encoded)
            if p[0]:
                head = next(encoded)
                if not starts_with(ids, head):
                    raise RuntimeError(f"the tokenizer encodes the {len(p[0])} characters before a block cut "
                                       f"otherwise when the block follows them: {p[0][-40:]!r}")
                ids = ids[len(head):]
            out.write(ids)
        bar.update(sum(len(p[1]) for p in pending if isinstance(p, tuple)))
        pending.clear()

    for f in files:
        for doc in documents(f, enc):
            pending.append(np.array(enc.begin, dtype=np.int64))
            for piece in doc:
                pending.append(piece)
                if len(pending) >= 2 * BATCH:
                    flush()
            pending.append(np.array(enc.end, dtype=np.int64))
    flush()


# ---------------------------------------------------------------- conversations


def chat_tokenizer(path: Path):
    """transformers' tokenizer of the folder (offline), which must have a chat template."""
    folder = path if path.is_dir() else path.parent
    tokenizer_file(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError as e:
        raise UsageError(f"--chat needs transformers ({e}): pip install -r requirements-hf.txt") from None
    transformers.logging.set_verbosity_error()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise UsageError(f"--tokenizer: transformers reads no tokenizer from {folder} ({_one_line(e)})") from None
    if not getattr(tok, "chat_template", None):
        raise UsageError(f"--chat: the tokenizer of {folder} has no chat template (chat_template in its "
                         f"tokenizer_config.json, or chat_template.jinja)")
    if not tok.is_fast:
        raise UsageError(f"--chat: the tokenizer of {folder} is not a fast one (it needs a tokenizer.json)")
    return tok


def conversations(path: Path) -> Iterator[tuple[int, list[dict]]]:
    """(line number, messages) of each non-empty line; a line that is not a conversation is a UsageError."""
    for n, msgs in json_lines(path, "messages"):
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise UsageError(f"{path}:{n}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": "
                             f"str}}")
        yield n, msgs


def render(tok, msgs: list[dict], where: str, gen: bool = False) -> str:
    try:
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    except Exception as e:
        raise UsageError(f"{where}: the chat template fails on it ({_one_line(e)})") from None


def assistant_spans(tok, msgs: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant's turns: from the end of the render of
    the turns before (with the generation prompt) to the end of the render up to the turn (its end-of-turn token
    included). A template whose renders are not prefixes of each other is refused."""
    full, spans = render(tok, msgs, where), []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before, upto = render(tok, msgs[:k], where, gen=True), render(tok, msgs[:k + 1], where)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise UsageError(f"{where}: the chat template renders the turns before assistant turn {k} differently "
                             f"alone and in the whole conversation, so its tokens cannot be told apart")
        spans.append((len(before), len(upto)))
    if not spans:
        raise UsageError(f"{where}: no assistant turn: nothing of it would count in the loss")
    return full, spans


def encode_chats(path: Path, tok, out: TokenFile, bar) -> array:
    """Each conversation rendered and encoded (CHATS at once), with its mask; returns where each one starts."""
    from train.tasks.shards import COUNTS, STARTS

    starts = array("q")  # 8 bytes a conversation
    pending: list[tuple[str, list[tuple[int, int]]]] = []

    def flush():
        enc = tok([text for text, _ in pending], add_special_tokens=False, return_offsets_mapping=True)
        for (text, spans), ids, offsets in zip(pending, enc["input_ids"], enc["offset_mapping"], strict=True):
            at = np.array([o[0] for o in offsets], dtype=np.int64)
            counts = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans:
                counts |= (at >= lo) & (at < hi)
            mask = counts.astype(np.uint8) * COUNTS
            if len(mask):
                mask[0] |= STARTS
            starts.append(out.count)
            out.write(ids, mask)
            bar.update(len(text))
        pending.clear()

    for n, msgs in conversations(path):
        pending.append(assistant_spans(tok, msgs, f"{path}:{n}"))
        if len(pending) >= CHATS:
            flush()
    if pending:
        flush()
    return starts


# ---------------------------------------------------------------- the shards


def read(path: Path, dtype, offset: int, count: int) -> np.ndarray:
    """count items of dtype from byte offset: a read, not a memory map (whose pages would count as the process')."""
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(count * np.dtype(dtype).itemsize), dtype=dtype)


def write_split(src: TokenFile, lo: int, hi: int, outdir: Path, name: str, split: str, args, vocab: int,
                bar) -> list[Path]:
    """Tokens [lo, hi) of the token file as shards (and masks), each copied and read back in reads of COPY tokens;
    each one's largest id kept in the vocabulary check's cache (shards.TOKEN_MAX): a run reads none whole again."""
    from train.tasks import shards  # imports torch: only once the arguments are known to be good

    paths, tops = [], {}
    for i, start in enumerate(range(lo, hi, args.shard_tokens)):
        stop = min(start + args.shard_tokens, hi)
        path = outdir / f"{name}_{split}_{i:06d}.bin"
        with open(path, "wb") as f:
            if args.format == "llmc":
                f.write(shards.header(stop - start, src.dtype))
            for at in range(start, stop, COPY):
                f.write(read(src.path, src.dtype, at * src.dtype.itemsize, min(COPY, stop - at)).tobytes())
        if src.m is not None:
            with open(path.with_suffix(shards.MASK), "wb") as f:
                for at in range(start, stop, COPY):
                    f.write(read(src.mask_path, np.uint8, at, min(COPY, stop - at)).tobytes())
        back = shards.open_shard(path, args.format)  # read back: the header, the size, every token
        top = -1
        for at in range(start, stop, COPY):
            n = min(COPY, stop - at)
            got = read(path, back.dtype, back.offset + (at - start) * back.dtype.itemsize, n)
            if back.dtype != src.dtype or back.count != stop - start or not np.array_equal(
                    got, read(src.path, src.dtype, at * src.dtype.itemsize, n)):
                raise RuntimeError(f"{path}: reading the shard back does not give the tokens written")
            top = max(top, int(got.max()))
            bar.update(n)
        if top >= vocab:
            raise RuntimeError(f"{path}: token id {top} >= the tokenizer's vocabulary {vocab}")
        st = path.stat()
        tops[path.name] = [st.st_size, st.st_mtime_ns, top]
        paths.append(path)
    shards._write_cache(outdir.resolve(), tops)
    return paths


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        files = text_files(Path(args.input), args.chat)
        outdir = Path(args.outdir)
        if outdir.exists() and not outdir.is_dir():
            raise UsageError(f"{outdir} exists and is not a folder")
        if outdir.is_dir() and any(outdir.glob("*.bin")):
            raise UsageError(f"{outdir} already holds .bin shards: remove them or choose another folder "
                             "(the trainer reads every shard there)")
        if args.chat:
            chat = chat_tokenizer(Path(args.tokenizer))
            vocab = len(chat)
        else:
            enc = tokenizer(args.tokenizer)
            vocab = enc.vocab
        dtype = np.dtype("<u2") if vocab <= 2**16 else np.dtype("<u4")
        if args.format == "nanogpt" and dtype.itemsize > 2:
            raise UsageError(f"--tokenizer {args.tokenizer} has a vocabulary of {vocab} tokens, more than nanoGPT's "
                             f"uint16 files hold (65536): use --format llmc (its uint32 shards)")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    name = shard_name(args.name or Path(args.input).resolve().stem)
    created = not outdir.exists()
    outdir.mkdir(parents=True, exist_ok=True)

    def fail(message: str) -> int:  # the temporary files are gone: the folder too, where this command made it
        if created and not any(outdir.iterdir()):
            outdir.rmdir()
        print(f"error: {message}", file=sys.stderr)
        return 2

    size = sum(f.stat().st_size for f in files)
    with tqdm(total=size, unit="B", unit_scale=True, desc="tokenize", disable=None) as bar:  # None: on a terminal
        src = TokenFile(outdir, dtype, args.chat, bar)
        try:
            if args.chat:
                starts = encode_chats(files[0], chat, src, bar)
            else:
                encode_documents(files, enc, src, bar)
        except UsageError as e:
            src.remove()
            return fail(str(e))
        except BaseException:
            src.remove()
            raise
    src.close()
    try:
        total = src.count
        n_val = int(round(total * args.val_fraction))
        if args.chat and 0 < n_val < total:  # the validation split starts with a conversation
            n_val = total - starts[min(int(np.searchsorted(starts, total - n_val)), len(starts) - 1)]
        if n_val == 0 or n_val == total:
            what = f"{len(starts)} conversation(s), " if args.chat else ""
            src.remove()
            return fail(f"{args.input} has {what}{total} tokens: too few for a train and a validation split "
                        f"with --val-fraction {args.val_fraction}")
        with tqdm(total=total, unit="tok", unit_scale=True, desc="write", disable=None) as bar:
            val = write_split(src, total - n_val, total, outdir, name, "val", args, vocab, bar)
            train = write_split(src, 0, total - n_val, outdir, name, "train", args, vocab, bar)
    finally:
        src.remove()
    kind = f"uint{dtype.itemsize * 8}"
    print(f"{total - n_val} training tokens in {len(train)} shard(s), {n_val} validation tokens in "
          f"{len(val)}, vocabulary {vocab} ({args.tokenizer}), {args.format} format, {kind}"
          f"{', a loss mask beside each shard' if args.chat else ''}: {outdir}")
    if args.tokenizer in VOCAB:  # the built-in GPT pads the vocabulary to a multiple of 64 (50304)
        print(f"train on them: task.data={outdir} task.vocab_size={vocab} task.format={args.format}")
    else:  # the model whose tokenizer it is: its config.json says its vocabulary
        folder = Path(args.tokenizer) if Path(args.tokenizer).is_dir() else Path(args.tokenizer).parent
        print(f"train on them: python -m train --config configs/hf.yaml task.path={folder} task.data={outdir} "
              f"task.format={args.format} (the model whose tokenizer it is)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
