"""Models, losses and optimizers, built from the names the registries in :mod:`rayapp.spec.catalog`
give them. Sizes come from the data so a job cannot mismatch them."""

from __future__ import annotations

import torch
from torch import nn

from rayapp.spec import LOSSES, MODELS, OPTIMIZERS, JobSpec
from rayapp.train.builders import import_object


def build_model(spec: JobSpec) -> nn.Module:
    """Built from the job's seed, so every rank starts from the same weights."""
    torch.manual_seed(spec.train.seed)
    return import_object(MODELS.get(spec.model.kind).target)(spec)


def build_linear(spec: JobSpec) -> nn.Module:
    return nn.Linear(spec.data.input_size, spec.data.output_size)


def build_mlp(spec: JobSpec) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = spec.data.input_size
    for hidden in spec.model.hidden:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, spec.data.output_size))
    return nn.Sequential(*layers)


def build_loss(spec: JobSpec) -> nn.Module:
    return import_object(LOSSES.get(spec.loss).target)()


def build_optimizer(spec: JobSpec, model: nn.Module) -> torch.optim.Optimizer:
    return import_object(OPTIMIZERS.get(spec.train.optimizer).target)(model.parameters(), lr=spec.train.lr)
