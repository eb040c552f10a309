"""python -m train.prepare in one process: the tokens of each whole document, whatever the tokenizer; the shard
sizes the format holds."""
from __future__ import annotations

import numpy as np
import pytest

from train import prepare


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
