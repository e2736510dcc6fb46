"""Activation memory: what the backward pass keeps, and activation checkpointing.

The forward pass saves tensors (activations) for the backward pass. Activation
checkpointing (torch.utils.checkpoint) keeps only each segment's input and
recomputes the rest during backward: less memory, more compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import i18n, timing

__all__ = ["DeepMLP", "peak_memory_bytes", "saved_activation_bytes", "step_cost",
           "step_times", "step_work"]

i18n.register({
    "saved_mb": {"ja": "逆伝播のために保存した活性値 [MB]",
                 "en": "activations saved for backward [MB]"},
    "peak_mb": {"ja": "ピークメモリ [MB]", "en": "peak memory [MB]"},
    "ckpt_title": {
        "ja": "活性化チェックポイント: メモリと時間",
        "en": "Activation checkpointing: memory and time",
    },
    "ckpt_off": {"ja": "通常", "en": "plain"},
    "ckpt_on": {"ja": "チェックポイント", "en": "checkpointed"},
})


class DeepMLP(nn.Module):
    """`depth` blocks of Linear + ReLU, run as `segments` groups of blocks.

    With `checkpointed`, backward keeps only each segment's input and runs the
    segment's forward again to get the rest: about sqrt(depth) segments keep
    the least memory.
    """

    def __init__(self, width: int = 256, depth: int = 12, segments: int = 4,
                 checkpointed: bool = False):
        super().__init__()
        if min(width, depth, segments) < 1 or depth % segments:
            raise ValueError("width, depth and segments must be >= 1 and segments "
                             f"must divide depth, got {width}, {depth}, {segments}")
        per = depth // segments
        self.segments = nn.ModuleList(
            nn.Sequential(*[m for _ in range(per)
                            for m in (nn.Linear(width, width), nn.ReLU())])
            for _ in range(segments))
        self.checkpointed = checkpointed

    def forward(self, x):
        for segment in self.segments:
            if self.checkpointed and torch.is_grad_enabled():
                # use_reentrant=False is the variant PyTorch recommends.
                x = checkpoint(segment, x, use_reentrant=False)
            else:
                x = segment(x)
        return x


def saved_activation_bytes(model: nn.Module, X: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from a forward pass, parameters excluded.

    saved_tensors_hooks sees every tensor saved for backward; tensors sharing
    storage are counted once. Parameters are left out: they exist anyway.
    Under non-reentrant checkpointing, the checkpoint's own hooks take the
    tensors of each segment, so only what it really keeps is counted.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(X)
    del out
    return sum(seen.values())


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated while `fn()` runs, above what was allocated before.

    On a GPU, CUDA's own counter; on the CPU, torch.profiler with
    profile_memory=True: every operator's allocations minus frees, summed in
    time order, and the running maximum kept.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Each event's own allocations minus frees (children excluded), in time order.
    current = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += e.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def _step(model: nn.Module, X: torch.Tensor) -> None:
    """One forward and backward (the optimizer's update is the same either way)."""
    model.zero_grad(set_to_none=True)
    model(X).pow(2).mean().backward()


def step_cost(model: nn.Module, X: torch.Tensor) -> dict:
    """Saved activation bytes and peak bytes of one forward + backward."""
    model.zero_grad(set_to_none=True)  # gradients are not part of the peak below
    return {"saved_bytes": saved_activation_bytes(model, X),
            "peak_bytes": peak_memory_bytes(lambda: _step(model, X))}


def step_work(model: nn.Module, X: torch.Tensor) -> dict:
    """What one forward + backward computes: Linear forwards run, and FLOPs.

    The Linear forwards are counted by forward hooks, so a forward that
    checkpointing runs again during backward counts again. The FLOPs are
    torch's FlopCounterMode count (matrix products), backward included.
    """
    from torch.utils.flop_counter import FlopCounterMode

    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1))
             for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with FlopCounterMode(display=False) as counter:
            _step(model, X)
    finally:
        for hook in hooks:
            hook.remove()
    return {"linear_forwards": len(calls), "flops": counter.get_total_flops()}


def step_times(models: dict[str, nn.Module], X: torch.Tensor,
               rounds: int = 5) -> dict[str, list[float]]:
    """Seconds of one forward + backward of each model per round, taking turns."""
    return timing.interleaved({name: (lambda m=m: _step(m, X))
                               for name, m in models.items()}, rounds=rounds)
