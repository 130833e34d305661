"""Models a job can train. Sizes come from the data so a job cannot mismatch them."""

from __future__ import annotations

import torch
from torch import nn

from rayapp.spec import JobSpec


def build_model(spec: JobSpec) -> nn.Module:
    """Built from the job's seed, so every rank starts from the same weights."""
    torch.manual_seed(spec.train.seed)
    in_size, out_size = spec.data.input_size, spec.data.output_size
    if spec.model.kind == "linear":
        return nn.Linear(in_size, out_size)
    layers: list[nn.Module] = []
    width = in_size
    for hidden in spec.model.hidden:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, out_size))
    return nn.Sequential(*layers)


def build_loss(spec: JobSpec) -> nn.Module:
    return nn.CrossEntropyLoss() if spec.data.is_classification else nn.MSELoss()


def build_optimizer(spec: JobSpec, model: nn.Module) -> torch.optim.Optimizer:
    if spec.train.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=spec.train.lr)
    return torch.optim.SGD(model.parameters(), lr=spec.train.lr)
