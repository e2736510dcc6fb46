"""DataParallel measured: its results against one device's, its time against DDP's.

labkit.data_parallel is the mechanism (scatter, replicate, parallel_apply,
gather); this module measures it. The steppers time one training step per
call (timing.timed), so that a lesson can interleave the ways it compares (one
device, DataParallel, DDP at world size 1 and 2) with
`timing.interleaved(..., clock=False)`: the slow moments of a shared machine
then fall on all of them alike.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from . import compare, i18n, models, throughput, timing
from .data_parallel import data_parallel

__all__ = ["ddp_stepper", "dp_experiment", "dp_stepper"]

i18n.register({
    # lesson 03's plot of step time by world size
    "step_time_vs_world": {
        "ja": "world size ごとの 1 ステップの時間 (全体バッチ 1024)",
        "en": "Step time by world size (global batch 1024)",
    },
    "one_device": {"ja": "1 デバイス", "en": "1 device"},
    "dp_threads": {"ja": "DP ×2\nスレッド", "en": "DP ×2\nthreads"},
    "ddp_processes": {"ja": "DDP ×2\nプロセス", "en": "DDP ×2\nprocesses"},
    "dp_vs_ddp_title": {
        "ja": "1 ステップの時間 (全体バッチ 1024): DataParallel (DP) と DDP",
        "en": "Time per step (global batch 1024): DataParallel (DP) vs DDP",
    },
})


def dp_experiment(devices: int = 2, batch: int = 100, seed: int = 0) -> dict:
    """data_parallel against one device: doc 004's corrected MLP and MyLoss.

    Runs torch's own on the GPUs when there are at least `devices` of them,
    otherwise the simulation on the CPU.
    """
    if devices < 1 or batch < 1:
        raise ValueError(f"devices and batch must be >= 1, got {devices} and {batch}")
    simulated = torch.cuda.device_count() < devices
    device = torch.device("cpu" if simulated else "cuda:0")
    torch.manual_seed(seed)
    model = models.MLP().to(device)
    reference = copy.deepcopy(model)  # the same weights, on one device
    X, y = torch.randn(batch, 10).to(device), torch.randn(batch, 10).to(device)
    criterion = models.MyLoss()

    ref_out = reference(X)
    ref_loss = criterion(ref_out, y)
    ref_loss.backward()
    out = data_parallel(model, X, list(range(devices)))
    loss = criterion(out, y)
    loss.backward()
    chunks = [len(c) for c in X.cpu().chunk(devices)]
    return {
        "devices": devices,
        "batch": batch,
        "seed": seed,
        "simulated": simulated,
        "chunk_sizes": chunks,
        "replicas_used": len(chunks),
        "output_max_abs_diff": compare.max_abs_diff(out, ref_out),
        "loss_abs_diff": abs(loss.item() - ref_loss.item()),
        "grad_max_abs_diff": compare.max_abs_diff(
            [p.grad for p in model.parameters()],
            [p.grad for p in reference.parameters()]),
    }


def dp_stepper(hidden: int, depth: int, global_batch: int, devices: int = 2,
               threads: int = 1) -> Callable[[], float]:
    """A function that runs one training step with data_parallel; returns its seconds.

    One device runs the plain model. `threads` sets torch's threads during
    the step (1: one core per simulated device, as one per DDP rank). The
    model is `step.model`, to count what a step does.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    model, optimizer, X, y = throughput.timed_problem(hidden, depth, global_batch)
    device_ids = list(range(devices))

    def run() -> None:
        optimizer.zero_grad()
        models.MyLoss()(data_parallel(model, X, device_ids), y).backward()
        optimizer.step()

    def step() -> float:
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return timing.timed(run)
        finally:
            torch.set_num_threads(saved)

    step.model = model  # the original: its forward hooks run in every replica
    return step


def ddp_stepper(hidden: int, depth: int, global_batch: int,
                group=None) -> Callable[[], float]:
    """On every rank of `group`: a function that runs one DDP training step.

    Each rank takes its shard of the global batch. A call waits for the other
    ranks of `group` (a barrier, not timed), then returns the step's seconds
    on this rank. Call it on every rank of `group`, as any collective. The DDP
    model is `step.model`, to count what a step does.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .data import shard

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    model, optimizer, X, y = throughput.timed_problem(hidden, depth, global_batch)
    model = DDP(model, process_group=group)
    X, y = shard(X, rank, size), shard(y, rank, size)

    def run() -> None:
        optimizer.zero_grad()
        models.MyLoss()(model(X), y).backward()
        optimizer.step()

    def step() -> float:
        dist.barrier(group=group)
        return timing.timed(run)

    step.model = model
    return step
