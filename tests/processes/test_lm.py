"""The language model task in one process: shards (both formats, malformed ones, the token-id cache),
train.prepare, the built-in corpus, the GPT model; and two ranks sharing one vocabulary check. The trainer's
multi-process runs of it are in tests/test_lm_train.py."""
from __future__ import annotations

import subprocess

import numpy as np

from tests.conftest import PY, ROOT, after_import, clean_env
from tests.processes.test_lm_train import lm_cmd
from train.tasks import shards

# A sitecustomize patch (conftest.after_import) of train.tasks.shards: the rank of every process that looks for the
# shards' largest token ids (token_max: the cache, else a read of every shard whole), one line each.
RECORD_TOKEN_MAX = """
import os
real = module.token_max
def token_max(found):
    with open(os.environ["LOOKS_FILE"], "a") as f:
        f.write(os.environ.get("RANK", "0") + "\\n")
    return real(found)
module.token_max = token_max
"""


def test_rank_0_alone_reads_the_shards_and_tells_the_other_ranks_what_is_wrong(tmp_path):
    """Two ranks: only rank 0 reads the shards for the vocabulary check, and the other rank raises the same
    one-line error from its word (a rank 0 that raised without telling would leave it waiting)."""
    data = tmp_path / "shards"
    data.mkdir()
    toks = np.arange(4096, dtype=np.uint16) % 200
    shards.write_shard(data / "c_train_000000.bin", toks, "llmc")
    toks[77] = 300  # the tiny preset's vocabulary is 256
    shards.write_shard(data / "c_val_000000.bin", toks, "llmc")
    env = after_import(tmp_path, "train.tasks.shards", RECORD_TOKEN_MAX)
    env["LOOKS_FILE"] = str(tmp_path / "looks.txt")
    run_dir = tmp_path / "run"
    proc = subprocess.run(lm_cmd(run_dir, f"task.data={data}", "train.steps=1", "dist.timeout_s=60"), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    errors = sorted(line for line in proc.stderr.splitlines() if "error: " in line)
    words = f"error: {data / 'c_val_000000.bin'}: token id 300 >= task.vocab_size 256: "
    assert [e[:len(words) + 9] for e in errors] == [f"[rank {r}] {words}" for r in (0, 1)], proc.stderr[-3000:]
    assert proc.returncode != 0  # torchrun: exit 1 and its ChildFailedError (the launcher says exit 2)
    assert (tmp_path / "looks.txt").read_text().split() == ["0"]
    assert not run_dir.exists()


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "train.prepare", *args], cwd=ROOT, env=clean_env(), capture_output=True,
                          text=True, timeout=60)


def test_prepare_usage_errors_exit_2_in_one_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 100)
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old_train.bin").write_bytes(b"")
    cases = {
        (): "required",
        (str(tmp_path / "missing.txt"), str(tmp_path / "o")): "does not exist",
        (str(tmp_path / "empty"), str(tmp_path / "o")): "no .txt or .jsonl file",
        (str(text), str(tmp_path / "full")): "already holds .bin shards",
        (str(text), str(text)): "not a folder",
        (str(text), str(tmp_path / "o"), "--val-fraction", "1"): "--val-fraction",
        (str(text), str(tmp_path / "o"), "--shard-tokens", "0"): "--shard-tokens",
        (str(text), str(tmp_path / "o"), "--shard-tokens", "x"): "invalid int",
        (str(text), str(tmp_path / "o"), "--shard-tokens", str(2**31)): "more than an llm.c shard holds",
        (str(text), str(tmp_path / "o"), "--format", "npy"): "invalid choice",
        (str(tmp_path / "o"), str(tmp_path / "o2"), "--val-fraction", "0.5"): "does not exist",
        (str(text), str(tmp_path / "o"), "--tokenizer", str(tmp_path / "no-model")): "--tokenizer: ",
        (str(text), str(tmp_path / "o"), "--tokenizer", str(tmp_path / "empty")): "holds no tokenizer.json",
    }
    (tmp_path / "tiny.txt").write_text("a")
    cases[(str(tmp_path / "tiny.txt"), str(tmp_path / "o"))] = "too few"
    try:
        import tiktoken  # noqa: F401
    except ImportError:  # without tiktoken, the gpt2 tokenizer is a usage error too
        cases[(str(text), str(tmp_path / "o"), "--tokenizer", "gpt2")] = "needs tiktoken"
    for args, words in cases.items():
        proc = run_prepare(*args)
        assert proc.returncode == 2 and proc.stdout == "", (args, proc)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], (args, proc.stderr)
    assert not (tmp_path / "o").exists()
