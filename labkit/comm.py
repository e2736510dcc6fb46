"""What communication costs: all-reduce sweeps, the alpha-beta model, DDP steps.

The alpha-beta model says one all-reduce of S bytes over n ranks takes
alpha + f(n) * S / beta: alpha is the fixed cost of a message, beta the
bandwidth, and f(n) = 2(n-1)/n the share of the data each rank sends and
receives in a ring all-reduce. Bus bandwidth, as nccl-tests reports it, is
S / t * f(n): comparable across world sizes and with a link's speed.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from . import ddp, models, nosync

__all__ = [
    "LINKS",
    "AlphaBeta",
    "StepModel",
    "allreduce_sweep",
    "bandwidths",
    "bucket_sizes",
    "bucket_timeline",
    "fit_alpha_beta",
    "fit_step_model",
    "max_rel_error",
    "predicted_speedup",
    "step_times_by_k",
    "ring_factor",
]


def ring_factor(world_size: int) -> float:
    """Share of the data each rank sends (and receives) in a ring all-reduce."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2 * (world_size - 1) / world_size


def allreduce_sweep(sizes: Sequence[int], repeat: int = 10) -> list[float]:
    """Median seconds of one all-reduce per message size in bytes (collective)."""
    return [ddp.allreduce_time(max(1, nbytes // 4), repeat) for nbytes in sizes]


def bandwidths(nbytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in bytes per second, as nccl-tests."""
    algbw = nbytes / seconds
    return algbw, algbw * ring_factor(world_size)


@dataclass
class AlphaBeta:
    """time = alpha + ring_factor(n) * bytes / beta."""

    alpha: float  # seconds
    beta: float  # bytes per second

    def time(self, nbytes: float, world_size: int) -> float:
        if world_size == 1:
            return 0.0
        return self.alpha + ring_factor(world_size) * nbytes / self.beta


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float],
                   world_size: int) -> AlphaBeta:
    """Least squares on relative error, so small and large messages both count."""
    if world_size < 2:
        raise ValueError("fitting needs at least 2 ranks")
    x = torch.tensor([ring_factor(world_size) * s for s in sizes], dtype=torch.float64)
    t = torch.tensor(list(seconds), dtype=torch.float64)
    # Minimize sum(((alpha + x / beta) - t) / t)^2: linear in (alpha, 1/beta).
    A = torch.stack([1 / t, x / t], dim=1)
    sol = torch.linalg.lstsq(A, torch.ones_like(t).unsqueeze(1)).solution.squeeze(1)
    alpha, inv_beta = sol.tolist()
    if inv_beta <= 0:
        raise ValueError("the times do not grow with the size: no bandwidth to fit")
    return AlphaBeta(max(alpha, 0.0), 1 / inv_beta)


def bucket_sizes(model: torch.nn.Module, bucket_cap_mb: float = 25.0) -> list[int]:
    """Bytes per DDP bucket: gradients in reverse order, a bucket closed once full.

    As torch's _compute_bucket_assignment_by_size: a gradient joins the open
    bucket, and the bucket closes when it reaches the cap, so a bucket can
    exceed the cap by its last gradient. (All parameters here are float32 on
    one device, and gradients become ready in reverse order.)
    """
    cap = bucket_cap_mb * 1024 * 1024
    sizes, current = [], 0
    for p in reversed(list(model.parameters())):
        current += p.numel() * p.element_size()
        if current >= cap:
            sizes.append(current)
            current = 0
    if current:
        sizes.append(current)
    return sizes


@dataclass
class StepModel:
    """Time of one optimizer step of K micro-batches, from measured parts."""

    compute_s: float  # forward + backward of one micro-batch, no communication
    sync_s: float  # what one synchronization adds (all-reduce and DDP's own work)
    optimizer_s: float  # optimizer.step() and the rest of a step

    def predict(self, K: int, no_sync: bool) -> float:
        syncs = 1 if no_sync else K
        return K * self.compute_s + syncs * self.sync_s + self.optimizer_s

    def as_dict(self) -> dict:
        return asdict(self)


def fit_step_model(times: dict[int, tuple[float, float]],
                   fit_on: Sequence[int] = (1, 2, 4)) -> StepModel:
    """Fit compute, sync and optimizer time on the measured step times of `fit_on`.

    `times` maps K to (seconds with every micro-batch synchronized, seconds
    with no_sync). Each is linear in the parts: sync mode K*compute + K*sync +
    optimizer, no_sync mode K*compute + sync + optimizer. Fitting on small K
    and checking on large K tests the model on steps it has not seen.

    Each part is a time, so none may be negative: of the fits that leave
    out some parts (set to 0) and have no negative part, the one with the
    smallest error is kept (non-negative least squares, by trying every
    subset of the three parts). A free fit can make o negative when the first
    micro-batch costs less than the others (its backward writes the
    gradients; the later ones add to them).
    """
    rows, t = [], []
    for k in fit_on:
        sync_s, nosync_s = times[k]
        rows += [[k, k, 1.0], [k, 1.0, 1.0]]
        t += [sync_s, nosync_s]
    y = torch.tensor(t, dtype=torch.float64).unsqueeze(1)
    # Relative least squares: a 2 ms and a 200 ms step weigh the same.
    A = torch.tensor(rows, dtype=torch.float64) / y
    best, best_residual = [0.0, 0.0, 0.0], math.inf
    for parts in itertools.chain.from_iterable(
            itertools.combinations(range(3), n) for n in (3, 2, 1)):
        sol = torch.linalg.lstsq(A[:, list(parts)], torch.ones_like(y)).solution
        if (sol < 0).any():
            continue
        residual = (A[:, list(parts)] @ sol - 1).square().sum().item()
        if residual < best_residual:
            best, best_residual = [0.0, 0.0, 0.0], residual
            for part, value in zip(parts, sol.squeeze(1).tolist(), strict=True):
                best[part] = value
    return StepModel(*best)


def max_rel_error(model: StepModel, times: dict[int, tuple[float, float]]) -> float:
    """Worst |predicted - measured| / measured over every K and both modes."""
    errors = []
    for k, (sync_s, nosync_s) in times.items():
        errors.append(abs(model.predict(k, False) - sync_s) / sync_s)
        errors.append(abs(model.predict(k, True) - nosync_s) / nosync_s)
    return max(errors)


def step_times_by_k(rank: int, world_size: int, hidden: int, depth: int,
                    ks: Sequence[int] = (1, 2, 4, 8), repeat: int = 5,
                    bucket_cap_mb: float = 25.0) -> dict[int, tuple[float, float]]:
    """Measured (sync, no_sync) seconds of one optimizer step for each K.

    One model for every K, timed in turn over `repeat` rounds
    (nosync.interleaved_step_times).
    """
    cfg = nosync.NoSyncConfig(accum_steps=max(ks), hidden=hidden, depth=depth,
                              repeat=repeat, bucket_cap_mb=bucket_cap_mb)
    cfg.check(world_size)
    model, _ = nosync.wrap(cfg)
    batches = nosync.micro_batches(nosync.make_dataset(cfg), cfg, 1, rank, world_size)
    return nosync.interleaved_step_times(model, nosync.make_optimizer(model, cfg),
                                         batches, ks, repeat)


def _first_micro_batch(cfg: nosync.NoSyncConfig, rank: int, world_size: int):
    return nosync.micro_batches(nosync.make_dataset(cfg), cfg, 0, rank, world_size)[0]


def bucket_timeline(rank: int, world_size: int, cfg: nosync.NoSyncConfig) -> dict:
    """When each bucket's all-reduce starts and ends, against the backward pass.

    Seconds from the start of backward; an all-reduce that starts before the
    backward ends overlaps with it.
    """
    model = DDP(nosync.make_model(cfg), bucket_cap_mb=cfg.bucket_cap_mb)
    events: list[list[float]] = []
    t0 = [0.0]

    def hook(state, bucket):
        start = time.perf_counter() - t0[0]
        fut = default_hooks.allreduce_hook(None, bucket)

        def done(f):
            events.append([start, time.perf_counter() - t0[0]])
            return f.value()[0]

        return fut.then(done)

    model.register_comm_hook(None, hook)
    X, y = _first_micro_batch(cfg, rank, world_size)
    criterion = models.MyLoss()
    for _ in range(2):  # the second pass runs with DDP's rebuilt buckets
        events.clear()
        loss = criterion(model(X), y)
        dist.barrier()
        t0[0] = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter() - t0[0]
    return {"events": sorted(events), "backward_end": backward_end}


# Nominal one-direction link bandwidths in bytes/s, from the vendors' published
# figures, for extrapolation only: they are not measured here.
LINKS = {
    "PCIe 4.0 x16": 32e9,
    "InfiniBand NDR (400 Gb/s)": 50e9,
    "NVLink 4 (H100 SXM, 900 GB/s both ways)": 450e9,
}


def predicted_speedup(world_size: int, K: int, no_sync: bool, params: int,
                      compute_s: float, ab: AlphaBeta, overhead_s: float = 0.0,
                      bucket_cap_mb: float = 25.0) -> float:
    """Samples per second on `world_size` ranks over one rank, by the model.

    Each rank computes K micro-batches of its own (compute_s each); every
    synchronization all-reduces the gradients (float32) bucket by bucket,
    plus DDP's own `overhead_s`. One rank needs no communication at all.
    """
    nbytes = 4 * params
    cap = bucket_cap_mb * 1024 * 1024
    buckets = [cap] * int(nbytes // cap) + ([nbytes % cap] if nbytes % cap else [])
    sync_s = sum(ab.time(b, world_size) for b in buckets) + (
        overhead_s if world_size > 1 else 0.0)
    step = StepModel(compute_s, sync_s, 0.0).predict(K, no_sync)
    return world_size * K * compute_s / step
