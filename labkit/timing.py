"""Timing that a noisy machine can trust: warm up, synchronize, take medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch

__all__ = ["interleaved", "median_time", "sync", "timed"]

Name = TypeVar("Name", bound=Hashable)  # a candidate's key


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
    return statistics.median(timed(fn, device=device) for _ in range(repeat))


def timed(fn: Callable[[], object], repeat: int = 1,
          device: torch.device | str | None = None) -> float:
    """Seconds of one call of `fn`: the mean of `repeat` calls in a row.

    Calls in a row, with nothing between them, time steps as training runs
    them (no barrier inside); their mean is one step's time.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat


def interleaved(fns: Mapping[Name, Callable[[], object]], rounds: int = 5,
                warmup: int = 1, device: torch.device | str | None = None, *,
                before: Callable[[Name], object] | None = None,
                after: Callable[[Name], object] | None = None,
                repeat: Mapping[Name, int] | int = 1, clock: bool = True,
                ) -> dict[Name, list[float]]:
    """Seconds of each `fns[name]()` in every round, the candidates taking turns.

    On a shared machine the load changes from second to second; taking turns
    spreads it over every candidate alike, where timing one candidate after
    the other would hand one of them all of a busy moment. Compare medians.

    `warmup` rounds call each candidate once, untimed and not returned; then
    each of `rounds` rounds times every candidate once, in the order of `fns`.
    Around every call, outside the clock, `before(name)` runs first (a barrier,
    so that ranks start together; resetting a counter) and, in the timed
    rounds, `after(name)` runs last (reading what the call did). A sample of
    `name` is the mean of `repeat[name]` calls in a row (timed()). With
    `clock=False` each call returns its own seconds (a step that times itself,
    or one timed on the ranks), and those are the samples.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    counts = {name: repeat if isinstance(repeat, int) else repeat[name]
              for name in fns}
    for _ in range(warmup):
        for name, fn in fns.items():
            if before is not None:
                before(name)
            fn()
    times: dict[Name, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if before is not None:
                before(name)
            if clock:
                times[name].append(timed(fn, counts[name], device))
            else:
                times[name].append(float(fn()))
            if after is not None:
                after(name)
    return times
