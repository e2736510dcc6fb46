"""Gradient accumulation with DDP's no_sync, and what an accumulated update costs.

Every function taking `rank, world_size` runs on each rank of an initialized
process group: on the notebook's engines, under torchrun, or under
`python -m labkit nosync`, which all call the same code.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import compare, i18n, models, timing, workload

__all__ = [
    "SyncPair",
    "accumulate_by_count",
    "accumulate_no_sync",
    "accumulated_and_whole_grads",
    "convergence",
    "counted_update",
    "interleaved_step_samples",
    "interleaved_step_times",
    "step_times",
    "update_costs",
]

# Lesson 04's plots.
i18n.register({
    "accum_k": {"ja": "K (1 ステップのマイクロバッチ数)",
                "en": "K (micro-batches per step)"},
    "step_time_vs_k": {
        "ja": "K ごとの 1 回の更新の時間 (2 ランク)",
        "en": "Time per update by K (2 ranks)",
    },
    "param_diff": {"ja": "ランク間のパラメータの最大差",
                   "en": "max parameter difference between ranks"},
    "misuse_then_sync": {
        "ja": "1〜15: no_sync の中で step、16〜30: 正しく同期",
        "en": "1-15: step inside no_sync, 16-30: synchronized",
    },
    "divergence_title": {
        "ja": "no_sync の中で step するとレプリカがずれる",
        "en": "Stepping inside no_sync: replicas drift apart",
    },
})


class SyncPair(NamedTuple):
    """One measure of an update, synchronizing every micro-batch and with no_sync."""

    sync: object
    no_sync: object


def accumulate_no_sync(model: DDP, criterion, batches, use_no_sync: bool = True,
                       scale: bool = True) -> float:
    """Backward over K micro-batches; all-reduce only on the last one.

    Forward *and* backward of the first K-1 micro-batches run inside
    `no_sync()`: DDP decides in the forward pass whether the backward will
    synchronize. Each loss is divided by K so the summed gradient is the mean
    over the large batch. The caller zeroes gradients before and steps after.
    Returns the mean loss over the micro-batches.
    """
    K = len(batches)
    total = 0.0
    for i, (X, y) in enumerate(batches):
        last = i == K - 1
        with model.no_sync() if (use_no_sync and not last) else nullcontext():
            loss = criterion(model(X), y)
            (loss / K if scale else loss).backward()
        total += loss.item()
    return total / K

def accumulate_by_count(model: DDP, criterion, batches) -> float:
    """Like accumulate_no_sync, exact for micro-batches of any sizes.

    A per-sample mean loss divided by K weighs every micro-batch alike, so a
    short one counts more per sample than it should. Weighting each loss by
    its sample count over the global count N (summed over the ranks) gives
    every sample the same weight, 1 / N; the factor world_size undoes DDP's
    averaging over the ranks. Besides DDP's all-reduce it all-reduces two
    numbers: the count before the first backward, the loss for the report.
    Returns the large batch's mean loss.
    """
    world_size = dist.get_world_size()
    count = torch.tensor([float(sum(len(X) for X, _ in batches))],
                         device=batches[0][0].device)
    dist.all_reduce(count)  # N, the global number of samples of this update
    total = torch.zeros(1, device=count.device)
    for i, (X, y) in enumerate(batches):
        last = i == len(batches) - 1
        with nullcontext() if last else model.no_sync():
            loss = criterion(model(X), y)
            (loss * len(X) * world_size / count).backward()
        total += loss.detach() * len(X)
    dist.all_reduce(total)
    return (total / count).item()

def counted_update(cfg: workload.Config, criterion, batches, run
                   ) -> tuple[int, int, list[torch.Tensor]]:
    """What one update made by `run(model)` communicates, and its gradients.

    `run` gets a fresh DDP model of `cfg` whose buckets DDP has already rebuilt
    (one accumulation first, then zeroed), so the count is a steady update's:
    (all-reduce calls, bytes all-reduced, each parameter's gradient).
    """
    model, counter = workload.wrap(cfg)
    accumulate_no_sync(model, criterion, batches)  # warm-up: DDP rebuilds buckets
    model.zero_grad()
    counter.reset()
    run(model)
    return counter.calls, counter.bytes, compare.grads(model)


def accumulated_and_whole_grads(model: nn.Module, criterion, X: torch.Tensor,
                                y: torch.Tensor, K: int
                                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process: gradients of K equal micro-batches (loss / K) and of the batch.

    Nothing is synchronized here, so what differs is the arithmetic of
    accumulation alone, e.g. a layer that looks at its whole batch.
    """
    model.zero_grad()
    for Xi, yi in zip(X.chunk(K), y.chunk(K), strict=True):
        (criterion(model(Xi), yi) / K).backward()
    accumulated = compare.grads(model)
    model.zero_grad()
    criterion(model(X), y).backward()
    return accumulated, compare.grads(model)

def step_times(model: DDP, optimizer, dataset, cfg: workload.Config, rank: int,
               world_size: int) -> tuple[float, float]:
    """Seconds of one optimizer step of K micro-batches: (sync, no_sync)."""
    batches = workload.micro_batches(dataset, cfg, 1, rank, world_size)
    return interleaved_step_times(model, optimizer, batches, (cfg.accum_steps,),
                                  cfg.repeat)[cfg.accum_steps]

def interleaved_step_times(model: DDP, optimizer, batches: list, ks: Sequence[int],
                           rounds: int, block_s: float = 0.05
                           ) -> dict[int, SyncPair]:
    """Median seconds of one optimizer step for each K: (synced, no_sync).

    The medians of interleaved_step_samples.
    """
    samples = interleaved_step_samples(model, optimizer, batches, ks, rounds, block_s)
    return {k: SyncPair(statistics.median(samples[k].sync),
                        statistics.median(samples[k].no_sync))
            for k in ks}

def interleaved_step_samples(model: DDP, optimizer, batches: list, ks: Sequence[int],
                             rounds: int, block_s: float = 0.05
                             ) -> dict[int, SyncPair]:
    """Seconds of one optimizer step for each K and round: (synced, no_sync).

    A step of K takes the first K of `batches`. Steps are timed in blocks of
    consecutive steps lasting about `block_s`, with no barrier inside a block,
    as in training; a block's mean adds up as the step model of lesson 05 does.
    Each round times one block of every (K, mode) in turn, so the slow moments
    of a shared machine fall on all of them alike. Returned: each block's mean,
    one per round, which show the spread; interleaved_step_times keeps their
    medians.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if max(ks) > len(batches):
        raise ValueError(f"K = {max(ks)} needs {max(ks)} micro-batches, "
                         f"got {len(batches)}")
    criterion = models.MyLoss()
    modes = [(k, use_no_sync) for k in ks for use_no_sync in (False, True)]

    def update(k: int, use_no_sync: bool) -> None:
        optimizer.zero_grad()
        accumulate_no_sync(model, criterion, batches[:k], use_no_sync=use_no_sync)
        optimizer.step()

    updates = {mode: functools.partial(update, *mode) for mode in modes}
    turns = {"device": workload.device(), "warmup": 0,
             "before": lambda mode: dist.barrier()}  # start together, untimed
    # Warm-up, one update of each mode, its times dropped: DDP's first
    # iterations rebuild its buckets.
    timing.interleaved(updates, rounds=1, **turns)
    # Both modes of a K run as many steps per block as last about block_s
    # synchronized: a block's length (steps after one barrier) changes its
    # mean a little, so the two modes get the same. The slowest rank's step
    # sets it, so all ranks run the same steps (a synchronized step on one
    # rank alone would wait forever).
    first = timing.interleaved({k: updates[k, False] for k in ks}, rounds=1, **turns)
    slowest = torch.tensor([first[k][0] for k in ks], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    steps_of = {k: max(1, min(50, round(block_s / t)))
                for k, t in zip(ks, slowest.tolist(), strict=True)}
    times = timing.interleaved(updates, rounds, repeat={(k, m): steps_of[k]
                                                        for k, m in modes}, **turns)
    return {k: SyncPair(times[k, False], times[k, True]) for k in ks}

def update_costs(rank: int, world_size: int, cfg: workload.Config,
                 ks: Sequence[int] = (1, 2, 4, 8)) -> dict:
    """What one update of K micro-batches costs, synced and with no_sync, per K.

    "calls" and "bytes" (sync, no_sync) come from the counting hook on one
    update; "seconds" (sync rounds, no_sync rounds) from cfg.repeat
    interleaved rounds (interleaved_step_samples).
    """
    cfg = workload.Config(**{**asdict(cfg), "accum_steps": max(ks)})
    cfg.check()
    model, counter = workload.wrap(cfg)
    optimizer = workload.make_optimizer(model, cfg)
    criterion = models.MyLoss()
    dataset = workload.make_dataset(cfg)
    batches = workload.micro_batches(dataset, cfg, 1, rank, world_size)
    accumulate_no_sync(model, criterion, batches)  # warm-up: DDP rebuilds buckets
    calls, nbytes = {}, {}
    for k in ks:
        counted = []
        for use_no_sync in (False, True):
            model.zero_grad()
            counter.reset()
            accumulate_no_sync(model, criterion, batches[:k], use_no_sync=use_no_sync)
            counted.append((counter.calls, counter.bytes))
        calls[k] = SyncPair(counted[0][0], counted[1][0])
        nbytes[k] = SyncPair(counted[0][1], counted[1][1])
    seconds = interleaved_step_samples(model, optimizer, batches, ks, cfg.repeat)
    return {"params": models.count_params(model.module), "calls": calls,
            "bytes": nbytes, "seconds": seconds}

def convergence(rank: int, world_size: int, cfg: workload.Config,
                use_no_sync: bool) -> dict:
    """Loss and elapsed time after each optimizer step, with or without no_sync.

    Also the all-reduce calls and bytes of the last update (by then DDP has
    rebuilt its buckets).
    """
    cfg.check()
    dataset = workload.make_dataset(cfg)
    criterion = models.MyLoss()
    model, counter = workload.wrap(cfg)
    optimizer = workload.make_optimizer(model, cfg)
    losses, elapsed = [], []
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        counter.reset()  # keeps the last update's count
        optimizer.zero_grad()
        batches = workload.micro_batches(dataset, cfg, step, rank, world_size)
        loss = accumulate_no_sync(model, criterion, batches, use_no_sync=use_no_sync)
        optimizer.step()
        losses.append(loss)
        elapsed.append(time.perf_counter() - t0)
    return {"losses": losses, "elapsed_s": elapsed,
            "allreduce_calls_per_update": counter.calls,  # the last update's
            "allreduce_bytes_per_update": counter.bytes,
            "replica_max_param_diff": compare.replica_max_diff(model)}
