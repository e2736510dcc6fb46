"""Mixed precision with torch.autocast: bfloat16 on CPUs, float16 with a
GradScaler on GPUs, and what became of Apex's amp and torch.cuda.amp.
"""

from __future__ import annotations

import time
import warnings

import torch

from . import i18n, models, timing

__all__ = [
    "autocast_dtypes",
    "cuda_amp_warnings",
    "float16_step",
    "train_precision",
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


def train_precision(precision: str, steps: int = 60, hidden: int = 512,
                    depth: int = 2, batch_size: int = 256, lr: float = 0.05,
                    seed: int = 0) -> dict:
    """Train the teacher task in "float32" or "bfloat16" (autocast); losses and times.

    The weights and the optimizer stay in float32 in both runs: autocast only
    runs eligible operations (matrix products) in the lower precision.
    """
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision must be 'float32' or 'bfloat16', got "
                         f"{precision!r}")
    from . import data

    dataset = data.TeacherDataset(n=4096, seed=seed)
    torch.manual_seed(seed)
    model = models.WideMLP(hidden=hidden, depth=depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    criterion = models.MyLoss()
    enabled = precision == "bfloat16"
    losses, step_s = [], []
    per_epoch = len(dataset) // batch_size
    for step in range(steps):
        i = step % per_epoch
        X = dataset.data[i * batch_size:(i + 1) * batch_size]
        y = dataset.target[i * batch_size:(i + 1) * batch_size]
        t0 = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            out = model(X)
        loss = criterion(out.float(), y)  # the loss in float32
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"precision": precision, "losses": losses, "step_s": step_s,
            "median_step_s": sorted(step_s[2:])[len(step_s[2:]) // 2]}


def float16_step(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor,
                 optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler) -> float:
    """One float16 mixed-precision step on a GPU, with loss scaling.

    float16 has a narrow range: small gradients underflow to zero. The scaler
    multiplies the loss before backward, divides the gradients before the
    step, and skips steps whose gradients overflowed.
    """
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(X)
    loss = models.MyLoss()(out.float(), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    timing.sync("cuda")
    return loss.item()


def cuda_amp_warnings() -> list[str]:
    """What torch says when the old torch.cuda.amp names are used."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.amp.GradScaler()
        with torch.cuda.amp.autocast():
            pass
    return [f"{w.category.__name__}: {w.message}" for w in caught]
