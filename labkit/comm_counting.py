"""Counting what DDP sends: its gradient buckets' all-reduces and their bytes."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

__all__ = ["CommCounter"]


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
