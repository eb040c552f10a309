"""The memory tier's arithmetic (train/checkpoint/memory.py, resume.with_memory): which rank writes which share,
which shares go to a peer node, which step is complete, and which resume case a start picks. No process: the runs
are tests/processes/test_memory.py's and tests/systems/test_memory_hosts.py's."""
from __future__ import annotations

from pathlib import Path

import pytest

from train import config
from train.checkpoint.memory import Layout, MemoryState, complete_steps
from train.checkpoint.resume import Decision, with_memory
from train.checkpoint.storage import MANIFEST


def layout(strategy: str, nodes: int, per_node: int, shard_size: int = 0) -> Layout:
    cfg = config.load("configs/default.yaml", [f"dist.strategy={strategy}", f"dist.shard_size={shard_size}"])
    return Layout.of(cfg, nodes * per_node, per_node)


@pytest.mark.parametrize(("strategy", "nodes", "per_node", "shard_size", "keys", "writers", "copies"), [
    # DDP: one share, every rank's; a node's lowest rank writes it; every node holds it, nothing goes to a peer
    ("ddp", 1, 2, 0, [0, 0], [0], []),
    ("ddp", 2, 1, 0, [0, 0], [0, 1], []),
    ("ddp", 2, 2, 0, [0, 0, 0, 0], [0, 2], []),
    ("ddp", 4, 1, 0, [0, 0, 0, 0], [0, 1, 2, 3], []),
    # FSDP: a share a rank; over several nodes each goes to the next node's lowest rank, the last node's to node 0
    ("fsdp", 1, 2, 0, [0, 1], [0, 1], []),
    ("fsdp", 2, 1, 0, [0, 1], [0, 1], [(0, 1, 0), (1, 0, 1)]),
    ("fsdp", 2, 2, 0, [0, 1, 2, 3], [0, 1, 2, 3], [(0, 2, 0), (1, 2, 1), (2, 0, 2), (3, 0, 3)]),
    ("fsdp", 4, 1, 0, [0, 1, 2, 3], [0, 1, 2, 3], [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 0, 3)]),
    # HSDP: a share a place in the shard group (a node's ranks by default); every replica holds them all
    ("hsdp", 1, 2, 0, [0, 1], [0, 1], []),
    ("hsdp", 2, 2, 0, [0, 1, 0, 1], [0, 1, 2, 3], []),
    ("hsdp", 4, 1, 2, [0, 1, 0, 1], [0, 1, 2, 3], []),
    ("hsdp", 2, 2, 4, [0, 1, 2, 3], [0, 1, 2, 3], [(0, 2, 0), (1, 2, 1), (2, 0, 2), (3, 0, 3)]),  # one replica
    ("hsdp", 4, 2, 4, [0, 1, 2, 3] * 2, list(range(8)), []),  # a group over 2 nodes, 2 replicas
])
def test_each_share_has_one_writer_a_node_and_a_peer_copy_where_one_node_holds_it(strategy, nodes, per_node,
                                                                                    shard_size, keys, writers, copies):
    lay = layout(strategy, nodes, per_node, shard_size)
    assert lay.nodes() == nodes
    assert [lay.key(r) for r in range(lay.world_size)] == keys
    assert [r for r in range(lay.world_size) if lay.writer(r)] == writers
    assert lay.peer_copies() == copies
    # With the peer copies every share is held by two nodes wherever there are two: a lost node loses none
    if nodes > 1:
        for key in set(keys):
            holders = {lay.node(r) for r in range(lay.world_size) if lay.key(r) == key}
            holders |= {lay.node(dst) for _, dst, k in copies if k == key}
            assert len(holders) >= 2, (key, holders)


def test_a_layout_serves_only_the_same_world_sharding_and_node_size():
    lay = layout("fsdp", 2, 1)
    record = {"world_size": 2, "shards": 2, "strategy": "fsdp", "per_node": 1}
    assert lay.same(record)
    for key, other in (("world_size", 4), ("shards", 1), ("strategy", "hsdp"), ("per_node", 2)):
        assert not lay.same(record | {key: other}), key


def test_the_newest_step_every_share_of_which_some_node_holds_is_complete():
    fsdp = layout("fsdp", 2, 1)
    assert complete_steps([], fsdp) == (None, None)
    # (step, share, node): step 8's share 1 is on no node (a copy cut short, a host lost without its peer's copy)
    found = [(8, 0, 0), (6, 0, 0), (6, 1, 0), (6, 1, 1), (4, 0, 0), (4, 1, 1)]
    state, incomplete = complete_steps(found, fsdp)
    assert (state.step, state.holders, incomplete) == (6, {0: [0], 1: [0, 1]}, 8)
    assert state.name == "host memory step_00000006"
    state, incomplete = complete_steps([(4, 0, 0), (4, 1, 1)], fsdp)  # each share on one node: complete
    assert (state.step, state.holders, incomplete) == (4, {0: [0], 1: [1]}, None)
    assert complete_steps([(2, 1, 1)], fsdp) == (None, 2)
    state, _ = complete_steps([(2, 0, 1)], layout("ddp", 2, 1))  # one share: any node's copy serves
    assert (state.step, state.holders) == (2, {0: [1]})


def checkpoint(tmp_path: Path, step: int) -> Path:
    folder = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text("{}")
    return folder


def test_a_complete_memory_state_newer_than_the_disk_is_tried_first_and_an_older_one_never(tmp_path):
    fsdp = layout("fsdp", 2, 1)
    held = [(6, 0, 0), (6, 1, 0)]
    fresh = with_memory(Decision("auto, no checkpoint", []), held, fsdp)
    assert fresh.case == "a memory state newer than the disk's" and fresh.candidates == [MemoryState(6, {0: [0],
                                                                                                          1: [0]})]
    four = checkpoint(tmp_path, 4)
    own = with_memory(Decision("auto, the run's own checkpoints", [four]), held, fsdp)
    assert own.case == "a memory state newer than the disk's" and own.candidates[1:] == [four]  # the disk's next
    eight = checkpoint(tmp_path, 8)
    newer = Decision("auto, the run's own checkpoints", [eight, four])
    assert with_memory(newer, held, fsdp) is newer  # the disk's is newer: memory is not tried
    six = checkpoint(tmp_path, 6)
    same = Decision("auto, the run's own checkpoints", [six, four])
    assert with_memory(same, held, fsdp) is same  # the same step on disk: the disk's copy loads
    # Another run's checkpoint (resume=PATH, none of this run's own): this run's newer state in memory first
    theirs = with_memory(Decision("PATH, the run directory holds none of its own", [eight]), held, fsdp)
    assert theirs.case == "a memory state newer than the disk's" and theirs.candidates[1:] == [eight]


def test_an_incomplete_newer_state_a_rollback_and_a_fresh_start_load_nothing_from_memory(tmp_path):
    fsdp = layout("fsdp", 2, 1)
    four = checkpoint(tmp_path, 4)
    auto = Decision("auto, the run's own checkpoints", [four])
    incomplete = with_memory(auto, [(6, 0, 0), (2, 0, 0), (2, 1, 1)], fsdp)
    assert incomplete.case == "an incomplete memory state" and incomplete.candidates == [four]
    assert with_memory(auto, [(2, 0, 0), (2, 1, 1)], fsdp) is auto  # older than the disk's, complete or not
    assert with_memory(auto, [], fsdp) is auto
    rollback = Decision("PATH inside the run directory", [four], "checkpoints/step_00000004")
    back = with_memory(rollback, [(6, 0, 0), (6, 1, 0)], fsdp)
    assert back.case == "PATH inside the run directory, newer states in host memory"
    assert back.candidates == [four] and back.rollback == "checkpoints/step_00000004"
    never = Decision("never", [])
    assert with_memory(never, [(6, 0, 0), (6, 1, 0)], fsdp) is never

