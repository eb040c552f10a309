"""Data in this process: the built-in set, augmentation, the shard sampler, an unreadable image."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from train.config import ConfigError
from train.parallel import data
from train.tasks import image


def write_imagefolder(root, classes=("cat", "dog", "eel"), per_class: int = 6):
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                pixels = np.full((20, 24, 3), 60 * c, dtype=np.uint8)
                pixels[i % 20] = 255
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def test_builtin_data_is_deterministic_and_balanced():
    a = image.builtin(500, 10, 16, seed=3, split="train")
    b = image.builtin(500, 10, 16, seed=3, split="train")
    c = image.builtin(500, 10, 16, seed=4, split="train")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    counts = torch.bincount(a[1], minlength=10)
    assert counts.min() > 25  # every class present
    assert not torch.equal(image.builtin(500, 10, 16, 3, "eval")[0], a[0])  # eval is held out


@pytest.mark.parametrize("size", [9, 16])  # 9: 243 values an image, not a multiple of randn's blocks of 16
def test_builtin_data_drawn_in_chunks_is_the_data_drawn_whole(monkeypatch, size):
    """Built-in images are drawn a chunk at a time (host memory); a resumed run, or one on another version of
    the template, gets the same pixels whatever the chunk (tests/processes/test_golden.py holds the first losses)."""
    whole = image.builtin(257, 3, size, 5, "train")
    monkeypatch.setattr(image, "BUILTIN_CHUNK", 16)  # 17 chunks, the last of one image
    chunked = image.builtin(257, 3, size, 5, "train")
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    protos = image.prototypes(3, size, 5)  # the task's datasets() draws them once for both splits
    assert torch.equal(image.builtin(257, 3, size, 5, "eval", protos)[0], image.builtin(257, 3, size, 5, "eval")[0])


def test_the_augmentation_flips_half_of_the_images():
    """Over 3000 seeded draws (the trainer's (seed, epoch, index) keys) of an image whose brightness grows
    from left to right: flipped in half of them. 3000 draws at 0.5 have a standard deviation of 0.009: within
    0.035 of 0.5, and a rate of 0.4 (a flip read off a crop offset's parity: 2 of 5 offsets at 16 pixels, 4
    of 9 at 32) or 0.42 is out of it (by 9 standard deviations)."""
    ramp = torch.arange(16, dtype=torch.uint8).mul(16).expand(1, 3, 16, 16)
    samples = data.SeededSamples(image.ArrayDataset(ramp, torch.zeros(1, dtype=torch.long), augment=True), 0)
    n = 3000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun sets a rank (OMP_NUM_THREADS=1): 2 threads padding tiny images cost 10x
    try:
        images = torch.stack([x for x, _ in samples.__getitems__([(0, epoch) for epoch in range(n)])]).float()
    finally:
        torch.set_num_threads(threads)
    flipped = images[..., :8].mean((1, 2, 3)) > images[..., 8:].mean((1, 2, 3))  # a crop keeps the direction
    assert abs(flipped.float().mean().item() - 0.5) < 0.035, flipped.float().mean().item()


def test_shard_sampler_skips_what_was_consumed():
    ds = list(range(40))
    full = list(data.ShardSampler(ds, 2, 1, seed=0))
    torch_shard = list(torch.utils.data.DistributedSampler(ds, 2, 1, shuffle=True, seed=0, drop_last=True))
    assert [i for i, _ in full] == torch_shard  # DistributedSampler's shard, epoch for epoch
    s = data.ShardSampler(ds, 2, 1, seed=0)
    s.start = 14  # 7 per rank read
    assert list(s) == full[7:] and len(s) == len(full) - 7
    s.set_epoch(1)
    s.skip = 0
    assert [i for i, _ in s] != [i for i, _ in full] and {e for _, e in s} == {1}
    ranks = [i for r in range(2) for i, _ in data.ShardSampler(ds, 2, r, seed=0)]
    assert sorted(ranks) == ds  # the two shards cover the epoch exactly once


def _bad_images(root):
    """An ImageFolder of valid images but three in train/: a text file named .png, a PNG cut in half, a file removed
    after the listing (each user's bytes as written)."""
    write_imagefolder(root, per_class=8)
    text, cut = root / "train" / "dog" / "3.png", root / "train" / "eel" / "5.png"
    text.write_text("not an image\n")
    cut.write_bytes(cut.read_bytes()[:len(cut.read_bytes()) // 2])
    return text, cut


def test_an_image_that_does_not_read_is_one_line_naming_the_file(tmp_path):
    """The data set itself: a file that is not an image, one truncated, one gone since the folder was listed, each
    a ConfigError naming the file, what failed (PIL's words without its file object) and the fix."""
    root = tmp_path / "imgs"
    text, cut = _bad_images(root)
    ds = image.FolderDataset(root / "train", 16, True, True)
    gone = root / "train" / "cat" / "2.png"
    gone.unlink()
    files = [path for path, _ in ds.base.samples]

    def line(path) -> str:
        with pytest.raises(ConfigError) as e:
            ds[files.index(str(path))]
        return str(e.value)

    assert line(text) == f"task.path: {text} is not a readable image (PIL: cannot identify image file): remove or " \
                         f"replace it"
    assert line(cut) == f"task.path: {cut} is not a readable image (PIL: image file is truncated): remove or replace it"
    assert line(gone) == f"task.path: {gone} was removed after the run listed the folder: restore it, or relaunch " \
                         f"(the folder is listed again)"
    x, label = ds[files.index(str(root / "train" / "cat" / "1.png"))]  # the others read as before
    assert x.shape == (3, 16, 16) and label == 0
