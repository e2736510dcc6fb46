"""What runs on each engine: join the group, watch the kernel, leave the group.

These functions are sent to the engines by labkit.cluster; they import what
they need inside, since they run in other processes.
"""

from __future__ import annotations

import os

__all__ = ["end_with_kernel", "leave_group", "setup_rank"]


def setup_rank(rank: int, world_size: int, backend: str, port: int, prefix: str,
                  timeout_s: float, threads: int, kernel: tuple[int, float],
                  controller_pid: int | None) -> int:
    """Runs on an engine: join the group and give the notebook's names to its code.

    Returns the engine's pid, which the kernel watches (labkit.stalls).
    """
    import threading

    from IPython import get_ipython

    from labkit import rendezvous as rdzv
    from labkit import stalls

    if not any(t.name == "labkit-watch-kernel" for t in threading.enumerate()):
        threading.Thread(target=end_with_kernel, args=(kernel, controller_pid),
                         name="labkit-watch-kernel", daemon=True).start()
    stalls.enable_dumps(f"rank {rank}")
    device = rdzv.init_rank(rank, world_size, backend, port, prefix, timeout_s, threads)
    get_ipython().user_ns.update(rank=rank, world_size=world_size, device=device)
    return os.getpid()


def end_with_kernel(kernel: tuple[int, float], controller_pid: int | None) -> None:
    """Runs in a thread on each engine: exit when the kernel that started us is gone.

    A kernel that exits normally stops its engines itself; one that is killed
    (SIGKILL, a crash) cannot, and its engines and controller would live on.
    """
    import time

    import psutil

    pid, created = kernel
    while True:
        time.sleep(0.5)
        try:
            alive = psutil.Process(pid).create_time() == created  # not a reused pid
        except psutil.NoSuchProcess:
            alive = False
        if not alive:
            break
    if controller_pid is not None:
        try:
            psutil.Process(controller_pid).terminate()
        except psutil.NoSuchProcess:
            pass
    os._exit(0)


def leave_group() -> None:
    """Runs on an engine: leave the process group, if it is in one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
