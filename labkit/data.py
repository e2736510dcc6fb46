"""Data sets: doc 004's random data, and a learnable task with a teacher network."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from . import i18n

__all__ = ["MyDataset", "TeacherDataset", "make_loader", "shard"]

i18n.register({
    "target_variance": {
        "ja": "目標値の分散 (MyDataset で届く最小値)",
        "en": "variance of the targets (the best MyDataset allows)",
    },
})


class MyDataset(Dataset):
    """Doc 004's data set: `n` random 10-vectors and random 10-vector targets.

    The document draws from the global RNG; here a seed makes it repeatable.
    Inputs and targets are independent, so there is nothing to learn: the best
    any model can do is predict the mean, a mean squared error of about 1.
    """

    def __init__(self, n: int = 1000, seed: int = 0):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randn(n, 10, generator=g)
        self.target = torch.randn(n, 10, generator=g)

    def __getitem__(self, index):
        return self.data[index], self.target[index]

    def __len__(self):
        return len(self.data)


class TeacherDataset(Dataset):
    """A learnable task: targets from a fixed random "teacher" MLP plus noise.

    The lowest reachable mean squared error is `noise ** 2`, so a loss curve
    shows real learning rather than memorised noise.
    """

    def __init__(self, n: int = 1000, in_features: int = 10, out_features: int = 10,
                 hidden: int = 32, noise: float = 0.1, seed: int = 0):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(in_features, hidden, generator=g) / in_features**0.5
        w2 = torch.randn(hidden, out_features, generator=g) / hidden**0.5
        self.data = torch.randn(n, in_features, generator=g)
        clean = torch.tanh(self.data @ w1) @ w2
        # Scale so the targets have unit variance: losses compare with MyDataset.
        clean = clean / clean.std()
        self.target = clean + noise * torch.randn(n, out_features, generator=g)
        self.noise = noise

    def __getitem__(self, index):
        return self.data[index], self.target[index]

    def __len__(self):
        return len(self.data)


def make_loader(dataset: Dataset, batch_size: int = 64, shuffle: bool = True,
                seed: int = 0, **kwargs) -> DataLoader:
    """A DataLoader whose shuffling order is fixed by `seed`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    g = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=g,
                      **kwargs)


def shard(X: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s equal, contiguous share of the batch `X` (dimension 0).

    Equal shares matter: DDP averages the ranks' gradients with equal weight,
    which equals the whole batch's gradient only when every rank has as many
    samples.
    """
    n = X.shape[0]
    if n < world_size:
        raise ValueError(f"a batch of {n} cannot be shared by {world_size} ranks")
    if n % world_size:
        raise ValueError(f"a batch of {n} does not split evenly over {world_size} "
                         "ranks; use a multiple of the world size")
    per = n // world_size
    return X[rank * per : (rank + 1) * per]
