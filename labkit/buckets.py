"""DDP's gradient buckets: what each all-reduce carries, and when it runs.

DDP all-reduces gradients in buckets of about `bucket_cap_mb`, each as soon as
all of its gradients are computed, so communication overlaps the rest of the
backward pass. A BucketLog (a comm hook) records the bytes of every bucket; a
Timeline records when each bucket's all-reduce starts and ends against the end
of the gradient computation. The first step runs one bucket with every
gradient: DDP then rebuilds its buckets in the order the gradients arrived.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from . import i18n, models, workload

__all__ = ["BucketLog", "Timeline", "bucket_timeline", "check_buckets_rebuilt",
           "check_overlap", "split_at"]

# Lesson 05's plot of the overlap.
i18n.register({
    "overlap_title": {
        "ja": "勾配の計算とバケットの all-reduce",
        "en": "Gradient computation and the buckets' all-reduces",
    },
})


class BucketLog:
    """A DDP comm hook that records the bytes of every bucket, step by step.

    It all-reduces as DDP's default does (sum, then divide by the world size),
    so training is unchanged. Call `step()` before each step's backward.
    """

    def __init__(self):
        self.steps: list[list[int]] = []

    def attach(self, model: DDP) -> BucketLog:
        model.register_comm_hook(self, BucketLog._hook)
        return self

    def step(self) -> None:
        self.steps.append([])

    @staticmethod
    def _hook(log, bucket):  # unannotated: DDP rejects string annotations
        if not log.steps:
            raise RuntimeError("BucketLog.step() must be called before the backward")
        buffer = bucket.buffer()
        log.steps[-1].append(buffer.numel() * buffer.element_size())
        return default_hooks.allreduce_hook(None, bucket)

def check_buckets_rebuilt(steps: Sequence[Sequence[int]], param_bytes: int) -> None:
    """Assert what a BucketLog saw of DDP(model): one bucket, then a rebuilt split.

    Step 1 all-reduces every gradient in one bucket; from step 2 on, the
    buckets DDP rebuilt in the order the gradients arrived: more than one,
    the same in every later step, each step's sizes summing to `param_bytes`.
    """
    if len(steps) < 3:
        raise ValueError(f"need at least 3 logged steps, got {len(steps)}")
    for i, sizes in enumerate(steps, start=1):
        if sum(sizes) != param_bytes:
            raise AssertionError(f"step {i}: buckets {list(sizes)} sum to "
                                 f"{sum(sizes)} bytes, not {param_bytes}")
    if len(steps[0]) != 1:
        raise AssertionError(f"step 1 sent {len(steps[0])} buckets, expected one")
    if len(steps[1]) < 2 or any(list(s) != list(steps[1]) for s in steps[2:]):
        raise AssertionError(f"no rebuild into several fixed buckets after step 1: "
                             f"{[list(s) for s in steps]}")

def _first_micro_batch(cfg: workload.Config, rank: int, world_size: int):
    dataset = workload.make_dataset(cfg)
    return workload.micro_batches(dataset, cfg, 0, rank, world_size)[0]

def split_at(spans: Sequence[tuple[float, float]], t: float) -> tuple[float, float]:
    """Seconds of the union of `spans` before `t` and after it.

    Spans may overlap (gloo runs two all-reduces at a time): each second
    counts once.
    """
    if not math.isfinite(t):
        raise ValueError(f"t must be a finite time, got {t}")
    before = after = 0.0
    reach = -math.inf  # the end of the union so far
    for start, end in sorted(spans):
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"a span must end after it starts, got ({start}, {end})")
        start = max(start, reach)
        if end <= start:
            continue
        before += max(0.0, min(end, t) - start)
        after += max(0.0, end - max(start, t))
        reach = end
    return before, after

class Timeline:
    """When each all-reduce runs, against the end of the gradient computation.

    A post-accumulate-grad hook on every parameter stamps the time its
    gradient is complete; the last stamp of a step is the end of the gradient
    computation. `loss.backward()` returns later: DDP waits there for every
    bucket's all-reduce. A comm hook all-reduces through `allreduce`, which
    stamps when each all-reduce is handed to the process group and when it
    completes (one may queue behind another: the union of the spans is the
    time some communication was under way). Times are seconds from the
    start of the step's backward. `comm_hook(timeline, bucket)` is the DDP
    comm hook to register: lesson 05 writes it out.
    """

    def __init__(self, model: DDP, comm_hook: Callable):
        self.steps: list[dict] = []
        self._t0 = 0.0
        self._world_size = dist.get_world_size()
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_done)
        model.register_comm_hook(self, comm_hook)

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _grad_done(self, param) -> None:
        self.steps[-1]["grad_end"] = self._now()

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """DDP's default all-reduce (sum, then mean), stamped at start and end."""
        span = [self._now(), math.nan]
        self.steps[-1]["events"].append(span)
        tensor.div_(self._world_size)
        fut = dist.all_reduce(tensor, async_op=True).get_future()

        def done(f):
            span[1] = self._now()
            return f.value()[0]

        return fut.then(done)

    def backward(self, loss: torch.Tensor) -> dict:
        """Run one step's backward on every rank at once and return its record."""
        dist.barrier()  # the ranks start together, so waits are not counted
        self.steps.append({"events": [], "grad_end": math.nan})
        self._t0 = time.perf_counter()
        loss.backward()
        step = self.steps[-1]
        step["backward_end"] = self._now()
        step["events"] = sorted(tuple(span) for span in step["events"])
        step["hidden_s"], step["exposed_s"] = split_at(step["events"], step["grad_end"])
        return step

def bucket_timeline(rank: int, world_size: int, cfg: workload.Config,
                    comm_hook: Callable, steps: int = 4) -> list[dict]:
    """`steps` records of Timeline on the first micro-batch, one per backward.

    DDP rebuilds its buckets after the first step, so later steps show the
    buckets a training run uses. `comm_hook(timeline, bucket)` is DDP's comm
    hook; it all-reduces the bucket through `timeline.allreduce`, which stamps
    the times, and returns that future.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model = DDP(workload.make_model(cfg), bucket_cap_mb=cfg.bucket_cap_mb)
    timeline = Timeline(model, comm_hook)
    X, y = _first_micro_batch(cfg, rank, world_size)
    criterion = models.MyLoss()
    for _ in range(steps):
        model.zero_grad()
        timeline.backward(criterion(model(X), y))
    return timeline.steps

def check_overlap(steps: Sequence[dict], skip: int = 1) -> None:
    """Assert that every step after the first `skip` hid some communication.

    Hidden means an all-reduce ran before the last gradient was computed.
    DDP's first step runs one bucket, after every gradient: skip it.
    """
    if skip < 0 or len(steps) <= skip:
        raise ValueError(f"{len(steps)} step(s) recorded: need more than skip={skip}")
    for i, step in enumerate(steps[skip:], start=skip + 1):
        if not step["hidden_s"] > 0:
            raise AssertionError(
                f"step {i}: no communication ran before the last gradient "
                f"({len(step['events'])} all-reduce(s), the first starting at "
                f"{step['events'][0][0] * 1e3:.2f} ms, gradients done at "
                f"{step['grad_end'] * 1e3:.2f} ms): nothing overlapped")
