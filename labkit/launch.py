"""Run an experiment on every rank from the command line.

Under `torchrun` the ranks already exist: each process joins the group from
torchrun's environment. Without it, `run` starts them with torch's own elastic
launcher (the API behind torchrun) on 127.0.0.1. Either way the failing rank's
traceback is recorded and printed.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from . import rendezvous

__all__ = ["run", "under_torchrun"]


def under_torchrun() -> bool:
    """True in a process that torchrun (or its elastic agent) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _join_from_env(backend: str, timeout_s: float) -> tuple[int, int]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", rendezvous.loopback_interface())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world_size


@record
def _worker(fn: Callable, kwargs: dict, backend: str, timeout_s: float):
    """One rank under the elastic launcher: join, run, leave."""
    rank, world_size = _join_from_env(backend, timeout_s)
    try:
        return fn(rank, world_size, **kwargs)
    finally:
        dist.destroy_process_group()


def run(fn: Callable, kwargs: dict, world_size: int, backend: str = "gloo",
        timeout_s: float = 60.0) -> list:
    """`fn(rank, world_size, **kwargs)` on every rank; the results in rank order.

    Under torchrun this process is one rank: results come from all ranks by
    all_gather_object, so rank 0 can report them.
    """
    if under_torchrun():
        rank, world_size = _join_from_env(backend, timeout_s)
        try:
            result = fn(rank, world_size, **kwargs)
            results = [None] * world_size
            dist.all_gather_object(results, result)
            return results
        finally:
            dist.destroy_process_group()

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rendezvous.check_args(world_size, backend)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"labkit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: the OS picks a free one
        max_restarts=0,  # an experiment that failed once fails again: report it
        monitor_interval=0.1,
    )
    # The agent logs each failure at length; ChildFailedError carries the same
    # traceback once, and the caller prints it.
    log = logging.getLogger("torch.distributed.elastic")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        results = elastic_launch(config, _worker)(fn, kwargs, backend, timeout_s)
    finally:
        log.setLevel(level)
    return [results[r] for r in range(world_size)]
