"""DDP's gradient buckets: what each all-reduce carries, and when it runs.

DDP all-reduces gradients in buckets of about `bucket_cap_mb`, each as soon as
all of its gradients are computed, so communication overlaps the rest of the
backward pass. A comm_counting.CommCounter records the bytes of every bucket; a
Timeline records when each all-reduce starts and ends against the end of the
gradient computation. The first step runs one bucket with every
gradient: DDP then rebuilds its buckets in the order the gradients arrived.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import comm_counting, i18n, models, workload

__all__ = ["Timeline", "allreduce_hook", "bucket_timeline", "check_buckets_rebuilt",
           "check_by_cap", "check_overlap", "check_step", "split_at"]

# Lesson 05's plots of the overlap.
i18n.register({
    "overlap_title": {
        "ja": "勾配の計算とバケットの all-reduce",
        "en": "Gradient computation and the buckets' all-reduces",
    },
    "by_cap_title": {
        "ja": "同じステップ、bucket_cap_mb だけを変える",
        "en": "The same step, only bucket_cap_mb changes",
    },
    "cap_panel": {"ja": "{name}: all-reduce {n} 回", "en": "{name}: all-reduces {n}"},
    "ddp_step_title": {
        "ja": "DDP の 1 ステップ、ランクごと",
        "en": "One DDP step, rank by rank",
    },
    "rank_panel": {"ja": "ランク {rank}: all-reduce {n} 回",
                   "en": "rank {rank}: all-reduces {n}"},
})


def check_buckets_rebuilt(steps: Sequence[Sequence[int]], param_bytes: int) -> None:
    """Assert a per-step CommCounter's sizes of DDP(model): one bucket, then a split.

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

    Between `step()` and `end_step()` a comm_counting.CollectiveLog records
    every `dist.all_reduce` of this process: when it was handed to the process
    group, completed and was waited for (one may queue behind another: the
    union of the spans is the time some communication was under way). A
    post-accumulate-grad hook on every parameter stamps when its gradient is
    written; the last stamp of a step is the end of the gradient computation.
    DDP's `loss.backward()` returns later: it waits there for every bucket's
    all-reduce. Times are seconds from the step's start.

    Each step's record holds "calls" (CollectiveLog's), "grad_times" and
    "grad_names" (each gradient as written, and its parameter's name),
    "grad_end", "end", "backward_end" (when `loss.backward()` returned: the end,
    unless `train_step` ran the optimizer after it; what plots.timeline marks),
    "events" (the calls' spans, sorted), and "hidden_s" and "exposed_s" (the
    seconds of communication before and after grad_end). `comm_hook`, if given,
    is registered on the DDP `model` with the timeline as its state:
    `comm_hook(timeline, bucket)`, which lesson 05 writes out, all-reduces
    through `timeline.allreduce`. The gradient hooks go on after the model's
    own, so make the timeline after the model; `with` removes them at the end.
    """

    def __init__(self, model: nn.Module, comm_hook: Callable | None = None):
        self.steps: list[dict] = []
        self._log = comm_counting.CollectiveLog(("all_reduce",))
        self._open = False
        self._world_size = dist.get_world_size()
        inner = model.module if isinstance(model, DDP) else model
        self._names = {p: name for name, p in inner.named_parameters()}
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_done)
                         for p in inner.parameters() if p.requires_grad]
        if comm_hook is not None:
            model.register_comm_hook(self, comm_hook)

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc) -> None:
        if self._open:
            self._log.__exit__()
            self._open = False
        for handle in self._handles:
            handle.remove()

    def _grad_done(self, param) -> None:
        if self._open:
            now = self._log.now()
            self.steps[-1]["grad_end"] = now
            self.steps[-1]["grad_times"].append(now)
            self.steps[-1]["grad_names"].append(self._names[param])

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """DDP's default all-reduce (sum, then mean), for a comm hook to return."""
        tensor.div_(self._world_size)
        fut = dist.all_reduce(tensor, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def step(self) -> None:
        """Start a step: the times that follow count from now."""
        if self._open:
            raise RuntimeError("end_step() must end the step before the next starts")
        self._log.reset()
        self.steps.append({"calls": self._log.calls, "grad_times": [],
                           "grad_names": [], "grad_end": math.nan, "end": math.nan})
        self._open = True
        self._log.__enter__()

    def end_step(self) -> dict:
        """End the step once its gradients are synchronized; return its record."""
        step = self.steps[-1]
        step["end"] = self._log.now()
        self._log.__exit__()
        self._open = False
        for call in step["calls"]:  # every all-reduce is complete by now
            if math.isnan(call["end"]):
                call["end"] = step["end"]
        step["events"] = sorted((c["start"], c["end"]) for c in step["calls"])
        step.setdefault("backward_end", step["end"])
        step["hidden_s"], step["exposed_s"] = split_at(step["events"], step["grad_end"])
        return step

    def backward(self, loss: torch.Tensor) -> dict:
        """Run one step's backward on every rank at once and return its record."""
        dist.barrier()  # the ranks start together, so waits are not counted
        self.step()
        loss.backward()
        return self.end_step()

    def train_step(self, model: nn.Module, X: torch.Tensor, y: torch.Tensor,
                   criterion: Callable, optimizer: torch.optim.Optimizer) -> dict:
        """One whole training step on every rank at once, its record returned:
        also "forward_end" (the loss computed) and "backward_end" (when
        `loss.backward()` returned), the optimizer's step running until "end"."""
        optimizer.zero_grad()
        dist.barrier()
        self.step()
        loss = criterion(model(X), y)
        self.steps[-1]["forward_end"] = self._log.now()
        loss.backward()
        self.steps[-1]["backward_end"] = self._log.now()
        optimizer.step()
        return self.end_step()

def allreduce_hook(timeline: Timeline, bucket):
    """DDP's default comm hook (all-reduce, then the mean), through `timeline`, so
    that each bucket's all-reduce is stamped: `Timeline(model, allreduce_hook)`.
    (No return annotation: DDP refuses any but the exact Future[Tensor], which a
    postponed annotation is not.)"""
    return timeline.allreduce(bucket.buffer())


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
    X, y = _first_micro_batch(cfg, rank, world_size)
    criterion = models.MyLoss()
    with Timeline(model, comm_hook) as timeline:
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

def check_step(per_rank: Sequence[dict]) -> None:
    """Assert what one DDP training step shows on every rank (Timeline.train_step).

    On each rank the forward ends before the first gradient is written; every
    all-reduce starts after the forward and has completed when `loss.backward()`
    returns (DDP waits there, so the optimizer steps on averaged gradients); at
    least one starts before the last gradient (communication overlaps the
    backward); and every rank makes the same number of all-reduces, more than one.
    """
    if not per_rank:
        raise ValueError("no rank's record to check")
    counts = [len(step["events"]) for step in per_rank]
    if len(set(counts)) != 1 or counts[0] < 2:
        raise AssertionError(f"all-reduces per rank {counts}: expected the same "
                             f"number on every rank, more than one bucket")
    for rank, step in enumerate(per_rank):
        forward, returned = step["forward_end"], step["backward_end"]
        first = min(step["grad_times"])
        if not forward <= first:
            raise AssertionError(f"rank {rank}: a gradient at {first * 1e3:.2f} ms, "
                                 f"before the forward ended at {forward * 1e3:.2f} ms")
        for start, end in step["events"]:
            if start < forward or end > returned:
                raise AssertionError(
                    f"rank {rank}: an all-reduce from {start * 1e3:.2f} to "
                    f"{end * 1e3:.2f} ms, outside the backward ({forward * 1e3:.2f} "
                    f"to {returned * 1e3:.2f} ms): the optimizer would not step on "
                    f"averaged gradients")
        if not step["events"][0][0] < step["grad_end"]:
            raise AssertionError(f"rank {rank}: no all-reduce started before the last "
                                 f"gradient: nothing overlapped the backward")


def check_by_cap(steps: Sequence[dict]) -> None:
    """Assert what small multiples over `bucket_cap_mb` show, caps growing.

    `steps` holds one step record each, after the rebuild, in the order of
    growing caps: each makes fewer all-reduces than the one before, and the
    last, one bucket for the whole model, makes exactly one, which starts only
    once the backward's last gradient is written (nothing is hidden).
    """
    if len(steps) < 2:
        raise ValueError(f"need at least 2 caps to compare, got {len(steps)}")
    counts = [len(step["events"]) for step in steps]
    if any(a <= b for a, b in zip(counts, counts[1:], strict=False)):
        raise AssertionError(f"all-reduces per step {counts}: a larger cap must "
                             f"make fewer buckets")
    last = steps[-1]
    if counts[-1] != 1:
        raise AssertionError(f"the largest cap made {counts[-1]} all-reduces, "
                             f"expected one bucket for the whole model")
    start = last["events"][0][0]
    if start < last["grad_end"]:
        raise AssertionError(
            f"the one bucket's all-reduce started at {start * 1e3:.2f} ms, before "
            f"the last gradient at {last['grad_end'] * 1e3:.2f} ms")
