"""Timing that a noisy machine can trust: warm up, synchronize, take medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_time", "sync"]


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work, so the clock measures the work itself."""
    if torch.cuda.is_available() and (device is None or "cuda" in str(device)):
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1,
                device: torch.device | str | None = None) -> float:
    """Median seconds of `fn()` over `repeat` runs after `warmup` runs."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
