"""Token shards on disk, in the two formats people have, and the windows a language model trains on.

- llm.c: a header of 256 int32 (magic, version, the number of tokens, then zeros), then the tokens: magic
  20240520 version 1 for uint16 tokens (GPT-2's), magic 20240801 version 7 for uint32 (Llama 3's, and any
  vocabulary over 65536): the formats of llm.c's dev/data scripts (fineweb, tinyshakespeare, ...). Its
  evaluation files are refused by name (magic 20240522: HellaSwag/MMLU examples, not a token stream).
- nanoGPT: the tokens as bare uint16, nothing else (its data/*/prepare.py: train.bin, val.bin).

A shard may have a loss mask beside it (python -m train.prepare --chat): NAME.mask for NAME.bin, one byte a
token: bit 0 set where the token counts in the loss as a target (the assistant's), bit 1 where a conversation
starts. Masked shards are read as MaskedWindows: conversations packed into windows (task.pack), each attending to
itself alone, or each conversation in windows of its own.

Shards are memory-mapped, never read whole: a TokenWindows holds only paths and lengths (it pickles in
microseconds to every loader worker) and each process opens its memory maps on first access. A malformed
shard is a ConfigError naming the file and what to do, found when the data set is built, not mid-run.

Every token id is checked against the vocabulary once per shard file, not at every start: the largest id
of each shard is kept in a small cache (TOKEN_MAX, next to the shards, else in the user's cache folder)
keyed by the file's size and modification time, and read by rank 0 alone, which tells the other ranks.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from train.config import ConfigError

MAGIC, VERSION = 20240520, 1  # llm.c's gpt-2 shards: uint16 tokens
MAGIC32, VERSION32 = 20240801, 7  # llm.c's llama-3 shards: uint32 tokens
# llm.c's other header (its dev/data/data_common.py): a file of it read as bare uint16 would be garbage.
OTHER_MAGICS = {20240522: "an evaluation file (llm.c's magic 20240522: HellaSwag/MMLU examples, not a token stream)"}
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN = np.dtype("<u2")  # nanoGPT's and llm.c's gpt-2 shards: little-endian uint16 (vocabularies up to 65536)
TOKEN32 = np.dtype("<u4")  # llm.c's llama-3 shards: little-endian uint32
Format = Literal["auto", "llmc", "nanogpt"]
MASK = ".mask"  # the loss mask beside a shard: uint8 a token
COUNTS, STARTS = 1, 2  # a mask byte's bits: the token counts in the loss (as a target); a conversation starts


@dataclass(frozen=True, eq=False)  # eq=False: no comparing (or hashing) arrays
class Shard:
    """Where a shard's tokens are: `count` tokens of type `dtype` from byte `offset` of `path`, or an in-memory
    `array`."""

    path: str
    offset: int
    count: int
    array: np.ndarray | None = None  # the built-in corpus: no file
    dtype: np.dtype = TOKEN

    @classmethod
    def of_array(cls, tokens: np.ndarray, name: str) -> Shard:
        return cls(name, 0, len(tokens), np.ascontiguousarray(tokens, dtype=TOKEN))

    def tokens(self) -> np.ndarray:
        if self.array is not None:
            return self.array
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,))

    def mask_path(self) -> Path | None:
        """The loss mask beside the shard (NAME.mask), None where there is none."""
        if self.array is not None:
            return None
        path = Path(self.path).with_suffix(MASK)
        return path if path.is_file() else None


def header(count: int, dtype: np.dtype) -> bytes:
    """llm.c's 1024-byte header for `count` tokens of `dtype` (uint16: gpt-2's, uint32: llama-3's)."""
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[:3] = (MAGIC, VERSION, count) if np.dtype(dtype) == TOKEN else (MAGIC32, VERSION32, count)
    return h.tobytes()


def write_shard(path: str | Path, tokens: np.ndarray, fmt: Literal["llmc", "nanogpt"] = "llmc",
                dtype: np.dtype = TOKEN) -> None:
    """Write one shard, its tokens as `dtype`: uint16 (the GPT-2 encoding's 50257 fit), or uint32 (llm.c's
    llama-3 format; nanoGPT's has no header to say so, and stays uint16)."""
    tokens, dtype = np.asarray(tokens), np.dtype(dtype)
    if fmt == "nanogpt" and dtype != TOKEN:
        raise ValueError(f"{path}: nanoGPT's bare format holds uint16 tokens only")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise ValueError(f"{path}: token ids must be in [0, {np.iinfo(dtype).max}] to be stored as {dtype.name}")
    with open(path, "wb") as f:
        if fmt == "llmc":
            f.write(header(len(tokens), dtype))
        f.write(tokens.astype(dtype).tobytes())


def open_shard(path: str | Path, fmt: Format = "auto") -> Shard:
    """Read and check a shard's header; auto tells the formats apart by llm.c's magic number (a bare
    GPT-2-encoded file cannot start with it: its first two tokens would have to be 55000 and 308)."""
    path = str(path)
    try:
        size = Path(path).stat().st_size
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4", count=min(size, HEADER_BYTES) // 4)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the shard ({e.strerror or e})") from None
    has_magic = len(head) > 0 and int(head[0]) in (MAGIC, MAGIC32)
    if fmt != "nanogpt" and len(head) > 0 and int(head[0]) in OTHER_MAGICS:
        bare = "" if fmt == "llmc" else "; a bare uint16 file that starts so: set task.format=nanogpt"
        raise ConfigError(f"{path}: {OTHER_MAGICS[int(head[0])]}; this trainer reads token shards (llm.c's "
                          f"magic 20240520 or 20240801): make them with python -m train.prepare{bare}")
    if fmt == "nanogpt" or (fmt == "auto" and not has_magic):
        if size % 2:
            raise ConfigError(f"{path}: {size} bytes is not a whole number of uint16 tokens: truncated, or not "
                              "a token shard (nanoGPT's bare uint16 format; an llm.c shard starts with 20240520)")
        return Shard(path, 0, size // 2)
    if not has_magic:
        found = head[0] if len(head) else "nothing"
        raise ConfigError(f"{path}: bad magic number {found}, not an llm.c shard (20240520 or 20240801); "
                          "for nanoGPT's bare uint16 files set task.format=nanogpt or auto")
    if len(head) < HEADER_INTS:
        raise ConfigError(f"{path}: truncated: {size} bytes, shorter than llm.c's 1024-byte header")
    magic, (version, dtype) = int(head[0]), ((VERSION, TOKEN) if head[0] == MAGIC else (VERSION32, TOKEN32))
    if head[1] != version:
        raise ConfigError(f"{path}: llm.c shard version {head[1]} with magic {magic}, expected {version} "
                          f"({dtype.itemsize * 8}-bit tokens)")
    count = int(head[2])
    expected = HEADER_BYTES + dtype.itemsize * count
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise ConfigError(f"{path}: {what}: its header says {count} tokens ({expected} bytes), the file has "
                          f"{size} bytes; write it again (python -m train.prepare)")
    return Shard(path, HEADER_BYTES, count, dtype=dtype)


TOKEN_MAX = ".token_max.json"  # {file name: [size, mtime_ns, largest token id]}, one per folder of shards


def _cache_files(folder: Path) -> list[Path]:
    """Where a folder's cache may be: in it, else (a read-only data set) in the user's cache folder."""
    try:  # a container's user may have no home (Path.home() raises): the folder alone, then
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "train"
    except (RuntimeError, KeyError):
        return [folder / TOKEN_MAX]
    return [folder / TOKEN_MAX, home / f"token_max-{hashlib.sha1(str(folder).encode()).hexdigest()[:16]}.json"]


def _read_cache(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(folder: Path, entries: dict) -> None:
    """Merge entries into the folder's cache, atomically (a reader sees the old file or the new one); into the
    user's cache folder where the shards' folder is not writable; not at all where neither is (it only costs
    a read of the shards at the next start)."""
    for path in _cache_files(folder):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            merged = _read_cache(path) | entries
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(merged, f)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
            return
        except OSError:
            continue


def token_max(shards: list[Shard]) -> list[int]:
    """The largest token id of each shard (-1: empty): from the cache where the file's size and modification
    time are those it was computed for, else one pass over its memory map, kept."""
    out: list[int] = []
    fresh: dict[Path, dict] = {}
    caches: dict[Path, dict] = {}
    for shard in shards:
        if shard.array is not None:
            out.append(int(shard.array.max()) if shard.count else -1)
            continue
        path = Path(shard.path).resolve()
        st = path.stat()
        key = [st.st_size, st.st_mtime_ns]
        if path.parent not in caches:
            caches[path.parent] = next((c for c in map(_read_cache, _cache_files(path.parent)) if c), {})
        hit = caches[path.parent].get(path.name)
        if isinstance(hit, list) and len(hit) == 3 and hit[:2] == key:
            out.append(int(hit[2]))
            continue
        top = int(shard.tokens().max()) if shard.count else -1
        fresh.setdefault(path.parent, {})[path.name] = [*key, top]
        out.append(top)
    for folder, entries in fresh.items():
        _write_cache(folder, entries)
    return out


VOCAB_KEY = "task.vocab_size"
VOCAB_HINT = "tokenized with a larger vocabulary? set task.vocab_size (GPT-2's encoding: 50257, padded 50304)"


def check_vocab(shards: list[Shard], vocab_size: int, vocab: str = VOCAB_KEY, hint: str = VOCAB_HINT) -> None:
    """Every token id must be < vocab_size: an out-of-range id would fail deep inside the embedding (or
    silently on some GPUs). Rank 0 finds each shard's largest id (token_max: read once, then cached) and
    tells the other ranks, which then raise the same error, or none. `vocab` names where the vocabulary's
    size comes from in the error, `hint` what to do."""
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    found: list = [None]
    if not group or dist.get_rank() == 0:
        try:
            found[0] = token_max(shards)
        except Exception as e:  # told to every rank: none waits alone in the broadcast
            found[0] = f"cannot read the shards ({type(e).__name__}: {e})"
    if group:
        dist.broadcast_object_list(found, src=0)
    if isinstance(found[0], str):
        raise ConfigError(f"task.data: {found[0]}")
    for shard, top in zip(shards, found[0], strict=True):
        if top >= vocab_size:
            raise ConfigError(f"{shard.path}: token id {top} >= {vocab} {vocab_size}: {hint}")


SPLIT_WORDS = {"train": {"train"}, "val": {"val", "valid", "validation"}}


def split_of(path: str | Path) -> str | None:
    """"train" or "val" from a shard's name, the way llm.c (fineweb_val_000000.bin) and nanoGPT (val.bin)
    name them: as a word of the file's stem, so "interval.bin" is neither."""
    words = set(re.split(r"[^a-z0-9]+", Path(path).stem.lower()))
    found = [split for split, names in SPLIT_WORDS.items() if words & names]
    return found[0] if len(found) == 1 else None


def find_shards(spec: str, key: str = "task.data") -> list[str]:
    """A shard file, a folder (its *.bin), or a glob -> the sorted list of files; ConfigError if none."""
    if any(c in spec for c in "*?["):
        files = sorted(p for p in glob.glob(spec) if Path(p).is_file())
    elif Path(spec).is_dir():
        files = sorted(str(p) for p in Path(spec).glob("*.bin") if p.is_file())
    elif Path(spec).is_file():
        files = [spec]
    else:
        raise ConfigError(f"{key}: {spec} does not exist (a shard file, a folder of *.bin shards, or a glob)")
    if not files:
        raise ConfigError(f"{key}: no shard matches {spec} (.bin files: make them with python -m train.prepare)")
    return files


def split_shards(files: list[str], split: str, spec: str, key: str = "task.data") -> list[str]:
    """The files whose names say `split`; ConfigError naming the convention if none does."""
    chosen = [f for f in files if split_of(f) == split]
    if not chosen:
        raise ConfigError(f"{key}: no shard in {spec} is named as a {split} shard (llm.c's *_{split}_*.bin or "
                          f"nanoGPT's {split}.bin)" + ("; or set task.eval_data" if split == "val" else ""))
    return chosen


def masked(split: list[Shard], key: str) -> bool:
    """Whether the shards have their loss masks (all of them: some without is a ConfigError), each one byte a token
    of its shard."""
    found = [s.mask_path() for s in split]
    if not any(found):
        return False
    if not all(found):
        missing = next(s.path for s, m in zip(split, found, strict=True) if m is None)
        raise ConfigError(f"{key}: {missing} has no loss mask ({Path(missing).with_suffix(MASK).name}) where other "
                          f"shards have theirs: prepare them together (python -m train.prepare --chat)")
    for s, m in zip(split, found, strict=True):
        if m.stat().st_size != s.count:
            raise ConfigError(f"{m}: {m.stat().st_size} bytes for the {s.count} tokens of {s.path} (one a token): "
                              f"write them again (python -m train.prepare --chat)")
    return True


def windows(data: str, eval_data: str, fmt: Format, seq_len: int, vocab_size: int, vocab: str = VOCAB_KEY,
            hint: str = VOCAB_HINT, pack: bool = False
            ) -> tuple[TokenWindows | MaskedWindows, TokenWindows | MaskedWindows]:
    """The training and evaluation windows of a language model's shards: the *train* and *val* files of `data`
    (task.data), or those of `data` and `eval_data` (task.eval_data); every token id checked < vocab_size
    (check_vocab); ConfigError where a split has no shard or no whole window. `pack`: masked shards' conversations
    packed (MaskedWindows)."""
    files = find_shards(data)
    if eval_data:
        named = [f for f in files if split_of(f) == "train"]
        train_files, val_files = named or files, find_shards(eval_data, "task.eval_data")
    else:
        train_files = split_shards(files, "train", data)
        val_files = split_shards(files, "val", data)
    splits = [("task.data", train_files), ("task.eval_data" if eval_data else "task.data", val_files)]
    opened = [[open_shard(p, fmt) for p in paths] for _, paths in splits]
    check_vocab(opened[0] + opened[1], vocab_size, vocab, hint)  # read once, then cached (and by rank 0 only)
    chat = masked(opened[0] + opened[1], "task.eval_data" if eval_data else "task.data")
    out = []
    for (key, paths), split in zip(splits, opened, strict=True):
        ds = MaskedWindows(split, seq_len, pack) if chat else TokenWindows(split, seq_len)
        if len(ds) == 0:
            raise ConfigError(f"{key}: no window of seq_len + 1 = {seq_len + 1} tokens fits in any "
                              f"shard of {', '.join(paths)}; lower task.seq_len")
        out.append(ds)
    return out[0], out[1]


class TokenWindows(Dataset):
    """Windows of seq_len + 1 tokens over a list of shards: item i is (x, y) = (w[:-1], w[1:]) as int64.

    Windows start every seq_len tokens (each token is a target once) and never cross a shard boundary:
    window i is the same tokens whatever the world size or resume point, which is all the trainer's sampler
    needs to give a resumed or resized run exactly the windows of an uninterrupted one.
    """

    def __init__(self, shards: list[Shard], seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, (s.count - 1) // seq_len) for s in shards]
        self.starts = np.cumsum([0] + counts).tolist()  # window index where each shard begins
        self._maps: list[np.ndarray | None] = [None] * len(shards)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": [None] * len(self.shards)}  # memory maps are reopened per process

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        k = bisect.bisect_right(self.starts, index) - 1
        if self._maps[k] is None:
            self._maps[k] = self.shards[k].tokens()
        begin = (index - self.starts[k]) * self.seq_len
        w = torch.from_numpy(self._maps[k][begin:begin + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


IGNORE = -100  # a target that counts in no loss (cross_entropy's ignore_index): the user's turns, padding


BLOCK = 16384  # pieces packed together (best fit decreasing within each block of a shard's pieces, in order)
PAD_DOC = -1  # the document id of a window's padding: a segment of its own (it attends to itself, never NaN)


def best_fit(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of at most `capacity` for items of `sizes` (each 1..capacity): best fit decreasing, the largest item
    first into the bin it fills most, else a new bin. Deterministic: a stable sort, and among bins with the same
    room the one filled last. O(n log capacity): the bins by room, the rooms there are in a sorted list."""
    order = np.argsort(-sizes, kind="stable").tolist()
    bins: list[list[int]] = []
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # the open bins with that much room left
    rooms: list[int] = []  # the rooms of the open bins, sorted, each once
    values = sizes.tolist()
    for i in order:
        size = values[i]
        j = bisect.bisect_left(rooms, size)
        if j == len(rooms):
            b, room = len(bins), capacity
            bins.append([i])
        else:
            room = rooms[j]
            b = by_room[room].pop()
            if not by_room[room]:
                del rooms[j]
            bins[b].append(i)
        room -= size
        if room:
            if not by_room[room]:
                bisect.insort(rooms, room)
            by_room[room].append(b)
    return [sorted(b) for b in bins]


class MaskedWindows(Dataset):
    """Windows over masked shards (python -m train.prepare --chat): each conversation from its first token, in
    pieces of at most seq_len + 1 tokens (every seq_len tokens: a longer one is split at window boundaries).
    `pack` (task.pack): a window holds as many pieces as fit (best fit decreasing within blocks of BLOCK pieces of
    a shard, in the shard's order: found once from the masks, the same at any world size); else a piece a window.
    Item i is (x, y, doc): x the pieces' inputs end to end, y their targets (IGNORE where the target does not count:
    its mask's bit 0 is clear, or padding), doc each position's piece in the window (0, 1, ...; PAD_DOC for the
    padding at the end). A model given doc attends within a piece only, its positions restarting at each: no
    conversation is in another's context or loss. Holds two int64 a piece and one a window."""

    def __init__(self, shards: list[Shard], seq_len: int, pack: bool = False):
        self.shards, self.seq_len, self.pack = shards, seq_len, pack
        begins, ends, ptrs, counts = [], [], [], []
        for s in shards:
            mask = np.memmap(s.mask_path(), dtype=np.uint8, mode="r", shape=(s.count,))
            starts = [np.zeros(1, np.int64)] + [
                lo + np.flatnonzero(mask[lo:lo + (1 << 24)] & STARTS) for lo in range(0, s.count, 1 << 24)]
            bounds = np.unique(np.concatenate(starts + [np.array([s.count])]))  # a shard's start begins one too
            lo, hi = bounds[:-1], bounds[1:]
            n = np.maximum(0, -(-(hi - lo - 1) // seq_len))  # pieces a conversation: ceil((length - 1) / seq_len)
            first = np.repeat(lo, n)
            offset = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
            begin = first + offset * seq_len
            end = np.minimum(begin + seq_len + 1, np.repeat(hi, n))
            del mask
            if pack and len(begin):
                order, sizes = [], []
                for lo in range(0, len(begin), BLOCK):
                    for w in best_fit(end[lo:lo + BLOCK] - begin[lo:lo + BLOCK] - 1, seq_len):
                        order.extend(lo + i for i in w)
                        sizes.append(len(w))
                begin, end, sizes = begin[order], end[order], np.array(sizes, np.int64)
            else:
                sizes = np.ones(len(begin), np.int64)
            begins.append(begin)
            ends.append(end)
            ptrs.append(sizes)
            counts.append(len(sizes))
        self.begin = np.concatenate(begins) if begins else np.zeros(0, np.int64)
        self.end = np.concatenate(ends) if ends else np.zeros(0, np.int64)
        self.ptr = np.concatenate([np.zeros(1, np.int64)] + ptrs).cumsum()  # window i: pieces ptr[i]:ptr[i + 1]
        self.starts = np.cumsum([0] + counts).tolist()
        self._maps: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(shards)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": [None] * len(self.shards)}

    def padding_share(self) -> float:
        """The share of the windows' positions that are padding."""
        return 1 - float((self.end - self.begin - 1).sum()) / max(1, len(self) * self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        k = bisect.bisect_right(self.starts, index) - 1
        if self._maps[k] is None:
            s = self.shards[k]
            self._maps[k] = s.tokens(), np.memmap(s.mask_path(), dtype=np.uint8, mode="r", shape=(s.count,))
        tokens, mask = self._maps[k]
        x = np.zeros(self.seq_len, dtype=np.int64)
        y = np.full(self.seq_len, IGNORE, dtype=np.int64)
        doc = np.full(self.seq_len, PAD_DOC, dtype=np.int64)
        at = 0
        for j, piece in enumerate(range(int(self.ptr[index]), int(self.ptr[index + 1]))):
            b, e = int(self.begin[piece]), int(self.end[piece])
            w = tokens[b:e].astype(np.int64)
            n = e - b - 1
            x[at:at + n] = w[:-1]
            y[at:at + n] = np.where(mask[b + 1:e] & COUNTS, w[1:], IGNORE)
            doc[at:at + n] = j
            at += n
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(doc)


def packing(pack) -> bool:
    """Whether task.pack packs masked shards' conversations: auto (the default) and true do."""
    return pack is not False


def recorded_pack(cfg, run: dict) -> None:
    """A relaunch keeps the run's packing: task.pack=auto, or a value that packs as the run's record does, takes the
    record's value; a run recorded before the key existed was unpacked (the tasks' `legacy`)."""
    was = run.get("pack", False)
    if was in ("auto", True, False) and (cfg.pack == "auto" or packing(cfg.pack) == packing(was)):
        cfg.pack = was


def real_tokens(batch) -> int | None:
    """The positions of a batch of MaskedWindows' items that are not padding; None for TokenWindows' (no padding)."""
    return int((batch[2] != PAD_DOC).sum()) if len(batch) > 2 else None


def doc_ids(x: torch.Tensor, eot_id: int) -> torch.Tensor:
    """Documents of a window of pretraining tokens: a new one at each end-of-text token (llm.c's and nanoGPT's
    shards put it before each document), the token itself its first."""
    return (x == eot_id).cumsum(1)


def lm_loss(logits: torch.Tensor, y: torch.Tensor, summed: bool = False) -> torch.Tensor:
    """The next-token cross entropy, the mean over the targets that count (all but IGNORE's; 0 where none does);
    `summed`: their sum (lm_count counts them: the trainer divides by the step's count)."""
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return total if summed else total / (y != IGNORE).sum().clamp(min=1)


def lm_count(y: torch.Tensor) -> torch.Tensor:
    """How many targets of `y` count in the loss (all but IGNORE's)."""
    return (y != IGNORE).sum()


def lm_eval(logits: torch.Tensor, y: torch.Tensor) -> dict:
    """An evaluation batch's summed loss and the number of targets it counts (averaged per counted token)."""
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")
    return {"loss": loss, "count": (y != IGNORE).sum()}
