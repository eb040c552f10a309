"""Packed windows (task.pack): conversations of masked shards fill windows best fit, each attending to itself alone
with its positions from 0, for the built-in GPT and a Hugging Face model; pretraining documents kept apart at an
end-of-text token (task.doc_mask); the padding share in the log; a run's packing kept on relaunch. The same through
the trainer on gloo ranks (stop and resume, another world size): tests/processes/test_count_loss.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from train import config, relaunch
from train.config import ConfigError
from train.observe.metrics import StepMeter
from train.tasks import shards
from train.tasks.gpt import LanguageModel
from train.tasks.gpt_model import GPT, preset

TOL = 1e-5


def write_chats(folder: Path, lengths: list[int], seed: int = 0, vocab: int = 256) -> Path:
    """A masked training shard (and a small val one) of conversations of `lengths` tokens, the second half of each
    counted in the loss."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, ls in (("train", lengths), ("val", lengths[:3])):
        toks, mask = [], []
        for n in ls:
            m = np.zeros(n, np.uint8)
            m[0] |= shards.STARTS
            m[n // 2:] |= shards.COUNTS
            toks.append(rng.integers(0, vocab, n).astype(np.uint16))
            mask.append(m)
        shards.write_shard(folder / f"chat_{split}_000000.bin", np.concatenate(toks), "llmc")
        np.concatenate(mask).tofile(folder / f"chat_{split}_000000.mask")
    return folder


def reference_best_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Best fit decreasing as the textbook says it, slowly: the largest item first, into the open bin with the least
    room that holds it (of those, the one filled last), else a new bin."""
    bins, room, touched = [], [], []
    for t, i in enumerate(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))):
        fits = [b for b in range(len(bins)) if room[b] >= sizes[i]]
        if fits:
            b = min(fits, key=lambda b: (room[b], -touched[b]))
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
            touched.append(0)
        bins[b].append(i)
        room[b] -= sizes[i]
        touched[b] = t + 1
    return [sorted(b) for b in bins]


def test_best_fit_is_the_textbook_one_and_fills_the_windows():
    rng = np.random.default_rng(0)
    for capacity, n in ((16, 200), (64, 500)):
        sizes = rng.integers(1, capacity + 1, n)
        got = shards.best_fit(sizes, capacity)
        assert sorted(i for b in got for i in b) == list(range(n))
        assert all(sizes[b].sum() <= capacity for b in got)
        assert got == reference_best_fit(sizes.tolist(), capacity)
    # conversations as the benchmark makes them (median 300, 5% over a window of 2048): hardly any padding
    lengths = np.minimum(np.round(rng.lognormal(np.log(300), 1.17, 20000)).astype(np.int64), 2048)
    bins = shards.best_fit(np.maximum(lengths, 1), 2048)
    assert 1 - lengths.sum() / (len(bins) * 2048) < 0.01


def pieces(ds: shards.MaskedWindows, index: int) -> list[tuple[list[int], list[int]]]:
    """The (x, y) of each conversation piece of window `index`, by its document ids; every position is a piece's or
    padding at the end."""
    x, y, doc = ds[index]
    out, at = [], 0
    for d in range(int(doc.max()) + 1):
        n = int((doc == d).sum())
        assert doc[at:at + n].eq(d).all(), f"piece {d} of window {index} is not in one run"
        out.append((x[at:at + n].tolist(), y[at:at + n].tolist()))
        at += n
    assert doc[at:].eq(shards.PAD_DOC).all() and y[at:].eq(shards.IGNORE).all() and not x[at:].any()
    return out


def test_packed_windows_hold_every_piece_of_the_unpacked_ones_once_apart_and_the_same_every_time(tmp_path,
                                                                                               monkeypatch):
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 12, 300).tolist() + [40, 17, 33]  # pieces of 1 to 16 tokens
    data = write_chats(tmp_path / "data", lengths)
    shard = [shards.open_shard(data / "chat_train_000000.bin")]
    seq = 16
    one = shards.MaskedWindows(shard, seq, pack=False)
    monkeypatch.setattr(shards, "BLOCK", 64)  # several blocks of pieces
    packed = shards.MaskedWindows(shard, seq, pack=True)
    alone = sorted(p for i in range(len(one)) for p in pieces(one, i))
    together = [pieces(packed, i) for i in range(len(packed))]
    assert sorted(p for w in together for p in w) == alone  # each piece once, as it is alone
    assert len(one) == len(alone) and len(packed) < len(one) / 2
    assert packed.padding_share() < 0.1 < 0.3 < one.padding_share()
    again = shards.MaskedWindows(shard, seq, pack=True)
    assert all(torch.equal(a, b) for i in range(len(packed)) for a, b in zip(packed[i], again[i], strict=True))


def several(train: shards.MaskedWindows, n: int) -> list[torch.Tensor]:
    """A batch of the last `n` windows that hold several conversations (the last is padded)."""
    chosen = [i for i in range(len(train)) if train[i][2].max() > 0][-n:]
    return [torch.stack(t) for t in zip(*(train[i] for i in chosen), strict=True)]


def gpt_task(data: Path, *keys: str) -> LanguageModel:
    cfg = config.load("configs/gpt.yaml", [f"task.data={data}", "task.model=nano", "task.seq_len=32", *keys])
    task = cfg.task_class(cfg.task, cfg.seed)
    task.check()
    return task


def test_a_conversations_logits_in_a_packed_window_are_its_logits_alone_gpt(tmp_path):
    """The built-in GPT (SDPA with the document mask): each conversation's logits in a packed window, and so its
    loss, equal those it has alone; the padding (a document of its own) gives no NaN."""
    data = write_chats(tmp_path / "data", np.random.default_rng(2).integers(3, 40, 40).tolist())
    task = gpt_task(data)
    train, _ = task.datasets()
    assert task.packed
    torch.manual_seed(0)
    model = GPT(task.gpt_config()).eval()
    batch = several(train, 6)
    x, y, doc = batch
    assert (doc == shards.PAD_DOC).any() and (doc.amax(1) > 0).all()  # padding, and windows of several
    with torch.no_grad():
        logits = task.logits(model, batch)
        assert torch.isfinite(logits).all()
        total = 0.0
        for row in range(len(x)):
            for d in range(int(doc[row].max()) + 1):
                at = doc[row] == d
                alone = model(x[row, at][None])[0]
                torch.testing.assert_close(logits[row, at], alone, rtol=TOL, atol=TOL)
                total += shards.lm_loss(alone[None], y[row, at][None], summed=True).item()
        assert task.loss(model, batch).item() == pytest.approx(total, rel=TOL)
    assert task.count(batch) == (y != shards.IGNORE).sum() and task.units(batch) == (doc >= 0).sum()


def test_pretraining_documents_apart_at_the_end_of_text_token(tmp_path):
    """task.doc_mask: a document (from an end-of-text token to the next) has the logits it has alone, its positions
    from 0; off (the default), the window is one causal sequence as ever; an end-of-text token outside the
    vocabulary is one line."""
    tokens = np.random.default_rng(3).integers(0, 255, 4 * 33 + 1).astype(np.uint16)
    tokens[[0, 10, 11, 40, 90, 100]] = 255
    folder = tmp_path / "text"
    folder.mkdir()
    for split in ("train", "val"):
        shards.write_shard(folder / f"t_{split}_000000.bin", tokens, "llmc")
    on, off = gpt_task(folder, "task.doc_mask=true", "task.eot_id=255"), gpt_task(folder)
    train, _ = on.datasets()
    off.datasets()
    batch = [torch.stack(t) for t in zip(*(train[i] for i in range(4)), strict=True)]
    torch.manual_seed(0)
    model = GPT(on.gpt_config()).eval()
    x = batch[0]
    with torch.no_grad():
        logits = on.logits(model, batch)
        assert torch.equal(off.logits(model, batch), model(x))
        for row in range(len(x)):
            cuts = [0, *(i for i in range(1, x.shape[1]) if x[row, i] == 255), x.shape[1]]
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                torch.testing.assert_close(logits[row, a:b], model(x[row, a:b][None])[0], rtol=TOL, atol=TOL)
        assert not torch.allclose(logits, model(x), rtol=TOL, atol=TOL)
    with pytest.raises(ConfigError, match="task.eot_id: token 50256 is not in the model's vocabulary of 256"):
        gpt_task(folder, "task.doc_mask=true")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_conversations_logits_in_a_packed_window_are_its_logits_alone_hf(tmp_path, attention):
    """A Hugging Face Llama: position ids restarting at each conversation, transformers' packed sequences keep each
    to itself: its logits in a packed window are those it has alone."""
    from tests import hf_models
    from tests.quick.test_hf_task import task_model

    folder = hf_models.tiny_llama(tmp_path / "model", vocab=128, tokenizer=False)
    data = write_chats(tmp_path / "data", np.random.default_rng(4).integers(3, 30, 30).tolist(), vocab=128)
    task, model = task_model(folder, None, f"task.data={data}", f"task.attention={attention}")
    train, _ = task.datasets()
    assert task.packed
    batch = several(train, 4)
    x, _, doc = batch
    assert (doc.amax(1) > 0).all()
    with torch.no_grad():
        logits = task.logits(model, batch)
        assert torch.isfinite(logits).all()
        for row in range(len(x)):
            for d in range(int(doc[row].max()) + 1):
                at = doc[row] == d
                torch.testing.assert_close(logits[row, at], model(input_ids=x[row, at][None]).logits[0], rtol=TOL,
                                           atol=TOL)


def test_a_model_that_would_let_packed_conversations_see_each_other_is_refused_in_one_line(tmp_path):
    from tests import hf_models

    folder = hf_models.tiny_other(tmp_path / "opt", "opt")
    data = write_chats(tmp_path / "data", [20] * 10, vocab=128)
    cfg = config.load("configs/hf.yaml", [f"task.path={folder}", f"task.data={data}", "task.seq_len=32"])
    task = cfg.task_class(cfg.task, cfg.seed)
    with pytest.raises(ConfigError) as e:
        task.datasets()
    assert str(e.value).startswith("task.pack: the opt model of ") and "set task.pack=false" in str(e.value)
    assert "\n" not in str(e.value)
    cfg = config.load("configs/hf.yaml", [f"task.path={folder}", f"task.data={data}", "task.seq_len=32",
                                          "task.pack=false"])
    cfg.task_class(cfg.task, cfg.seed).datasets()  # a conversation a window: nothing to keep apart


def test_throughput_counts_the_tokens_that_are_not_padding_and_logs_the_padding_share():
    meter = StepMeter(torch.device("cpu"), 1, 4, unit="tokens", units_per_sample=16)
    meter.units(48, 4)
    meter.step_done()
    out = meter.window()
    assert out["padding_share"] == pytest.approx(0.25)
    assert out["tokens_per_s"] == pytest.approx(out["samples_per_s"] * 16 * 0.75)
    meter.units(None, 4)  # a task that says nothing of padding: every position counts, as ever
    meter.step_done()
    assert "padding_share" not in meter.window()


def test_a_relaunch_keeps_the_runs_packing(tmp_path):
    """task.pack=auto takes the run's recorded packing: a run recorded unpacked, or before the key existed (its
    conversations were a window each), stays unpacked, with no change to compare; a run recorded packed stays packed;
    an explicit change is new data from its beginning."""
    import yaml

    run = tmp_path / "run"
    run.mkdir()
    base = ["--config", "configs/gpt.yaml", f"run.dir={run}"]

    def launch(recorded: dict | None, *keys: str):
        section = {"name": "train.tasks.gpt:LanguageModel", **(recorded or {})}
        (run / "config.yaml").write_text(yaml.safe_dump({"task": section}))
        cfg = config.load(base[1], [*base[2:], *keys])
        found = relaunch.changes({"task": section}, cfg)
        return cfg.task.pack, [(c.key, c.rule) for c in found if c.key == "task.pack"]

    assert launch({}) == (False, [])  # recorded before task.pack
    assert launch({"pack": False}) == (False, [])
    assert launch({"pack": "auto"}) == ("auto", [])
    assert launch({"pack": True}) == (True, [])
    assert launch({"pack": "auto"}, "task.pack=true") == ("auto", [])  # packs as the run does
    assert launch({}, "task.pack=true") == (True, [("task.pack", "data")])
    assert launch({"pack": "auto"}, "task.pack=false") == (False, [("task.pack", "data")])


def test_documents_of_any_length_in_a_batch_have_their_logits_and_gradients_alone():
    """The built-in GPT given document ids (the SDPA path, all windows' documents in a row): a document of one token,
    one filling its window, windows of one and of several documents, the padding, the same id at the end of a window
    and the start of the next: each document's logits, and the gradients of a loss over them, are those it has
    alone."""
    torch.manual_seed(0)
    model = GPT(preset("nano", block_size=32))
    lengths = [[32], [1, 7, 20, 4], [5, 1, 26], [3, 3, 3, 23]]  # each window's documents, in order
    ids = [[0], [0, 1, 2, shards.PAD_DOC], [0, 1, 2], [0, 1, 2, 3]]
    doc = torch.tensor([[d for d, n in zip(w, ns, strict=True) for _ in range(n)]
                        for w, ns in zip(ids, lengths, strict=True)])
    x = torch.randint(0, 256, doc.shape)
    weight = torch.randn(*doc.shape, model.config.padded_vocab) * (doc != shards.PAD_DOC)[..., None]
    logits = model(x, doc)
    (logits * weight).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for row, w in enumerate(ids):
        for d in w:
            at = doc[row] == d
            alone = model(x[row, at][None])[0]
            torch.testing.assert_close(logits[row, at], alone, rtol=TOL, atol=TOL)
            if d != shards.PAD_DOC:
                (alone * weight[row, at]).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
