"""Peak memory (RSS) of `python -m train.prepare` per token, on a generated corpus and a byte-level BPE made here.

    python -m bench.studies.prepare_memory [--mb 50] [--files 1] [--vocab 8000] [--json OUT]

Writes a corpus of --mb MB of random words in sentences and lines (in --files files), trains a byte-level BPE tokenizer
of --vocab tokens on its first MB (tokenizers', as GPT-2's and Llama 3's are), then runs prepare on it and reports the
peak RSS of that process (ru_maxrss, file pages it maps included) above that of a process that only imports what
prepare imports: the bytes a token beyond the imports and one batch of blocks. Before streaming, prepare held each
file encoded whole (~576 bytes a token) and all the tokens (2 bytes each).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import PY, ROOT, env, write_json

IMPORTS = "import numpy, tqdm, tokenizers, torch, train.prepare, train.tasks.shards"


def corpus(folder: Path, mb: int, files: int) -> list[Path]:
    import numpy as np

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(20_000)]
    weights = 1.0 / np.arange(1, len(words) + 1)  # Zipf-like, as words in text are
    weights /= weights.sum()
    paths = []
    for i in range(files):
        path = folder / f"part{i:03d}.txt"
        with open(path, "w") as f:
            written = 0
            while written < mb * 2**20 // files:
                picked = rng.choice(len(words), 100_000, p=weights)
                text = " ".join(words[k] for k in picked)
                text = text.replace(" a", ". A").replace(" e", "\ne")
                f.write(text + "\n")
                written += len(text) + 1
        paths.append(path)
    return paths


def bpe(folder: Path, sample: str, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([sample], trainer=trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def peak_kib(cmd: list[str]) -> tuple[int, float, str]:
    """(peak RSS in KiB, seconds, stdout) of a command, by wait4."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed: {out}")
    return usage.ru_maxrss, time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--files", type=int, default=1)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "in").mkdir()
        paths = corpus(root / "in", args.mb, args.files)
        model = bpe(root / "model", paths[0].open().read(2**20), args.vocab)
        base, _, _ = peak_kib([PY, "-c", IMPORTS])
        peak, seconds, out = peak_kib([PY, "-m", "train.prepare", str(root / "in"), str(root / "out"), "--tokenizer",
                                       str(model)])
        tokens = sum(int(w) for w in out.split()[:1] + [out.split(" validation tokens")[0].split()[-1]])
    figures = {"corpus_mb": args.mb, "files": args.files, "tokens": tokens, "seconds": round(seconds, 1),
               "imports_rss_mib": round(base / 1024, 1), "peak_rss_mib": round(peak / 1024, 1),
               "bytes_per_token_beyond_imports": round((peak - base) * 1024 / tokens, 2)}
    for k, v in figures.items():
        print(f"{k}: {v}")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
