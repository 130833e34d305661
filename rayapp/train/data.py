"""Training data: the built-in data sets (registered in :mod:`rayapp.spec.catalog`) and the sharded
loader every rank iterates.

Every builder returns the same tensors on every rank (generation is seeded by the job's seed
alone); :func:`build_loader` gives each rank its own shard with a DistributedSampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, TensorDataset

from rayapp.spec import DATASETS, JobSpec
from rayapp.train.builders import import_object


@dataclass
class Datasets:
    train: Dataset
    test: Dataset | None = None


def build_datasets(spec: JobSpec) -> Datasets:
    """The job's train (and test) set: the user's data.factory(**data.args), or the built-in
    builder data.kind names. Raises TypeError naming what a factory should return."""
    if spec.data.factory is not None:
        return as_datasets(import_object(spec.data.factory)(**spec.data.args), spec.data.factory)
    kind = spec.data.kind
    assert kind is not None  # the spec holds data.factory or data.kind
    built = import_object(DATASETS.get(kind).target)(spec)
    return built if isinstance(built, Datasets) else Datasets(train=built)


def as_datasets(built: object, source: str) -> Datasets:
    """A factory's result as Datasets: a map-style Dataset, or a (train, test) pair of them."""
    if isinstance(built, Datasets):
        return built
    if isinstance(built, tuple) and len(built) == 2:
        train, test = built
        if _is_map_style(train) and _is_map_style(test):
            return Datasets(train=train, test=test)
    if _is_map_style(built):
        return Datasets(train=built)
    raise TypeError(
        f"{source} returned {type(built).__name__}; expected a map-style torch.utils.data.Dataset "
        "(with __getitem__ and __len__) or a (train, test) tuple of them"
    )


def _is_map_style(obj: object) -> TypeGuard[Dataset[Any]]:
    return (
        hasattr(obj, "__getitem__")
        and hasattr(obj, "__len__")
        and not isinstance(obj, (str, bytes, tuple, dict))
    )


def build_loader(
    spec: JobSpec,
    dataset: Dataset,
    *,
    rank: int,
    world_size: int,
    batch_size: int | None = None,
    shuffle: bool = True,
    pin_memory: bool = False,
    **loader_kwargs,
) -> DataLoader:
    """This rank's shard of `dataset` in batches (default: the per-worker batch size), reshuffled
    each epoch by ``shard_sampler(loader).set_epoch(epoch)``; the last incomplete batch is dropped
    on every rank so that all ranks take the same number of steps.

    In-memory tensors (a TensorDataset) are fetched a whole batch at a time, by indexing each
    tensor with the batch's indices, rather than sample by sample and stacked by collate: the
    same batches, without a Python call per sample."""
    sampler: DistributedSampler[int] = DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=spec.train.seed,
        drop_last=True,
    )
    batch_size = batch_size or spec.batch_size_at(world_size)
    options = {"num_workers": spec.data.loader_workers, "pin_memory": pin_memory, **loader_kwargs}
    if isinstance(dataset, TensorDataset) and "collate_fn" not in loader_kwargs:
        batches = BatchSampler(sampler, batch_size, drop_last=True)
        return DataLoader(dataset, sampler=batches, batch_size=None, **options)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **options)


def shard_sampler(loader: DataLoader) -> DistributedSampler:
    """The DistributedSampler behind a loader built by :func:`build_loader`."""
    sampler = loader.sampler
    return cast(
        "DistributedSampler[int]",
        sampler.sampler if isinstance(sampler, BatchSampler) else sampler,
    )


def _builtin_size(spec: JobSpec) -> int:
    """Training samples of a built-in data set: the spec knows them (not a user's data set's)."""
    samples = spec.num_train_samples
    assert samples is not None
    return samples


def random_regression(spec: JobSpec) -> TensorDataset:
    # The article draws torch.randn inputs and targets: there is nothing to learn, only work to do.
    generator = torch.Generator().manual_seed(spec.train.seed)
    n = _builtin_size(spec)
    inputs = torch.randn(n, spec.data.features, generator=generator)
    targets = torch.randn(n, spec.data.targets, generator=generator)
    return TensorDataset(inputs, targets)


def synthetic_regression(spec: JobSpec) -> TensorDataset:
    # A fixed random "teacher" network makes a target the model can learn, so the loss falls.
    generator = torch.Generator().manual_seed(spec.train.seed + 1)
    n, features, targets = _builtin_size(spec), spec.data.features, spec.data.targets
    inputs = torch.randn(n, features, generator=generator)
    hidden = max(features, targets)
    w1 = torch.randn(features, hidden, generator=generator) / features**0.5
    w2 = torch.randn(hidden, targets, generator=generator) / hidden**0.5
    noise = 0.01 * torch.randn(n, targets, generator=generator)
    return TensorDataset(inputs, torch.tanh(inputs @ w1) @ w2 + noise)


def digits(spec: JobSpec) -> Datasets:
    """scikit-learn's bundled digits as flat 64-pixel rows scaled to 0..1, split 80/20 by a fixed
    seed."""
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
