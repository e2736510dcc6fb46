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
def _worker(fn: Callable, kwargs: dict, backend: str, timeout_s: float, port: int,
            prefix: str):
    """One rank under the elastic launcher: join our loopback store, run, leave."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rendezvous.init_rank(rank, world_size, backend, port, prefix, timeout_s)
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
    # Every store is ours, on 127.0.0.1 only and a port the OS picked. Left to
    # itself the agent would host two that listen on every interface: one for
    # the rendezvous and one it shares with the workers (disabled below; the
    # workers join our store instead).
    store = rendezvous.local_store(timeout_s)
    run_id = f"labkit-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{store.port}",
        rdzv_configs={"is_host": False},
        max_restarts=0,  # an experiment that failed once fails again: report it
        monitor_interval=0.1,
        local_addr="127.0.0.1",
    )
    # The agent logs each failure at length; ChildFailedError carries the same
    # traceback once, and the caller prints it.
    log = logging.getLogger("torch.distributed.elastic")
    level = log.level
    log.setLevel(logging.CRITICAL)
    shared = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        results = elastic_launch(config, _worker)(fn, kwargs, backend, timeout_s,
                                                  store.port, f"{run_id}/pg")
    finally:
        log.setLevel(level)
        if shared is None:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        else:
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = shared
    return [results[r] for r in range(world_size)]
