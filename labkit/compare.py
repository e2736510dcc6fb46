"""How far apart: tensors, two models' parameters or gradients, the ranks' replicas.

Every comparison in the course comes down to one number, the largest absolute
elementwise difference: 0.0 means bit-for-bit equal, and float32 rounding of
the same sum in another order stays under labkit.checks.GRAD_TOL.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["flat", "gather_params", "grads", "max_abs_diff", "rank_max_diff",
           "replica_max_diff"]


def max_abs_diff(a: Iterable[torch.Tensor] | torch.Tensor,
                 b: Iterable[torch.Tensor] | torch.Tensor) -> float:
    """Largest absolute elementwise difference between tensors (or lists of them)."""
    if isinstance(a, torch.Tensor):
        a, b = [a], [b]
    a, b = list(a), list(b)
    if len(a) != len(b):
        raise ValueError(f"different numbers of tensors: {len(a)} and {len(b)}")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            raise ValueError(f"shapes differ: {tuple(x.shape)} and {tuple(y.shape)}")
        if x.numel():
            # max() of floats keeps 0.0 over NaN (NaN compares false): a NaN
            # anywhere must come out as NaN, so that no check passes on it.
            worst = _nan_max(worst, (x.detach() - y.detach()).abs().max().item())
    return worst


def _nan_max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The tensors, detached, as one vector (e.g. all of a model's parameters)."""
    return torch.cat([x.detach().reshape(-1) for x in tensors])


def grads(model: nn.Module) -> list[torch.Tensor]:
    """A copy of each parameter's gradient; zeros where backward gave it none."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for p in model.parameters()]


def gather_params(model: nn.Module) -> list[torch.Tensor]:
    """Every rank's parameters as one flat vector each, in rank order (collective)."""
    x = flat(model.parameters())
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return out


def rank_max_diff(x: torch.Tensor) -> float:
    """Largest difference between any rank's `x` and rank 0's (collective)."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.detach().contiguous())
    return functools.reduce(_nan_max, ((o - out[0]).abs().max().item() for o in out))


def replica_max_diff(model: nn.Module) -> float:
    """Largest difference between any rank's parameters and rank 0's (collective)."""
    return rank_max_diff(flat(model.parameters()))
