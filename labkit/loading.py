"""Feeding the model: DataLoader workers, persistent workers and pinned memory.

A data set whose items cost real time to produce (reading and decoding a file,
augmenting an image) is where `num_workers` matters: worker processes prepare
the next batches while the main process trains on the current one.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from . import i18n, timing

__all__ = [
    "LoaderTimes",
    "SlowDataset",
    "epoch_times",
    "loader_times",
    "pin_memory_report",
    "worker_pids",
]

i18n.register({
    "num_workers": {"ja": "num_workers (ワーカー数)", "en": "num_workers"},
    "epoch_time_s": {"ja": "1 エポックの時間 [秒]", "en": "time per epoch [s]"},
    "epoch_time_by_workers": {
        "ja": "ワーカー数ごとの 1 エポックの時間",
        "en": "Time per epoch by number of workers",
    },
    "first_batch_ms": {"ja": "最初のバッチまでの時間 [ミリ秒]",
                       "en": "time to the first batch [ms]"},
    "first_batch_by_epoch": {
        "ja": "各エポックの最初のバッチまでの時間 (ワーカー 2)",
        "en": "Time to each epoch's first batch (2 workers)",
    },
    "pin_memory_cpu_note": {
        "ja": "GPU がないので pin_memory=True は何もしません "
              "(バッチは固定されていません: is_pinned() = {pinned})",
        "en": "No GPU, so pin_memory=True does nothing "
              "(the batch is not pinned: is_pinned() = {pinned})",
    },
})


class SlowDataset(Dataset):
    """Teacher-like random samples, each costing `cost_s` seconds to "load".

    The cost is a sleep, like waiting for a disk or a network: it does not
    compete with training for the CPU, so workers overlap with it fully even on
    two cores. Item i is always the same tensor, whichever process makes it.
    """

    def __init__(self, n: int = 256, features: int = 10, cost_s: float = 0.002,
                 seed: int = 0):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if cost_s < 0:
            raise ValueError(f"cost_s must be >= 0, got {cost_s}")
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randn(n, features, generator=g)
        self.target = torch.randn(n, features, generator=g)
        self.cost_s = cost_s

    def __getitem__(self, index):
        if self.cost_s:
            time.sleep(self.cost_s)
        return self.data[index], self.target[index]

    def __len__(self):
        return len(self.data)


class _PidDataset(Dataset):
    """Each item is the id of the process that produced it."""

    def __init__(self, n: int):
        self.n = n

    def __getitem__(self, index):
        info = get_worker_info()
        return torch.tensor([os.getpid(), -1 if info is None else info.id])

    def __len__(self):
        return self.n


@dataclass
class LoaderTimes:
    """Per epoch: total seconds, and seconds until its first batch arrived."""

    epoch_s: list[float] = field(default_factory=list)
    first_batch_s: list[float] = field(default_factory=list)


def loader_times(dataset: Dataset, num_workers: int, *, batch_size: int = 32,
                 epochs: int = 2, persistent_workers: bool = False,
                 step=None) -> LoaderTimes:
    """Time `epochs` passes over `dataset`, calling `step(X, y)` on each batch.

    `step` stands for the training step: with workers, loading the next batch
    overlaps with it; with `num_workers=0` the two take turns.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                        persistent_workers=persistent_workers and num_workers > 0)
    times = LoaderTimes()
    for _ in range(epochs):
        t0 = time.perf_counter()
        first = None
        for X, y in loader:  # iter() starts the workers (again, unless persistent)
            if first is None:
                first = time.perf_counter() - t0
            if step is not None:
                step(X, y)
        times.epoch_s.append(time.perf_counter() - t0)
        times.first_batch_s.append(first if first is not None else 0.0)
    del loader  # stops persistent workers now, not at garbage collection
    return times


def epoch_times(dataset: Dataset, workers=(0, 2), *, step=None,
                batch_size: int = 32, rounds: int = 5) -> dict[int, list[float]]:
    """Seconds per epoch over `dataset` for each number of workers, in every round.

    The loaders take turns, one epoch each per round, so that a shared
    machine's changing load falls on all of them alike. Their workers are kept
    alive (persistent_workers) and started in a warm-up epoch, so the times
    are of loading and training, not of starting processes.
    """
    if any(k < 0 for k in workers):
        raise ValueError(f"numbers of workers must be >= 0, got {list(workers)}")
    loaders = {k: DataLoader(dataset, batch_size=batch_size, num_workers=k,
                             persistent_workers=k > 0) for k in workers}

    def epoch(loader):
        for X, y in loader:
            if step is not None:
                step(X, y)

    times = timing.interleaved({k: (lambda d=d: epoch(d)) for k, d in loaders.items()},
                               rounds=rounds)
    del loaders  # stops the workers now, not at garbage collection
    return times


def worker_pids(num_workers: int, persistent_workers: bool, epochs: int = 2,
                n: int = 8) -> list[set[int]]:
    """Per epoch, the process ids that produced the batches."""
    loader = DataLoader(_PidDataset(n), batch_size=2, num_workers=num_workers,
                        persistent_workers=persistent_workers and num_workers > 0)
    pids = []
    for _ in range(epochs):
        pids.append({int(batch[i, 0]) for batch in loader for i in range(len(batch))})
    del loader
    return pids


def pin_memory_report(dataset: Dataset, batch_size: int = 32) -> dict:
    """What pin_memory=True gives here: is the batch pinned, and what torch warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(dataset, batch_size=batch_size, pin_memory=True)
        X, _ = next(iter(loader))
    return {
        "accelerator": torch.cuda.is_available(),
        "pinned": X.is_pinned(),
        "warnings": [str(w.message) for w in caught if "pin" in str(w.message)],
    }
