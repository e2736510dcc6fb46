"""Ranks as ipyparallel engines: a live process group inside a notebook.

`start(2)` launches two engine processes on 127.0.0.1, makes engine i rank i,
and joins them in one process group. In the notebook, `%%px` cells then run on
every rank and show each rank's output and traceback; from Python,
`ranks.run(fn, ...)` calls a function on every rank and returns the results in
rank order. Engines stop with the kernel, or with `ranks.stop()`.
"""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass, field

from . import rendezvous

__all__ = ["RankError", "Ranks", "current", "start"]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RankError(RuntimeError):
    """One or more ranks raised; names them and carries their tracebacks."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        ranks = ", ".join(str(r) for r in sorted(failures))
        details = "\n".join(f"--- rank {r} ---\n{tb}"
                            for r, tb in sorted(failures.items()))
        super().__init__(f"rank {ranks} raised an error:\n{details}")


def _setup_engine(rank: int, world_size: int, backend: str, port: int, prefix: str,
                  timeout_s: float, threads: int, kernel: tuple[int, float],
                  controller_pid: int | None) -> str:
    """Runs on an engine: join the group and give the notebook's names to its code."""
    import threading

    from IPython import get_ipython

    from labkit import rendezvous as rdzv

    if not any(t.name == "labkit-watch-kernel" for t in threading.enumerate()):
        threading.Thread(target=_end_with_kernel, args=(kernel, controller_pid),
                         name="labkit-watch-kernel", daemon=True).start()
    device = rdzv.init_rank(rank, world_size, backend, port, prefix, timeout_s, threads)
    get_ipython().user_ns.update(rank=rank, world_size=world_size, device=device)
    return device


def _end_with_kernel(kernel: tuple[int, float], controller_pid: int | None) -> None:
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


@dataclass
class Ranks:
    """A running group of engines, one per rank."""

    world_size: int
    backend: str
    timeout_s: float
    threads_per_rank: int
    cluster: object = field(repr=False)
    client: object = field(repr=False)
    view: object = field(repr=False)
    store: object = field(repr=False)
    generation: int = 0

    def run(self, fn, *args, **kwargs) -> list:
        """Call `fn(*args, **kwargs)` on every rank; results in rank order."""
        return self._gather(self.view.apply_async(fn, *args, **kwargs))

    def execute(self, code: str) -> None:
        """Run `code` on every rank, like a `%%px` cell, and show its output."""
        result = self.view.execute(code, block=False)
        try:
            self._gather(result)
        finally:
            result.display_outputs()

    def pull(self, name: str) -> list:
        """The value of `name` in every rank's namespace, in rank order."""
        return self._gather(self.view.pull(name, block=False))

    def _gather(self, result) -> list:
        import ipyparallel as ipp

        try:
            return result.get()
        except ipp.error.CompositeError as err:
            failures = {}
            for (ename, evalue, tb, info) in err.elist:
                rank = self._rank_of(info.get("engine_id"))
                if not tb:
                    tb = f"{ename}: {evalue}"
                failures[rank] = _ANSI.sub("", tb if isinstance(tb, str) else
                                           "\n".join(tb))
            raise RankError(failures) from None

    def _rank_of(self, engine_id) -> int:
        ids = list(self.view.targets)
        return ids.index(engine_id) if engine_id in ids else -1

    def reset_process_group(self) -> None:
        """Destroy and re-create the process group on the same engines."""
        import torch.distributed as dist

        self.run(dist.destroy_process_group)
        self.generation += 1
        self._join()

    def _join(self) -> None:
        import psutil

        port = self.store.port
        prefix = f"labkit/{self.generation}"
        kernel = (os.getpid(), psutil.Process().create_time())
        controller = getattr(self.cluster.controller, "pid", None)
        pending = [
            self.client[eid].apply_async(
                _setup_engine, rank, self.world_size, self.backend, port, prefix,
                self.timeout_s, self.threads_per_rank, kernel, controller)
            for rank, eid in enumerate(self.view.targets)
        ]
        failures = {}
        for rank, result in enumerate(pending):
            try:
                result.get(timeout=self.timeout_s + 60)
            except Exception as err:  # report every rank, not only the first
                failures[rank] = "".join(traceback.format_exception_only(err))
        if failures:
            raise RankError(failures)

    def stop(self) -> None:
        """Stop the engines and free the rendezvous port."""
        global _current
        try:
            self.client.close()
        finally:
            self.cluster.stop_cluster_sync()
            self.store = None
            if _current is self:
                _current = None

    def restart(self) -> Ranks:
        """Stop these engines and start fresh ones with the same settings."""
        self.stop()
        return start(self.world_size, self.backend, timeout_s=self.timeout_s,
                      threads_per_rank=self.threads_per_rank)

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_current: Ranks | None = None


def current() -> Ranks | None:
    """The running group started by `start`, if any."""
    return _current


def start(world_size: int = 2, backend: str = "gloo", *, timeout_s: float = 20.0,
          threads_per_rank: int | None = None, activate: bool = True) -> Ranks:
    """Start `world_size` engines on 127.0.0.1 and join them in a process group.

    A group already running in this kernel is stopped first, so running the
    cell again never leaves engines behind. `timeout_s` bounds every
    collective: a rank that never arrives raises instead of hanging.
    With `activate`, `%%px` cells run on these ranks.
    """
    global _current
    rendezvous.check_args(world_size, backend)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    if _current is not None:
        _current.stop()

    import ipyparallel as ipp

    cluster = ipp.Cluster(n=world_size, controller_ip="127.0.0.1", engines="local",
                          log_level=40)
    client = cluster.start_and_connect_sync()
    try:
        client.wait_for_engines(world_size, timeout=60)
        view = client[sorted(client.ids)[:world_size]]
        view.block = True
        ranks = Ranks(world_size, backend, timeout_s, threads_per_rank, cluster,
                      client, view, rendezvous.local_store(timeout_s))
        ranks._join()
    except BaseException:
        client.close()
        cluster.stop_cluster_sync()
        raise
    if activate:
        view.activate()
    _current = ranks
    return ranks
