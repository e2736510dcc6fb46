"""The engine processes: how they start, and what each runs as a rank.

An engine is ipyparallel's, started by running this module, with torch
imported early (below). The functions after `main` are sent to the engines by
labkit.cluster.ranks; they import what they need inside, since they run in
other processes.

Every rank needs torch, and importing it takes about 2 s here. labkit's
engines are forked from labkit.cluster.forkserver, which has imported it
already, wherever `forkserver.usable()` allows; elsewhere (Windows, macOS,
LABKIT_FORKSERVER=0) ipyparallel's own launchers start them as new processes.
An engine started as a new process imports torch in a thread once
ipyparallel's engine is imported, so that the import overlaps the engine's
registration with the controller instead of following it.
"""

from __future__ import annotations

import os
import threading

__all__ = ["CONTROLLER_ARGS", "config", "end_with_kernel", "leave_group", "main",
           "new_cluster", "setup_rank"]

# Scheduler threads, not processes: 6 processes for 2 ranks instead of 13.
# The controller admits an engine at the heartbeat after its first answer;
# beating every 0.1 s instead of 3 s cuts up to 3 s from a start (300 missed
# beats, 30 s, still make an engine dead, as 10 of 3 s do by default; an
# engine that ends is reported at once by its nanny).
CONTROLLER_ARGS = ["--IPController.use_threads=True", "--HeartMonitor.period=100",
                   "--HeartMonitor.max_heartmonitor_misses=300"]


def config():  # -> traitlets.config.Config
    """ipyparallel's settings that make the engines run this module."""
    import sys

    from traitlets.config import Config

    config = Config()
    # Also read by forkserver.EngineSetLauncher, a subclass.
    config.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-m",
                                                "labkit.cluster.engine"]
    # ipyparallel waits 0.1 s between engines to help them take their ids in
    # order; labkit orders the ranks by engine id, whatever the order.
    config.LocalEngineSetLauncher.delay = 0.0
    return config


def new_cluster(n: int):  # -> ipyparallel.Cluster
    """An ipyparallel cluster of `n` engines on 127.0.0.1, started as labkit starts
    them, with the settings above: forked from the fork server where
    `forkserver.usable()` allows it, else as new processes by ipyparallel's own
    local launchers."""
    import ipyparallel as ipp
    from ipyparallel.cluster import launcher

    from . import forkserver

    if forkserver.usable() is None:
        controller = forkserver.ControllerLauncher
        engines = forkserver.EngineSetLauncher
    else:
        controller = launcher.LocalControllerLauncher
        engines = launcher.LocalEngineSetLauncher
    return ipp.Cluster(n=n, controller_ip="127.0.0.1", log_level=40,
                       controller=controller, engines=engines,
                       # not 1 s between the controller and the engines: they
                       # wait for its connection file anyway
                       delay=0, controller_args=CONTROLLER_ARGS, config=config())


def main() -> None:
    """The engine process: ipyparallel's engine, torch imported in a thread."""
    # ipyparallel's own imports first: begun at the same time, the two imports
    # wait for each other on the modules both need (seen with py-spy), and
    # the engine registers later.
    from ipyparallel.engine import app

    from .forkserver import serve  # the standard library only: any system

    # Forked by the server, with its nanny forked beside it. Started as a new
    # process, the engine starts its nanny itself, as ipyparallel's engines do.
    if serve.NANNY_FDS in os.environ:
        app.start_nanny = serve.nanny_from_fds
    threading.Thread(target=__import__, args=("torch",), name="labkit-import-torch",
                     daemon=True).start()
    app.main()


def setup_rank(rank: int, world_size: int, backend: str, port: int, prefix: str,
               timeout_s: float, threads: int, kernel: tuple[int, float],
               controller_pid: int | None, lang: str = "en") -> int:
    """Runs on an engine: join the group and give the notebook's names to its code.

    `lang` is the kernel's language: what labkit prints on a rank (a stall's
    report, a grader's trial) reads as the lesson does.

    Returns the engine's pid, which the kernel watches (labkit.cluster.stalls).
    """
    import threading

    from IPython import get_ipython

    import labkit
    from labkit.cluster import rendezvous as rdzv
    from labkit.cluster import stalls

    labkit.set_lang(lang)
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


if __name__ == "__main__":
    main()
