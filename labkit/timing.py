"""Timing that a noisy machine can trust: warm up, synchronize, take medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["interleaved", "median_time", "sync"]


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


def interleaved(fns: dict[str, Callable[[], object]], rounds: int = 5,
                warmup: int = 1, device: torch.device | str | None = None,
                ) -> dict[str, list[float]]:
    """Seconds of each `fns[name]()` in every round, the candidates taking turns.

    On a shared machine the load changes from second to second; taking turns
    spreads it over every candidate alike, where timing one candidate after
    the other would hand one of them all of a busy moment. Compare medians.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return times
