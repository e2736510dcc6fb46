"""DDP helpers the lessons share: count communication, shard data, time all-reduce.

Comparing the ranks' replicas is labkit.compare's job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from . import i18n, timing

__all__ = [
    "CommCounter",
    "allreduce_time",
    "shard",
]

# Lesson 03's plot of step time by world size.
i18n.register({
    "step_time_vs_world": {
        "ja": "world size ごとの 1 ステップの時間 (全体バッチ 1024)",
        "en": "Step time by world size (global batch 1024)",
    },
})


class CommCounter:
    """A DDP communication hook that counts all-reduce calls and bytes.

    It then all-reduces exactly as DDP's default does (sum, divide by world
    size), so training is unchanged. Attach before the first forward pass.
    """

    def __init__(self):
        self.sizes: list[int] = []  # each call's bytes, in the order DDP made them

    @property
    def calls(self) -> int:
        return len(self.sizes)

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    def attach(self, model: nn.parallel.DistributedDataParallel) -> CommCounter:
        model.register_comm_hook(self, CommCounter._hook)
        return self

    def reset(self) -> None:
        self.sizes = []

    @staticmethod
    def _hook(counter, bucket):  # unannotated: DDP rejects string annotations
        buffer = bucket.buffer()
        counter.sizes.append(buffer.numel() * buffer.element_size())
        return default_hooks.allreduce_hook(None, bucket)


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


def allreduce_time(numel: int, repeat: int = 10, group=None) -> float:
    """Median seconds of one all-reduce of `numel` float32 values (collective)."""
    x = torch.ones(numel)
    if dist.get_backend(group) == "nccl":
        x = x.cuda()

    def run():
        dist.all_reduce(x, group=group)

    dist.barrier(group=group)
    return timing.median_time(run, repeat=repeat, warmup=2, device=x.device)
