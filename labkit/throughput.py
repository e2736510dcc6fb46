"""How fast a training step runs: seconds per step by width, samples per second
by batch size (lesson 07), on doc 004's WideMLP with SGD.

Every way of timing a step starts from timed_problem, so that one process,
DataParallel and DDP (labkit.dp_experiments), or two widths, are timed on the same
weights and data.
"""

from __future__ import annotations

import statistics

import torch

from . import i18n, models, timing

__all__ = ["samples_per_s", "step_times", "timed_problem"]

# Lesson 07's plots.
i18n.register({
    "batch_size": {"ja": "バッチサイズ", "en": "batch size"},
    "samples_per_s": {"ja": "1 秒あたりのサンプル数", "en": "samples per second"},
    "throughput_by_batch": {
        "ja": "バッチサイズごとの処理速度 (学習ステップ)",
        "en": "Training throughput by batch size",
    },
    "model_size_title": {  # lesson 07 times its widths at batch 1024
        "ja": "モデルの大きさと 1 ステップの時間 (バッチ 1024)",
        "en": "Model size and time per step (batch 1024)",
    },
})


def timed_problem(hidden: int, depth: int, batch_size: int):
    """The model, SGD optimizer and random batch that step timings share.

    The same seed every time, so every way of running a step (one process,
    DataParallel, DDP, another width) starts from the same weights and data.
    """
    torch.manual_seed(0)
    model = models.WideMLP(hidden=hidden, depth=depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = torch.randn(batch_size, 10), torch.randn(batch_size, 10)
    return model, optimizer, X, y


def _training_step(hidden: int, depth: int, batch_size: int):
    """One SGD training step of timed_problem's model, as a callable."""
    model, optimizer, X, y = timed_problem(hidden, depth, batch_size)
    criterion = models.MyLoss()

    def step():
        optimizer.zero_grad()
        criterion(model(X), y).backward()
        optimizer.step()

    return step


def step_times(widths, depth: int = 1, batch_size: int = 256, rounds: int = 7,
               steps: int = 10) -> dict[int, list[float]]:
    """Seconds per training step of a WideMLP of each width, in every round.

    The widths take turns, `steps` steps at a time, so that a shared
    machine's changing load falls on all of them alike.
    """
    step_fns = {w: _training_step(w, depth, batch_size) for w in widths}

    def run(step):
        for _ in range(steps):
            step()

    times = timing.interleaved({w: (lambda s=s: run(s)) for w, s in step_fns.items()},
                               rounds=rounds, warmup=1)
    return {w: [t / steps for t in ts] for w, ts in times.items()}


def samples_per_s(batch_sizes, hidden: int = 100, depth: int = 1,
                  repeat: int = 7, steps: int = 10) -> dict[int, float]:
    """Training samples per second at each batch size: the median of `repeat`
    rounds, each the mean of `steps` steps in a row.

    The batch sizes take turns in every round (timing.interleaved): timed one
    after the other, a busy moment of a shared machine would land on one
    batch size alone and could turn the curve over.
    """
    step_fns = {b: _training_step(hidden, depth, b) for b in batch_sizes}
    times = timing.interleaved(step_fns, rounds=repeat, warmup=2, repeat=steps)
    return {b: b / statistics.median(times[b]) for b in batch_sizes}
