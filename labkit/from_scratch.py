"""A DDP written from scratch, watched and compared with torch's.

Lesson 06 writes the DDP itself in its cells; this module only watches it.
`compare_with_ddp` runs a DDP class written by hand and torch's DDP side by
side on the same model and data, on every rank, and returns what each did: the
hand-made one watched by a buckets.Timeline (every `dist.all_reduce` it makes,
its bytes, when it started, completed and was waited for, against when each
gradient was written), torch's counted by a comm_counting.CommCounter.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import buckets, comm_counting, compare, i18n, models, workload

__all__ = ["compare_with_ddp", "scratch_config"]

# Lesson 06's plot of the hand-made DDP's all-reduces (plots.timeline).
i18n.register({
    "scratch_overlap_title": {
        "ja": "ScratchDDP: 勾配の計算とバケットの all-reduce",
        "en": "ScratchDDP: gradient computation and the buckets' all-reduces",
    },
    "sync_finished": {"ja": "finish_sync() が戻る", "en": "finish_sync() returns"},
})


def scratch_config(bucket_cap_mb: float = 1.0) -> workload.Config:
    """Lesson 05's MLP (seven 1 MB weights) in buckets of `bucket_cap_mb`."""
    return workload.Config(hidden=512, depth=8, accum_steps=2,
                           bucket_cap_mb=bucket_cap_mb)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def compare_with_ddp(scratch_cls: Callable, cfg: workload.Config | None = None,
                     steps: int = 3) -> dict:
    """Run on every rank: `scratch_cls(model, bucket_cap_mb)` against torch's DDP.

    Both wrap the same initial model and see this rank's same micro-batches.
    For each of `steps` steps, one synchronized backward each; then one update
    of K micro-batches with the first K - 1 inside `no_sync()`. The hand-made
    DDP is watched by a buckets.Timeline (its `finish_sync()` ends each step);
    torch's all-reduces are counted by a comm hook. Returns, all as plain
    numbers: per step the calls and bytes of each, and the largest gradient
    difference; the same for the accumulated update, with the calls made
    inside `no_sync`; and the local (unsynchronized) gradients' difference,
    which tells a bucket never sent. "records" holds the Timeline records of
    the synchronized steps (plots.timeline draws them).
    """
    cfg = cfg or scratch_config()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = workload.make_dataset(cfg)
    batches = workload.micro_batches(dataset, cfg, 0, rank, world_size)
    criterion = models.MyLoss()
    reference = DDP(workload.make_model(cfg), bucket_cap_mb=cfg.bucket_cap_mb)
    counter = comm_counting.CommCounter().attach(reference)
    local = workload.make_model(cfg)  # no synchronization at all
    mine = scratch_cls(workload.make_model(cfg), bucket_cap_mb=cfg.bucket_cap_mb)
    out = {"steps": [], "update": {}}
    X, y = batches[0]
    with buckets.Timeline(mine) as log:
        for _ in range(steps):
            for model in (reference, local, mine):
                model.zero_grad()
            counter.reset()
            criterion(reference(X), y).backward()
            criterion(local(X), y).backward()
            log.step()
            criterion(mine(X), y).backward()
            mine.finish_sync()
            record = log.end_step()
            out["steps"].append(_step_summary(record, counter, reference, local, mine))
        for model in (reference, local, mine):
            model.zero_grad()
        counter.reset()
        for Xi, yi in batches:
            criterion(local(Xi), yi).backward()
        log.step()
        for model in (reference, mine):
            with model.no_sync():
                for Xi, yi in batches[:-1]:
                    criterion(model(Xi), yi).backward()
        inside = len(log.steps[-1]["calls"])  # torch's DDP makes none there
        criterion(reference(batches[-1][0]), batches[-1][1]).backward()
        log.steps[-1]["calls"].clear()  # torch's comm hook calls dist.all_reduce too
        criterion(mine(batches[-1][0]), batches[-1][1]).backward()
        mine.finish_sync()
        record = log.end_step()
        out["update"] = _step_summary(record, counter, reference, local, mine)
        out["update"]["calls_in_no_sync"] = inside
    out["records"] = log.steps[:steps]
    return out


def _step_summary(record: dict, counter: comm_counting.CommCounter, reference: DDP,
                  local: nn.Module, mine: nn.Module) -> dict:
    want, got = _grads(reference.module), _grads(_inner(mine))
    own = _grads(local)
    missing = sorted(set(want) - set(got))
    common = [n for n in want if n in got]
    return {
        "ddp_calls": counter.calls, "ddp_bytes": counter.bytes,
        "calls": len(record["calls"]),
        "bytes": sum(c["bytes"] for c in record["calls"]),
        # Each all-reduce's bytes in the order it started: with buckets of
        # different sizes, equal lists mean the same buckets in the same order.
        "sizes": [c["bytes"] for c in record["calls"]],
        "ddp_sizes": list(counter.sizes),
        "waited_before_grads": sum(c["waited"] < record["grad_end"]
                                   for c in record["calls"]),
        "started_after_grads": sum(c["start"] > record["grad_end"]
                                   for c in record["calls"]),
        "hidden_s": record["hidden_s"], "exposed_s": record["exposed_s"],
        "overlapped": sum(_overlapped(c, record["grad_times"]) > 0
                          for c in record["calls"]),
        "missing_grads": missing,
        "max_diff": max((compare.max_abs_diff(got[n], want[n]) for n in common),
                        default=math.inf),
        "unsynced": sorted(n for n in common if not torch.equal(want[n], own[n])
                           and torch.equal(got[n], own[n])),
        "doubled": bool(common) and all(
            torch.allclose(got[n], want[n] * dist.get_world_size(), atol=1e-7)
            for n in common),
    }


def _overlapped(call: dict, grad_times: list[float]) -> int:
    """Gradients written while the all-reduce `call` was under way.

    The first stamp after its start is the gradient whose hook started it
    (hooks run in the order they were registered, the hand-made DDP's before
    the Timeline's): not one more.
    """
    written = sum(call["start"] < g < call["end"] for g in grad_times)
    return max(0, written - 1)


def _inner(model: nn.Module) -> nn.Module:
    """The wrapped module: a hand-made DDP keeps it as `.module`, as torch's does."""
    return getattr(model, "module", model)
