"""Local SGD and DiLoCo's scaffolding: the task, each rank's batches, the divergence.

Lesson 15 writes local SGD and DiLoCo's outer step in its cells; this module
holds only what those cells share and do not teach: a small regression task
(labkit.data's teacher, an MLP from labkit.models), rank `rank`'s own batch at
each step, the loss on held-out samples, and how far the replicas have drifted
apart. Bytes sent are counted with labkit.comm_counting, not computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import compare, data, i18n, models

__all__ = ["Task", "batch", "divergence", "evaluate", "make_dataset", "make_model"]

i18n.register({
    "bytes_sent_per_rank": {"ja": "1 ランクが送ったバイト数",
                            "en": "bytes sent per rank"},
    "loss_vs_bytes": {"ja": "送ったバイト数に対する損失", "en": "Loss vs bytes sent"},
    "held_out_loss": {"ja": "検証データの損失 (MSE)", "en": "held-out loss (MSE)"},
})


@dataclass
class Task:
    """The task local SGD and DiLoCo train: the teacher's data, a small MLP."""

    hidden: int = 32
    batch_per_rank: int = 16
    n: int = 4096  # samples; the last `held_out` are never trained on
    held_out: int = 1024
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming a bad setting."""
        for name in ("hidden", "batch_per_rank", "n", "held_out"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.held_out >= self.n:
            raise ValueError(f"held_out ({self.held_out}) must be < n ({self.n})")


def make_dataset(task: Task) -> data.TeacherDataset:
    """The teacher task: the same samples on every rank."""
    task.check()
    return data.TeacherDataset(n=task.n, seed=task.seed)


def make_model(task: Task) -> nn.Module:
    """The same initial weights on every rank and in the kernel."""
    torch.manual_seed(task.seed)
    return models.WideMLP(10, task.hidden, 1, 10)


def batch(dataset: data.TeacherDataset, task: Task, step: int, rank: int,
          world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s own batch at step `step` (counted from 0).

    Step t's global batch is world_size x batch_per_rank consecutive training
    samples, cycling through them; each rank takes its contiguous share, as
    DDP's ranks would, so that every method sees the same samples per step.
    """
    per = task.batch_per_rank
    size = world_size * per
    train = task.n - task.held_out
    idx = (torch.arange(rank * per, (rank + 1) * per) + step * size) % train
    return dataset.data[idx], dataset.target[idx]


def evaluate(model: nn.Module, dataset: data.TeacherDataset, task: Task) -> float:
    """Mean squared error on the held-out samples (never trained on)."""
    with torch.no_grad():
        X = dataset.data[-task.held_out:]
        return models.MyLoss()(model(X), dataset.target[-task.held_out:]).item()


def divergence(model: nn.Module) -> float:
    """Largest L2 distance of a rank's parameters from the ranks' mean (collective)."""
    every = torch.stack(compare.gather_params(model)).double()
    return (every - every.mean(0)).norm(dim=1).max().item()
