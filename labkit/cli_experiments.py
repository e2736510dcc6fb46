"""The command line's experiments: `python -m labkit nosync`, `misuse` and `resume`.

Lessons 04 and 11 write these steps out in their cells; here each is one function that
returns what it found as a JSON-able dict, for a run without a notebook (under
torchrun, on GPUs, on a cluster). Every function runs on each rank of an
initialized process group.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import asdict

import torch.distributed as dist

from . import compare, models, training, workload
from .checkpoint import load as load_checkpoint
from .checkpoint import save as save_checkpoint
from .cluster.launch import crash
from .no_sync import accumulate_no_sync, counted_update, step_times

__all__ = ["misuse_experiment", "nosync_experiment", "resumable_training"]


def nosync_experiment(rank: int, world_size: int, cfg: workload.Config) -> dict:
    """Equivalence, replica agreement, all-reduce counts and step times."""
    cfg.check()
    dataset = workload.make_dataset(cfg)
    criterion = models.MyLoss()
    model, counter = workload.wrap(cfg)
    optimizer = workload.make_optimizer(model, cfg)

    # 1. The accumulated DDP gradient against one process on the K-times batch.
    local = workload.make_model(cfg)
    (Xg, yg), = workload.micro_batches(dataset, cfg, 0, rank, world_size, whole=True)
    criterion(local(Xg), yg).backward()
    optimizer.zero_grad()
    first = workload.micro_batches(dataset, cfg, 0, rank, world_size)
    accumulate_no_sync(model, criterion, first)
    grad_diff = compare.max_abs_diff(compare.grads(model.module), compare.grads(local))

    # 2. Train `steps` steps; count all-reduce calls per optimizer step.
    calls = []
    for step in range(cfg.steps):
        optimizer.zero_grad()
        counter.reset()
        accumulate_no_sync(model, criterion,
                           workload.micro_batches(dataset, cfg, step, rank, world_size))
        optimizer.step()
        calls.append(counter.calls)
    replica_diff = compare.replica_max_diff(model)
    calls_nosync = calls[-1]  # after the first step DDP has rebuilt its buckets
    counter.reset()
    optimizer.zero_grad()
    accumulate_no_sync(model, criterion, first, use_no_sync=False)
    calls_sync = counter.calls

    sync_s, nosync_s = step_times(model, optimizer, dataset, cfg, rank, world_size)
    return {
        "rank": rank,
        "world_size": world_size,
        "config": asdict(cfg),
        "params": models.count_params(model.module),
        "grad_max_abs_diff": grad_diff,
        "replica_max_param_diff": replica_diff,
        "allreduce_calls_per_step_sync": calls_sync,
        "allreduce_calls_per_step_nosync": calls_nosync,
        "allreduce_bytes_per_call": counter.bytes / max(counter.calls, 1),
        "step_s_sync": sync_s,
        "step_s_nosync": nosync_s,
    }


def misuse_experiment(rank: int, world_size: int, cfg: workload.Config) -> dict:
    """The documents' misuses of no_sync, measured."""
    cfg.check()
    dataset = workload.make_dataset(cfg)
    criterion = models.MyLoss()
    K = cfg.accum_steps
    batches = workload.micro_batches(dataset, cfg, 0, rank, world_size)

    def calls_of(run) -> int:
        return counted_update(cfg, criterion, batches, run)[0]

    def correct(model):
        accumulate_no_sync(model, criterion, batches)

    def bare_call(model):
        model.no_sync()  # as in doc 000: builds a context manager and drops it
        accumulate_no_sync(model, criterion, batches, use_no_sync=False)

    def forward_outside(model):
        for i, (X, y) in enumerate(batches):
            loss = criterion(model(X), y) / K  # forward outside: DDP already decided
            with model.no_sync() if i < K - 1 else nullcontext():
                loss.backward()

    # Stepping inside no_sync: every rank updates with its own gradient.
    model, _ = workload.wrap(cfg)
    optimizer = workload.make_optimizer(model, cfg)
    diffs = []
    for step in range(cfg.steps):
        for X, y in workload.micro_batches(dataset, cfg, step, rank, world_size):
            with model.no_sync():
                optimizer.zero_grad()
                criterion(model(X), y).backward()
                optimizer.step()
        diffs.append(compare.replica_max_diff(model))
    # Synchronized steps afterwards apply the same update to different weights.
    for step in range(cfg.steps):
        optimizer.zero_grad()
        accumulate_no_sync(model, criterion,
                           workload.micro_batches(dataset, cfg, step, rank, world_size))
        optimizer.step()
    return {
        "rank": rank,
        "world_size": world_size,
        "config": asdict(cfg),
        "correct_allreduce_calls": calls_of(correct),
        "sync_allreduce_calls": calls_of(
            lambda m: accumulate_no_sync(m, criterion, batches, use_no_sync=False)),
        "bare_call_allreduce_calls": calls_of(bare_call),
        "forward_outside_allreduce_calls": calls_of(forward_outside),
        "diverged_param_diff_per_step": diffs,
        "diverged_max_param_diff": max(diffs),
        "param_diff_after_sync_steps": compare.replica_max_diff(model),
    }


def resumable_training(rank: int, world_size: int, cfg: workload.Config,
                       checkpoint: str, every: int = 5,
                       die_at: int | None = None) -> dict:
    """DDP training that checkpoints on rank 0 and resumes from `checkpoint`.

    Lesson 11's pattern: rank 0 saves `model.module`'s and the optimizer's state
    every `every` steps with labkit.checkpoint (a temporary file renamed over
    `checkpoint`), and every rank waits at a barrier, so no rank reads a file
    half written or one step old. A run that finds `checkpoint` loads it (on the
    CPU, tensors and plain values only) and goes on from its step. The
    workload's batches are a function of the step (workload.micro_batches), so
    the step is all the data order needs. Returned: this rank's loss at each
    step this attempt ran (`losses`), the step it resumed from, and a hash of
    the final weights.

    `die_at`: on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0), rank 1
    kills itself with SIGKILL before that step, as a crashed node would
    (cluster.launch.crash: os._exit where there is no SIGKILL, on Windows).
    """
    cfg.check()
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    dataset = workload.make_dataset(cfg)
    criterion = models.MyLoss()
    model, _ = workload.wrap(cfg)
    optimizer = workload.make_optimizer(model, cfg)
    start = 0
    if os.path.exists(checkpoint):
        state = load_checkpoint(checkpoint)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    losses = []  # this rank's loss at each step this attempt ran
    for step in range(start, cfg.steps):
        if step == die_at and attempt == 0 and rank == 1:
            crash()
        optimizer.zero_grad()
        losses.append(accumulate_no_sync(
            model, criterion, workload.micro_batches(dataset, cfg, step, rank,
                                                     world_size)))
        optimizer.step()
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            if rank == 0:
                save_checkpoint({"model": model.module.state_dict(),
                                 "optimizer": optimizer.state_dict(),
                                 "step": step + 1}, checkpoint)
            dist.barrier()  # nobody reads it before rank 0 is done
    return {"rank": rank, "world_size": world_size, "config": asdict(cfg),
            "attempt": attempt, "resumed_from": start, "losses": losses,
            "param_sha256": training.param_sha256(model.module)}

