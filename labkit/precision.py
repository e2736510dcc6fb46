"""Mixed precision with torch.autocast: bfloat16 on CPUs, float16 with a
GradScaler on GPUs, and what became of Apex's amp and torch.cuda.amp.

A whole training run in bfloat16 is labkit.training's `precision="bfloat16"`;
lesson 07 writes the float16 step with its GradScaler out in a cell.
"""

from __future__ import annotations

import warnings

import torch

from . import i18n

__all__ = [
    "autocast_dtypes",
    "cuda_amp_warnings",
]

i18n.register({
    "precision_title": {
        "ja": "float32 と bfloat16 (autocast) の学習曲線",
        "en": "Loss curves: float32 and bfloat16 (autocast)",
    },
    "precision_time_title": {
        "ja": "1 ステップの時間: float32 と bfloat16 autocast",
        "en": "Time per step: float32 and bfloat16 autocast",
    },
    "no_cuda_skip": {
        "ja": "CUDA がないので、このセルは何もしません ({what})",
        "en": "No CUDA here, so this cell does nothing ({what})",
    },
})


def autocast_dtypes(model: torch.nn.Module, X: torch.Tensor,
                    device_type: str = "cpu",
                    dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.dtype]:
    """What autocast changes: dtypes of the output, the weights and the gradients."""
    model.zero_grad()
    with torch.autocast(device_type, dtype=dtype):
        out = model(X)
    # The loss is computed outside autocast, in float32, as PyTorch recommends.
    out.float().pow(2).mean().backward()
    first = next(model.parameters())
    return {"output": out.dtype, "weight": first.dtype, "grad": first.grad.dtype}


def cuda_amp_warnings() -> list[str]:
    """What torch says when the old torch.cuda.amp names are used."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.amp.GradScaler()
        with torch.cuda.amp.autocast():
            pass
    return [f"{w.category.__name__}: {w.message}" for w in caught]
