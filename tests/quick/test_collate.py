"""The default collate names where a batch's items differ."""
from __future__ import annotations

import pytest
import torch

from train.config import ConfigError
from train.task import Task, default_collate


def test_the_default_collate_names_where_items_differ():
    """Keys, tuple and list positions, nested; items that stack are batched as torch's default_collate does."""
    def line(items) -> str:
        with pytest.raises(ConfigError) as e:
            default_collate(items, task="t.py:T")
        return str(e.value)

    assert "at tuple position 1 (shape (3,) in item 0, (4,) in item 2)" in line(
        [(torch.zeros(2), torch.zeros(3))] * 2 + [(torch.zeros(2), torch.zeros(4))])
    assert "at key 'audio', tuple position 0 (shape (5, 2) in item 0, (6, 2) in item 1)" in line(
        [{"id": 0, "audio": (torch.zeros(5, 2), 1)}, {"id": 1, "audio": (torch.zeros(6, 2), 1)}])
    boxes = [{"boxes": [[0, 0]]}, {"boxes": [[0, 0], [1, 1]]}]
    assert "at key 'boxes' (list length 1 in item 0, 2 in item 1)" in line(boxes)
    assert line([torch.zeros(2), torch.zeros(3)]).startswith(
        "task t.py:T: the items of a batch differ in size (shape (2,) in item 0, (3,) in item 1)")
    items = [{"x": torch.randn(3), "y": i, "name": f"n{i}"} for i in range(4)]
    batch, expected = default_collate(items), torch.utils.data.default_collate(items)
    assert torch.equal(batch["x"], expected["x"]) and torch.equal(batch["y"], expected["y"])
    assert batch["name"] == expected["name"]
    with pytest.raises(TypeError):  # not a size: torch's own error
        default_collate([object(), object()])
    assert Task.collate(Task(None, 0), items)["x"].shape == (4, 3)
