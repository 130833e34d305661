"""scikit-learn's bundled handwritten digits as 1x8x8 images: the data factory of this example.

The data ship inside scikit-learn (1,797 images, 10 classes), so this runs offline on every
node. rayapp calls ``load(**data.args)`` on every worker; returning a (train, test) pair makes
rayapp log ``test_accuracy`` each epoch.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def load(test_fraction: float = 0.2, seed: int = 1234) -> tuple[TensorDataset, TensorDataset]:
    """A (train, test) split that is the same on every worker: the seed fixes it."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    images = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0  # pixels are 0..16
    labels = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])
