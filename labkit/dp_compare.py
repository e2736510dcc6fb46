"""DataParallel measured: against one device for correctness, and for time.

Kept apart from labkit.data_parallel, which holds the four steps themselves.
"""

from __future__ import annotations

import copy

import torch

from . import checks, i18n, models, timing
from .data_parallel import data_parallel

__all__ = ["dp_experiment", "step_time"]

i18n.register({
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
        "output_max_abs_diff": checks.max_abs_diff(out, ref_out),
        "loss_abs_diff": abs(loss.item() - ref_loss.item()),
        "grad_max_abs_diff": checks.max_abs_diff(
            [p.grad for p in model.parameters()],
            [p.grad for p in reference.parameters()]),
    }


def step_time(hidden: int, depth: int, global_batch: int, devices: int = 2,
              repeat: int = 5, threads: int | None = 1) -> float:
    """Median seconds of one training step with data_parallel over `devices`.

    One device runs the plain model. `threads` sets torch's threads per replica
    (1: one core per simulated device, as one per DDP rank); None leaves it.
    """
    torch.manual_seed(0)
    model = models.WideMLP(hidden=hidden, depth=depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = torch.randn(global_batch, 10), torch.randn(global_batch, 10)
    device_ids = list(range(devices))

    def step():
        optimizer.zero_grad()
        models.MyLoss()(data_parallel(model, X, device_ids), y).backward()
        optimizer.step()

    saved = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        return timing.median_time(step, repeat=repeat, warmup=2)
    finally:
        torch.set_num_threads(saved)
