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

__all__ = ["bn_experiment", "buffers_after_construction", "global_batch_norm",
           "syncbn_error"]


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


def _trained_bn(features: int, *batches: torch.Tensor) -> nn.BatchNorm1d:
    """A BatchNorm1d after one training forward on each of `batches`, in order."""
    bn = nn.BatchNorm1d(features)
    for x in batches:
        bn(x)
    return bn


def bn_experiment(rank: int, world_size: int, batch_per_rank: int = 8,
                  features: int = 4, shift: float = 3.0, steps: int = 2,
                  sync_buffers: bool = True) -> dict:
    """BatchNorm1d in DDP against BatchNorm in one process, on every rank.

    Each rank runs `steps` training forwards on its own batch, then one
    evaluation forward through DDP. References in one process: BatchNorm on
    the whole (all ranks') batch, on this rank's batch alone, and on rank 0's
    batch alone. The keys "trained" and "evaluated" are of DDP's default,
    buffer sync on; `sync_buffers=False` turns it off there too (a broken
    variant, to see the lesson's assertions fail).
    """
    x = _local_batch(rank, batch_per_rank, features, shift)
    every = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(every, x)
    whole = torch.cat(every)  # the global batch, as one process would see it

    on_whole = nn.BatchNorm1d(features)
    for _ in range(steps):
        out_whole = on_whole(whole)[rank * batch_per_rank:(rank + 1) * batch_per_rank]
    on_own = _trained_bn(features, *[x] * steps)
    on_rank0 = _trained_bn(features, *[every[0]] * steps)
    # Buffer sync copies rank 0's buffers BEFORE each forward, and the forward
    # then updates them with this rank's batch: after training a rank holds
    # rank 0's statistics of steps - 1 forwards, updated once with its own.
    rank0_then_own = _trained_bn(features, *[every[0]] * (steps - 1), x)

    running = {}
    for sync in (True, False):
        model = _ddp(nn.BatchNorm1d(features), sync and sync_buffers)
        for _ in range(steps):
            out = model(x)  # training mode: normalized with this rank's statistics
        running[sync] = model.module.running_mean.detach().clone()
        if sync:
            model.eval()
            with torch.no_grad():
                model(x)  # evaluation: DDP first copies rank 0's buffers, as always
            after_eval = model.module.running_mean.detach().clone()
    means = [torch.empty(features) for _ in range(world_size)]
    dist.all_gather(means, running[False])

    def diff(a, b):
        return (a.detach() - b.detach()).abs().max().item()

    return {
        "rank": rank,
        "local_mean": x.mean().item(),
        # Outputs: each replica normalizes with its own batch, not the whole one.
        "per_replica_vs_whole": diff(out, out_whole),
        # running_mean[0] on this rank, for printing: sync on after training,
        # after an evaluation forward, and sync off.
        "running_mean0": {"trained": running[True][0].item(),
                          "evaluated": after_eval[0].item(),
                          "no_sync": running[False][0].item()},
        "own_data_mean0": on_own.running_mean[0].item(),
        "rank0_data_mean0": on_rank0.running_mean[0].item(),
        # Sync on, after the training forwards.
        "trained_vs_own_data": diff(running[True], on_own.running_mean),
        "trained_vs_rank0_then_own": diff(running[True], rank0_then_own.running_mean),
        # Sync on, after one more forward (evaluation): rank 0's data only.
        "evaluated_vs_rank0_data": diff(after_eval, on_rank0.running_mean),
        "evaluated_vs_whole": diff(after_eval, on_whole.running_mean),
        # Sync off: every rank keeps statistics of its own data.
        "no_sync_vs_own_data": diff(running[False], on_own.running_mean),
        "running_spread_no_sync": max(diff(m, means[0]) for m in means),
        "synced_vs_whole": diff(global_batch_norm(x), out_whole),
    }


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


def _ddp(module: nn.Module, sync_buffers: bool) -> DDP:
    """DDP that copies rank 0's buffers before each forward, or not.

    torch 2.13 replaced `broadcast_buffers` by `forward_sync_buffers` (the old
    name warns); older versions know only the old name. The two differ at
    construction (see buffers_after_construction); the modules built here
    start equal on every rank, so that makes no difference to them.
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
