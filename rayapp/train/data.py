"""Training data sets. Each returns tensors; the worker loop shards them with DistributedSampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.data import TensorDataset

from rayapp.spec import DATASETS, JobSpec



@dataclass
class Datasets:
    train: TensorDataset
    test: Optional[TensorDataset] = None


def build_datasets(spec: JobSpec) -> Datasets:
    """The same tensors on every rank: generation is seeded by the job's seed alone."""
    if spec.data.kind == "random":
        return Datasets(train=_random(spec))
    if spec.data.kind == "synthetic":
        return Datasets(train=_synthetic(spec))
    return _digits(spec)


def _random(spec: JobSpec) -> TensorDataset:
    # The article draws torch.randn inputs and targets: there is nothing to learn, only work to do.
    generator = torch.Generator().manual_seed(spec.train.seed)
    n = spec.num_train_samples
    inputs = torch.randn(n, spec.data.features, generator=generator)
    targets = torch.randn(n, spec.data.targets, generator=generator)
    return TensorDataset(inputs, targets)


def _synthetic(spec: JobSpec) -> TensorDataset:
    # A fixed random "teacher" network makes a target the model can learn, so the loss falls.
    generator = torch.Generator().manual_seed(spec.train.seed + 1)
    n, features, targets = spec.num_train_samples, spec.data.features, spec.data.targets
    inputs = torch.randn(n, features, generator=generator)
    hidden = max(features, targets)
    w1 = torch.randn(features, hidden, generator=generator) / features**0.5
    w2 = torch.randn(hidden, targets, generator=generator) / hidden**0.5
    noise = 0.01 * torch.randn(n, targets, generator=generator)
    return TensorDataset(inputs, torch.tanh(inputs @ w1) @ w2 + noise)


def _digits(spec: JobSpec) -> Datasets:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    inputs = torch.tensor(images, dtype=torch.float32) / 16.0  # pixel values are 0..16
    labels = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    n_train = DATASETS.get("digits").meta["train_samples"]
    train_idx, test_idx = order[:n_train], order[n_train:]
    return Datasets(
        train=TensorDataset(inputs[train_idx], labels[train_idx]),
        test=TensorDataset(inputs[test_idx], labels[test_idx]),
    )
