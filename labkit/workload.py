"""The workload every DDP lesson trains: model, data, micro-batches, wrapping.

One `Config` says what to train: doc 004's model (or a wider one), the teacher
task, and K micro-batches of `batch_per_rank` samples on each rank per update.
`micro_batches` cuts one update's global batch the same way on every rank, and
`micro_batches(..., whole=True)` gives the single-process reference the whole
batch, so that an update can be compared with one step on all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import comm_counting, data, models

__all__ = [
    "Config",
    "device",
    "make_dataset",
    "make_model",
    "make_optimizer",
    "micro_batches",
    "uneven_micro_batches",
    "wrap",
]


@dataclass
class Config:
    """One DDP workload: model size, K micro-batches per update, data, timing."""

    accum_steps: int = 4
    steps: int = 10
    batch_per_rank: int = 16  # samples per rank in one micro-batch
    hidden: int = 100  # hidden=100, depth=1 is doc 004's model
    depth: int = 1
    lr: float = 0.05
    momentum: float = 0.0
    seed: int = 0
    # None: DDP's own default (not the same as 25: see lesson 05's buckets)
    bucket_cap_mb: float | None = None
    repeat: int = 5  # timed optimizer steps per mode

    def check(self) -> None:
        """Raise ValueError naming a bad setting (the launcher checks the ranks)."""
        for name in ("accum_steps", "steps", "batch_per_rank", "hidden", "depth",
                     "repeat"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")

def make_model(cfg: Config) -> nn.Module:
    """The same initial weights on every rank and in the single-process reference."""
    torch.manual_seed(cfg.seed)
    return models.WideMLP(hidden=cfg.hidden, depth=cfg.depth).to(device())

def device() -> torch.device:
    """This rank's GPU under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """SGD with the configured learning rate and momentum."""
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)

def make_dataset(cfg: Config) -> data.TeacherDataset:
    """The teacher task, on this rank's device."""
    dataset = data.TeacherDataset(n=4096, seed=cfg.seed)
    where = device()
    dataset.data, dataset.target = dataset.data.to(where), dataset.target.to(where)
    return dataset

def micro_batches(dataset, cfg: Config, step: int, rank: int, world_size: int,
                  whole: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s K micro-batches for optimizer step `step`.

    The global batch of one step is K x world_size x batch_per_rank samples;
    micro-batch i takes a slice of it and each rank takes its share of that.
    With `whole`, the single step's whole global batch (the reference).
    """
    per_micro = world_size * cfg.batch_per_rank
    size = cfg.accum_steps * per_micro
    idx = ((torch.arange(size) + step * size) % len(dataset)).to(dataset.data.device)
    X, y = dataset.data[idx], dataset.target[idx]
    if whole:
        return [(X, y)]
    out = []
    for i in range(cfg.accum_steps):
        part = slice(i * per_micro, (i + 1) * per_micro)
        out.append((data.shard(X[part], rank, world_size),
                    data.shard(y[part], rank, world_size)))
    return out

def uneven_micro_batches(dataset, sizes: Sequence[Sequence[int]], rank: int
                         ) -> tuple[list, tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s micro-batches of the given sizes, and the whole batch.

    `sizes[r]` lists rank r's micro-batch sizes; the whole batch is every
    rank's samples together, consecutive from the dataset's start.
    """
    if len(sizes) != dist.get_world_size():
        raise ValueError(f"sizes lists {len(sizes)} ranks, the group has "
                         f"{dist.get_world_size()}")
    if len({len(s) for s in sizes}) != 1 or min(min(s) for s in sizes) < 1:
        raise ValueError(f"every rank needs as many micro-batches, each of at least "
                         f"one sample: {sizes}")
    start = sum(sum(s) for s in sizes[:rank])
    out = []
    for n in sizes[rank]:
        out.append((dataset.data[start:start + n], dataset.target[start:start + n]))
        start += n
    total = sum(sum(s) for s in sizes)
    return out, (dataset.data[:total], dataset.target[:total])

def wrap(cfg: Config) -> tuple[DDP, comm_counting.CommCounter]:
    """A DDP model (same initial weights on every rank) with an all-reduce counter."""
    where = device()
    model = DDP(make_model(cfg), bucket_cap_mb=cfg.bucket_cap_mb,
                device_ids=[where] if where.type == "cuda" else None)
    return model, comm_counting.CommCounter().attach(model)
