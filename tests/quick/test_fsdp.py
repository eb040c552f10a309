"""FSDP's pieces in one process: activation checkpointing and the FLOP count of a sharded model."""
from __future__ import annotations

import torch


def test_activation_checkpointing_recomputes_each_block_once_and_counts_batchnorm_once():
    """In-process, on a ResNet stage: its forward runs again in the backward (what saves the memory), the
    gradients are those without it, and BatchNorm's running statistics count the batch once, not twice."""
    import torchvision

    from train.parallel.wrapping import _checkpoint

    def stage():
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=10).layer2.train()

    x = torch.randn(4, 64, 8, 8)
    plain, ac = stage(), stage()
    _checkpoint(ac)
    calls = []
    ac[0].register_forward_hook(lambda *_: calls.append(1))
    for net in (plain, ac):
        net(x).square().mean().backward()
    assert len(calls) == 2  # the forward, and its recomputation
    for (name, p), q in zip(plain.named_parameters(), ac.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(plain.named_buffers(), ac.buffers(), strict=True):
        assert torch.equal(b, c), f"{name} differs: the recomputed batch counted twice"
    assert list(plain.state_dict()) == list(ac.state_dict())  # checkpoints are the same with it or without


def test_the_flop_count_of_a_sharded_model_is_the_whole_models(monkeypatch):
    """MFU's count (FlopCounterMode, for a task without its own) on a sharded model runs a meta-device twin:
    the same count as on the model itself, without touching the random state."""
    from train import config
    from train.observe import metrics as train_metrics
    from train.parallel import wrapping

    cfg = config.load("configs/default.yaml", ["task.image_size=16", "task.model=resnet18"])
    task = cfg.task_class(cfg.task, 0)
    model, batch = task.model(), (torch.randn(2, 3, 16, 16), torch.tensor([1, 2]))
    whole = train_metrics.flops_per_sample(task, model, batch)
    monkeypatch.setattr(wrapping, "sharded", lambda m: True)
    state = torch.get_rng_state()
    assert train_metrics.flops_per_sample(task, model, batch) == whole > 0
    assert torch.equal(torch.get_rng_state(), state)


def test_hsdp_replicas_are_compared_shard_by_shard():
    """ranks_in_sync's verdict from each rank's (place in its shard group, parameters' digest, buffers' digest):
    HSDP's 2 groups of 2 agree when each shard equals its copy in the other group, whatever the two shards of a
    group hold; FSDP's ranks, each at a place of its own, compare no shards; buffers agree everywhere."""
    from train.trainer import digests_agree

    assert digests_agree([(0, "a", "b"), (1, "c", "b"), (0, "a", "b"), (1, "c", "b")])
    assert not digests_agree([(0, "a", "b"), (1, "c", "b"), (0, "x", "b"), (1, "c", "b")])  # rank 2's shard
    assert not digests_agree([(0, "a", "b"), (1, "c", "b"), (0, "a", "b"), (1, "c", "x")])  # rank 3's buffers
    assert digests_agree([(0, "a", "b"), (1, "c", "b"), (2, "d", "b"), (3, "e", "b")])  # FSDP
    assert not digests_agree([(0, "a", "b"), (0, "c", "b")])  # DDP: every rank at place 0
