"""Models, losses and optimizers, built from the names the registries in :mod:`rayapp.spec.catalog`
give them. Sizes come from the data so a job cannot mismatch them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rayapp.spec import LOSSES, MODELS, OPTIMIZERS, JobSpec
from rayapp.spec.job import is_import_path
from rayapp.train.builders import import_object


def build_model(spec: JobSpec) -> nn.Module:
    """The user's model.factory(**model.args), or the built-in model.kind names. Built from the
    job's seed, so every rank starts from the same weights."""
    torch.manual_seed(spec.train.seed)
    if spec.model.factory is not None:
        model = import_object(spec.model.factory)(**spec.model.args)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{spec.model.factory} returned {type(model).__name__}; expected a torch.nn.Module"
            )
        return model
    assert spec.model.kind is not None  # the spec holds model.factory or model.kind
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


def build_loss(spec: JobSpec) -> Callable[..., torch.Tensor]:
    """A built-in loss by name, or the user's ``module:function``: a loss function (outputs,
    targets) -> tensor, used as is, or an nn.Module class, instantiated."""
    if not is_import_path(spec.loss):
        return import_object(LOSSES.get(spec.loss).target)()
    loss = import_object(spec.loss)
    return loss() if isinstance(loss, type) else loss


def build_optimizer(spec: JobSpec, model: nn.Module) -> torch.optim.Optimizer:
    """A built-in optimizer by name, or the user's ``module:function(params, lr=...)``."""
    name = spec.train.optimizer
    factory = import_object(name if is_import_path(name) else OPTIMIZERS.get(name).target)
    optimizer = factory(model.parameters(), lr=spec.train.lr)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{name} returned {type(optimizer).__name__}; expected a torch.optim.Optimizer"
        )
    return optimizer
