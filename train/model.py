"""Models: torchvision's ResNet family by name, with a CIFAR-style stem for small images."""

from __future__ import annotations

import torch.nn as nn

from train.config import ModelConfig


def build(cfg: ModelConfig, num_classes: int, image_size: int) -> nn.Module:
    import torchvision  # slow to import: only where a model is built

    norm = None
    if cfg.norm == "group":  # no batch statistics: results independent of how a batch is split
        def norm(channels: int) -> nn.Module:
            return nn.GroupNorm(min(32, channels), channels)
    model = getattr(torchvision.models, cfg.name)(weights=None, num_classes=num_classes, norm_layer=norm)
    if cfg.small_input and image_size <= 64:
        # The ImageNet stem (7x7 stride-2 conv + max-pool) shrinks 32x32 input to 8x8 before the
        # first block; a 3x3 stride-1 conv keeps the resolution, as in the CIFAR ResNets.
        width = model.conv1.out_channels
        model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    if cfg.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model
