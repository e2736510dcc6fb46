"""Counting what is sent: DDP's gradient buckets, and torch.distributed's collectives.

Two mechanisms, one for each place a collective can be watched from:

- `CommCounter` is a DDP communication hook: DDP hands it every bucket of
  gradients, so it records each gradient all-reduce and its bytes (step by
  step when asked). It sees nothing else DDP sends: not the all-reduce of the
  map of used parameters that `find_unused_parameters=True` adds at every step,
  not the broadcasts of parameters when DDP is built and of buffers before each
  forward pass, and nothing an optimizer sends (ZeroRedundancyOptimizer
  broadcasts its updated shards).
- `CollectiveLog` replaces `dist.all_reduce`, `dist.broadcast`, the
  reduce-scatter and the all-gather into one tensor while it is active and
  records every call made through them: a comm hook's all-reduces, ZeRO's
  broadcasts, a DDP or a ZeRO written by hand, FSDP2's gathers and
  reduce-scatters; each with its bytes and when it started, completed and was
  waited for. DDP's own C++ code calls the process
  group directly, so the map of used parameters and DDP's broadcasts pass it by
  as well: torch's Flight Recorder records those (lesson 10).
"""

from __future__ import annotations

import functools
import inspect
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

__all__ = ["CollectiveLog", "CommCounter"]


class CommCounter:
    """A DDP communication hook that records the bytes of each all-reduce it makes.

    It all-reduces exactly as DDP's default does (sum, divide by world size),
    so training is unchanged. Attach before the first forward pass. With
    `per_step=True`, call `step()` before each step's backward: `steps` then
    holds each step's sizes apart.
    """

    def __init__(self, per_step: bool = False):
        self.per_step = per_step
        self.sizes: list[int] = []  # each call's bytes, in the order DDP made them
        self.steps: list[list[int]] = []  # the same, one list per step()

    @property
    def calls(self) -> int:
        return len(self.sizes)

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    def attach(self, model: nn.parallel.DistributedDataParallel) -> CommCounter:
        model.register_comm_hook(self, CommCounter._hook)
        return self

    def step(self) -> None:
        """Start a step: the calls that follow are this step's."""
        self.steps.append([])

    def reset(self) -> None:
        self.sizes = []
        self.steps = []

    @staticmethod
    def _hook(counter, bucket):  # unannotated: DDP rejects string annotations
        if counter.per_step and not counter.steps:
            raise RuntimeError("CommCounter.step() must be called before the backward")
        buffer = bucket.buffer()
        size = buffer.numel() * buffer.element_size()
        counter.sizes.append(size)
        if counter.steps:
            counter.steps[-1].append(size)
        return default_hooks.allreduce_hook(None, bucket)


class _Work:
    """A collective's handle as the caller sees it, noting when it is waited for."""

    def __init__(self, work, call: dict, log: CollectiveLog, future=None):
        self._work, self._call, self._log = work, call, log
        self._future = future  # the work's future, once the end is noted

    def get_future(self):
        # The future that completes after the log noted the end: waiting on the
        # work's own one may return before its callback (the note) has run.
        return self._future if self._future is not None else self._work.get_future()

    def wait(self, *args, **kwargs):
        if math.isnan(self._call["waited"]):  # the first wait is the one that blocks
            self._call["waited"] = self._log.now()
        result = self._work.wait(*args, **kwargs)
        # Done by now at the latest: the future's callback, which notes the end,
        # may run on gloo's thread after wait() has returned.
        if math.isnan(self._call["end"]):
            self._call["end"] = self._log.now()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


class CollectiveLog:
    """Every call of the collectives in `ops` while active.

    `with CollectiveLog() as log:` replaces them in torch.distributed and puts
    them back on leaving. Each call appends to `calls` a dict: "op", "bytes",
    "async", "start", "end" (when it completed; NaN while an asynchronous one
    runs, and until its wait for one without a future, as gloo's
    reduce-scatter) and "waited" (when its handle was first waited for; a
    blocking call at once), in seconds from the last `reset()`.

    "bytes" is the size of the whole buffer the collective works on, the same
    on every rank: the tensor of an all-reduce or a broadcast, the input of a
    reduce-scatter (each rank keeps 1/N of it), the output of an all-gather
    (each rank gives 1/N of it). So an all-reduce of S bytes and the
    reduce-scatter plus all-gather that make it up are S bytes each.
    """

    OPS = ("all_reduce", "broadcast", "reduce_scatter", "all_gather")
    # op -> (the names torch.distributed calls it by, the argument that is the
    # whole buffer). torch 2.13 renamed the one-tensor forms `*_single`; the old
    # names stay as deprecated wrappers that call the new ones inside
    # distributed_c10d, past the patched attribute, so no call is counted twice.
    _TORCH_NAMES = {
        "all_reduce": (("all_reduce",), "tensor"),
        "broadcast": (("broadcast",), "tensor"),
        "reduce_scatter": (("reduce_scatter_single", "reduce_scatter_tensor"), "input"),
        "all_gather": (("all_gather_single", "all_gather_into_tensor"),
                       "output_tensor"),
    }

    def __init__(self, ops: tuple[str, ...] = OPS):
        if not ops or set(ops) - set(self.OPS):
            raise ValueError(f"ops must be some of {self.OPS}, got {ops}")
        self.ops = tuple(ops)
        self.calls: list[dict] = []
        self._t0 = time.perf_counter()
        self._originals: dict = {}

    def __enter__(self) -> CollectiveLog:
        if self._originals:
            raise RuntimeError("this CollectiveLog is already active")
        for op in self.ops:
            names, buffer = self._TORCH_NAMES[op]
            for name in names:
                original = getattr(dist, name, None)
                if original is not None:  # the older torch has one name only
                    self._originals[name] = original
                    setattr(dist, name, self._recorded(op, original, buffer))
        return self

    def __exit__(self, *exc) -> None:
        for op, original in self._originals.items():
            setattr(dist, op, original)
        self._originals = {}

    def now(self) -> float:
        """Seconds since the last reset: the clock of the calls' times."""
        return time.perf_counter() - self._t0

    def reset(self) -> None:
        """Forget the calls so far (a new list) and restart the clock."""
        self.calls = []
        self._t0 = time.perf_counter()

    def count(self, op: str) -> int:
        """Calls of `op` so far."""
        return sum(c["op"] == op for c in self.calls)

    def nbytes(self, op: str | None = None) -> int:
        """Bytes handed to `op` so far, or to every op when None."""
        return sum(c["bytes"] for c in self.calls if op is None or c["op"] == op)

    def _recorded(self, op: str, original, buffer: str):
        # tensors and async_op may come by position or by name
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            tensor, async_op = bound[buffer], bool(bound.get("async_op", False))
            call = {"op": op, "bytes": tensor.numel() * tensor.element_size(),
                    "async": async_op, "start": self.now(), "end": math.nan,
                    "waited": math.nan}
            self.calls.append(call)
            work = original(*args, **kwargs)
            if not async_op:
                call["end"] = call["waited"] = self.now()
                return work

            def done(fut: torch.futures.Future):
                if math.isnan(call["end"]):  # not noted already by a wait
                    call["end"] = self.now()
                return fut.value()  # the chained future holds the same result

            try:
                noted = work.get_future().then(done)
            except RuntimeError as err:
                # gloo's reduce-scatter returns a work with no future, whose
                # wait() copies the result out: its end is noted at that wait.
                if "not implemented" not in str(err):
                    raise
                noted = None
            return _Work(work, call, self, noted)

        return recorded
