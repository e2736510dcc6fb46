"""BatchNorm under DDP: statistics per replica, and what SyncBatchNorm computes.

Functions taking `rank, world_size` run on every rank of a process group.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["bn_experiment", "global_batch_norm", "syncbn_error"]


def global_batch_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Normalize this rank's batch with the mean and variance of ALL ranks' batches.

    This is what SyncBatchNorm does in training: all-reduce the count, the sum
    and the sum of squares, then normalize locally (collective; weight 1, bias 0).
    """
    stats = torch.stack([torch.full_like(x[0], len(x)), x.sum(0), (x * x).sum(0)])
    dist.all_reduce(stats)
    count, total, squares = stats
    mean = total / count
    var = squares / count - mean * mean  # biased, as BatchNorm normalizes with
    return (x - mean) / torch.sqrt(var + eps)


def _local_batch(rank: int, batch_per_rank: int, features: int, shift: float):
    """This rank's samples: each rank's data has another mean, as unshuffled
    shards of sorted data would."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(batch_per_rank, features, generator=g) + shift * rank


def bn_experiment(rank: int, world_size: int, batch_per_rank: int = 8,
                  features: int = 4, shift: float = 3.0, steps: int = 2) -> dict:
    """BatchNorm1d in DDP against BatchNorm over the whole batch, on every rank.

    Each rank runs `steps` training forwards on its own batch. References in
    one process: BatchNorm on the whole (all ranks') batch, and on this rank's
    batch alone.
    """
    x = _local_batch(rank, batch_per_rank, features, shift)
    every = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(every, x)
    whole = torch.cat(every)  # the global batch, as one process would see it

    on_whole, on_own = nn.BatchNorm1d(features), nn.BatchNorm1d(features)
    for _ in range(steps):
        out_whole = on_whole(whole)[rank * batch_per_rank:(rank + 1) * batch_per_rank]
        on_own(x)

    running = {}
    for broadcast in (True, False):
        torch.manual_seed(0)
        model = _ddp(nn.BatchNorm1d(features), broadcast)
        for _ in range(steps):
            out = model(x)  # training mode: normalized with this rank's statistics
        running[broadcast] = model.module.running_mean.detach().clone()
    means = [torch.empty(features) for _ in range(world_size)]
    dist.all_gather(means, running[False])

    def diff(a, b):
        return (a.detach() - b.detach()).abs().max().item()

    return {
        "rank": rank,
        "local_mean": x.mean().item(),
        # Outputs: each replica normalizes with its own batch, not the whole one.
        "per_replica_vs_whole": diff(out, out_whole),
        # Buffer sync on (the default): before every forward DDP copies
        # rank 0's buffers to all ranks, so what survives is rank 0's own data.
        "running_vs_own_data": diff(running[True], on_own.running_mean),
        "running_vs_whole": diff(running[True], on_whole.running_mean),
        # Buffer sync off: every rank keeps statistics of its own data.
        "running_spread_no_broadcast": max(diff(m, means[0]) for m in means),
        "synced_vs_whole": diff(global_batch_norm(x), out_whole),
    }


def _ddp(module: nn.Module, sync_buffers: bool) -> DDP:
    """DDP that copies rank 0's buffers before each forward, or not.

    torch 2.13 renamed `broadcast_buffers` to `forward_sync_buffers` (the old
    name warns); older versions know only the old name.
    """
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return DDP(module, forward_sync_buffers=sync_buffers)
    return DDP(module, broadcast_buffers=sync_buffers)


def syncbn_error() -> str | None:
    """The error SyncBatchNorm gives on this rank's CPU tensors, or None if it works."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(4)))
    try:
        DDP(model)
    except ValueError as err:  # DDP refuses CPU modules with SyncBatchNorm
        ddp_error = str(err)
    else:
        ddp_error = None
    try:
        model(torch.randn(8, 4))  # and the layer itself wants a GPU input
    except ValueError as err:
        return f"DDP: {ddp_error}; forward: {err}"
    return None if ddp_error is None else f"DDP: {ddp_error}"
