"""A small convolutional network for 8x8 grey-scale digits: the model factory of this example.

rayapp calls ``build(**model.args)`` on every worker (and once on the driver, on the "meta"
device, to check it builds), then applies the job's strategy (DDP or FSDP) to what it returns.
"""

from __future__ import annotations

from torch import nn


def build(
    channels: int = 32, hidden: int = 128, classes: int = 10, dropout: float = 0.1
) -> nn.Module:
    """Two 3x3 convolutions, one 2x2 pooling, two linear layers: 1x8x8 in, `classes` logits out."""
    return nn.Sequential(
        nn.Conv2d(1, channels // 2, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels // 2, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(channels * 4 * 4, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, classes),
    )
