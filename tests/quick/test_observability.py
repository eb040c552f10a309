"""Observability's pieces in one process: config checks, tags, peak FLOPs, FLOPs per sample."""
from __future__ import annotations

import pytest

from train import config
from train.config import ConfigError
from train.observe import metrics as meter
from train.observe import report_writer


def test_report_of_a_run_without_steps_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(report_writer.ReportError, match="no training steps yet"):
        report_writer.write(tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["log.wandb.mode=onlin"], "'onlin' is not one of offline, online, disabled (did you mean 'online'?)"),
    (["log.wandb.projct=x"], "did you mean 'log.wandb.project'"),
    (["log.wandb.project=a/b"], "log.wandb.project must be a non-empty name"),
    (["log.wandb.tags=" + "x" * 65], "a tag is at most 64 characters"),
    (["log.straggler_threshold=0.9"], "log.straggler_threshold must be >= 1"),
    (["log.progress_bar=on"], "log.progress_bar: 'on' is not one of auto, always, never"),
    (["profile.active=0"], "profile.active must be >= 1"),
    (["profile.wait=-1"], "profile.wait and profile.warmup must be >= 0"),
])
def test_observability_config_is_checked(overrides, message):
    with pytest.raises(ConfigError) as e:
        config.load("configs/default.yaml", overrides)
    assert message in str(e.value)


def test_tags_are_comma_separated():
    cfg = config.load("configs/default.yaml", ["log.wandb.tags=a, b,,c "])
    assert config.wandb_tags(cfg.log.wandb) == ["a", "b", "c"]


def test_peak_flops_by_device_name_and_precision():
    assert meter.peak_flops("NVIDIA H100 80GB HBM3", "bf16", True) == pytest.approx(989.4e12)
    assert meter.peak_flops("NVIDIA H100 PCIe", "bf16", True) == pytest.approx(756.5e12)
    assert meter.peak_flops("NVIDIA H200", "fp32", True) == pytest.approx(494.7e12)  # TF32 matmuls
    assert meter.peak_flops("NVIDIA A100-SXM4-80GB", "fp32", False) == pytest.approx(19.5e12)
    assert meter.peak_flops("NVIDIA A10G", "fp16", True) == pytest.approx(70e12)
    assert meter.peak_flops("Tesla V100-SXM2-32GB", "bf16", True) is None  # no bf16 tensor cores
    assert meter.peak_flops("Tesla V100-SXM2-32GB", "fp32", True) == pytest.approx(15.7e12)
    assert meter.peak_flops("Some Future GPU", "bf16", True) is None  # unknown: no MFU, no guess


def test_flops_per_sample_counts_forward_and_backward_without_touching_the_model():
    import torch

    cfg = config.load("configs/default.yaml", ["task.image_size=16"])
    task = cfg.task_class(cfg.task, cfg.seed)
    net = task.model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    batch = (torch.randn(2, 3, 16, 16), torch.tensor([1, 2]))
    state = torch.get_rng_state()
    flops = meter.flops_per_sample(task, net, batch)
    assert torch.equal(state, torch.get_rng_state())  # no random numbers drawn
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())  # BatchNorm statistics too
    assert all(p.grad is None for p in net.parameters())
    # ResNet-18 with the CIFAR stem: 0.56 GMACs = 1.11 GFLOPs forward at 32 px, a quarter of that at
    # 16 px, and backward twice forward: about 0.83 GFLOPs per sample.
    assert 0.75e9 < flops < 0.9e9, flops
