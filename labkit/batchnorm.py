"""BatchNorm under DDP: statistics per replica, and what SyncBatchNorm computes.

Functions taking `rank, world_size` run on every rank of a process group.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["after_forwards", "buffers_after_construction", "global_batch_norm",
           "local_batch", "syncbn_error"]


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


def local_batch(rank: int, batch_per_rank: int = 8, features: int = 4,
                shift: float = 3.0) -> torch.Tensor:
    """This rank's samples, the same on every call: each rank's data has another
    mean (`shift * rank`), as unshuffled shards of sorted data would."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(batch_per_rank, features, generator=g) + shift * rank


def after_forwards(*batches: torch.Tensor) -> torch.Tensor:
    """running_mean of a fresh BatchNorm1d after one training forward on each of
    `batches`, in order: what one process would hold (the lesson's reference)."""
    bn = nn.BatchNorm1d(batches[0].shape[1])
    for x in batches:
        bn(x)
    return bn.running_mean


def buffers_after_construction(rank: int) -> dict:
    """running_mean[0] right after DDP is built, each rank starting from its rank.

    `forward_sync_buffers=False` (torch 2.13) turns off the copy before every
    forward only: the copy of rank 0's buffers when DDP is built still runs.
    The deprecated `broadcast_buffers=False` turns off both. Keys: the
    arguments this torch accepts; values: running_mean[0], and what torch
    warned.
    """
    result = {}
    variants = {"broadcast_buffers=False": {"broadcast_buffers": False}}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        variants["forward_sync_buffers=False"] = {"forward_sync_buffers": False}
    for name, kwargs in variants.items():
        bn = nn.BatchNorm1d(4)
        bn.running_mean.fill_(float(rank))  # a different buffer on every rank
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = DDP(bn, **kwargs)
        result[name] = {"running_mean0": model.module.running_mean[0].item(),
                        "warnings": [str(w.message) for w in caught
                                     if issubclass(w.category, FutureWarning)]}
    return result


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
