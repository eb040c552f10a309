"""A task written as a user writes one, whose items are token sequences of different lengths (as text, audio
or detection items are): a sequence classifier (embedding, masked mean over the tokens, MLP).

`Sequences` is the first try, without `collate`: the default collate cannot stack its items (one line, exit 2,
naming the key). `PaddedSequences` adds the `collate` that pads each batch to its longest sequence and masks the
padding, for training and evaluation alike.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from train.task import Task

PAD = 0  # the padding token; real tokens are 1..vocab-1


class RandomLengths(Dataset):
    """Sequences of 2..max_len tokens, labelled by whether more than half of their tokens are in the lower half
    of the vocabulary. `crop`: each read keeps a random part of at least 2 tokens (an augmentation drawn from
    torch's generator, which the trainer seeds per sample and epoch), so a sequence's length changes by epoch."""

    def __init__(self, n: int, vocab: int, max_len: int, seed: int, crop: bool):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, max_len + 1, (n,), generator=g)
        # All the tokens in one tensor, sequence i at tokens[starts[i]:starts[i + 1]] (a list of n tensors would
        # be n file descriptors to send to each loader worker: more than the fork server passes at once).
        self.tokens = torch.randint(1, vocab, (int(lengths.sum()),), generator=g)
        self.starts = [0, *torch.cumsum(lengths, 0).tolist()]
        self.vocab, self.crop = vocab, crop

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> dict:
        tokens = self.tokens[self.starts[i]:self.starts[i + 1]]
        if self.crop:
            keep = int(torch.randint(2, len(tokens) + 1, ()))
            start = int(torch.randint(0, len(tokens) - keep + 1, ()))
            tokens = tokens[start:start + keep]
        label = int((tokens < self.vocab // 2).float().mean() > 0.5)
        return {"tokens": tokens, "label": label}


class Classifier(nn.Module):
    def __init__(self, vocab: int, dim: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(dim, 2))

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(tokens) * m).sum(1) / m.sum(1)  # the mean over the real tokens only
        return self.head(pooled)


class Sequences(Task):
    @dataclass
    class Config:
        vocab: int = 16
        dim: int = 16
        max_len: int = 12
        train_samples: int = 256
        eval_samples: int = 40
        dropout: float = 0.1

    relaunch = {"vocab": "refused", "dim": "refused", "max_len": "data", "train_samples": "data",
                "eval_samples": "applied", "dropout": "training"}

    def datasets(self):
        c = self.cfg
        return (RandomLengths(c.train_samples, c.vocab, c.max_len, self.seed * 10 + 1, crop=True),
                RandomLengths(c.eval_samples, c.vocab, c.max_len, self.seed * 10 + 2, crop=False))

    def model(self) -> nn.Module:
        return Classifier(self.cfg.vocab, self.cfg.dim, self.cfg.dropout)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(model(batch["tokens"], batch["mask"]).float(), batch["label"])

    def eval_step(self, model: nn.Module, batch) -> dict:
        logits = model(batch["tokens"], batch["mask"]).float()
        return {"loss": F.cross_entropy(logits, batch["label"], reduction="sum"),
                "accuracy": (logits.argmax(1) == batch["label"]).sum(), "count": len(batch["label"])}


class PaddedSequences(Sequences):
    def collate(self, items: list[dict]) -> dict:
        """A batch padded to its longest sequence, with the mask of the real tokens."""
        longest = max(len(item["tokens"]) for item in items)
        tokens = torch.full((len(items), longest), PAD, dtype=torch.long)
        for row, item in zip(tokens, items, strict=True):
            row[:len(item["tokens"])] = item["tokens"]
        return {"tokens": tokens, "mask": tokens != PAD, "label": torch.tensor([item["label"] for item in items])}
