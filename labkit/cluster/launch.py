"""Run an experiment on every rank from the command line.

Under `torchrun` the ranks already exist: each process joins the group from
torchrun's environment. Without it, `run` starts them with torch's own elastic
launcher (the API behind torchrun) on 127.0.0.1. Either way the failing rank's
traceback is recorded and printed.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable

import torch.distributed as dist

from .. import i18n
from . import rendezvous, stalls

__all__ = ["StoppedRankError", "crash", "exit_now", "run", "under_torchrun"]

i18n.register({
    "fault_needs_signal": {
        "ja": "--fault {fault} には {signal} が要りますが、この OS にはありません "
              "(Windows)。ここで試せる故障は {faults} です",
        "en": "--fault {fault} needs {signal}, which this system does not have "
              "(Windows); the faults it can show are {faults}",
    },
    "crash_without_sigkill": {
        "ja": "pid {pid}: この OS には SIGKILL がないため、os._exit({code}) で"
              "同じようにすぐ終わります",
        "en": "pid {pid}: this system has no SIGKILL; os._exit({code}) ends the "
              "process at once all the same",
    },
})


def under_torchrun() -> bool:
    """True in a process that torchrun (or its elastic agent) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


FAULTS = ("raise", "kill", "hang", "stop")
# The signal a fault needs, where the system may lack it: a stopped rank is one
# that got SIGSTOP, which Windows does not have. ("kill" needs none: see crash.)
_FAULT_SIGNALS = {"stop": "SIGSTOP"}
# What a process killed by SIGKILL exits with in a shell: 128 + 9.
CRASH_CODE = 137


def _faults_here() -> tuple[str, ...]:
    """The faults this system can inject."""
    return tuple(f for f in FAULTS
                 if f not in _FAULT_SIGNALS or hasattr(signal, _FAULT_SIGNALS[f]))


def crash() -> None:
    """End this process at once, as a crash would: no cleanup, no exception.

    SIGKILL where the system has it (Linux, macOS). Windows has none; there
    the process says so on stderr and ends with os._exit(CRASH_CODE), which
    runs no handler either. (Not run on Windows here: the fallback is tested
    on Linux by taking SIGKILL away.)
    """
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal may arrive a moment after the call returns
    print(i18n.t("crash_without_sigkill", pid=os.getpid(), code=CRASH_CODE),
          file=sys.stderr, flush=True)
    os._exit(CRASH_CODE)


def _inject(fault: tuple[str, int] | None, rank: int, where: str) -> None:
    """Make rank `fault[1]` fail on purpose, to show what each failure looks like."""
    if fault is None or fault[1] != rank:
        return
    kind = fault[0]
    if kind == "hang" and where == "start":
        time.sleep(24 * 3600)  # never arrives; the others' barrier names this rank
    elif kind == "raise" and where == "run":
        raise RuntimeError(f"fault injected on rank {rank}: raise")
    elif kind == "kill" and where == "run":
        # SIGKILL a moment later, in the middle of whatever step is running then.
        threading.Timer(0.3, crash).start()
    elif kind == "stop" and where == "run":
        # SIGSTOP a moment later: alive but frozen, as under a debugger or Ctrl-Z.
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGSTOP)).start()


def exit_now(code: int = 0) -> None:
    """End this rank's process now, flushed, without Python's finalization.

    After a rank's last collective, torch's gloo threads may still be releasing
    its tensors, which takes the GIL. If the interpreter is finalizing by then,
    that thread is killed inside a C++ destructor and the process aborts
    ("terminate called without an active exception", SIGABRT), so a run that
    had finished is reported failed. Seen in about one torchrun run in four
    here; the core dump showed ProcessGroupGloo::runLoop destroying an
    AsyncAllgatherWork while the main thread was in Py_FinalizeEx. DDP keeps
    the group alive past destroy_process_group, so its threads cannot be
    joined first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _interrupt_again(unraisable) -> None:
    """A rank's sys.unraisablehook: a Ctrl-C that could not stop the rank, again.

    Ctrl-C reaches the ranks as the SIGINT the agent passes on. When its
    KeyboardInterrupt is raised inside a callback that cannot pass it on (a
    weakref callback of the import system's module locks, a `__del__`),
    Python prints "Exception ignored in ..." with a traceback and the rank runs
    on until the agent kills it. An alarm a moment later raises it again, in
    the code the rank runs, where it stops the rank quietly as any Ctrl-C of a
    running rank does: raised from here (a signal sent now, or a thread
    started to send it) it would land in this hook and be unraisable again.
    """
    if issubclass(unraisable.exc_type, KeyboardInterrupt) and _CAN_ALARM:
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # SIGALRM: KeyboardInterrupt
        return
    sys.__unraisablehook__(unraisable)


# Windows has no SIGALRM: there a swallowed Ctrl-C is reported as Python does.
_CAN_ALARM = hasattr(signal, "setitimer")


def _catch_swallowed_ctrl_c() -> None:
    """In a rank's main thread: make a swallowed Ctrl-C stop it (_interrupt_again)."""
    if _CAN_ALARM:
        signal.signal(signal.SIGALRM, signal.default_int_handler)
    sys.unraisablehook = _interrupt_again


# No @record here: torch's launcher wraps every entrypoint in it already
# (torch/distributed/elastic/multiprocessing/api.py, `_wrap`: record(fn), in
# torch 2.13.0 and 2.14.1), so the failing rank's traceback reaches the error
# file either way (test_cli_faults_name_the_rank, "raise").
def _worker(fn: Callable, kwargs: dict, backend: str, timeout_s: float, port: int,
            prefix: str, fault: tuple[str, int] | None = None):
    """One rank under the elastic launcher: join our loopback store, run, leave."""
    _catch_swallowed_ctrl_c()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stalls.enable_dumps(f"rank {rank} of {prefix.partition('/')[0]}")
    rendezvous.init_rank(rank, world_size, backend, port, prefix, timeout_s)
    try:
        _inject(fault, rank, "start")
        if backend == "gloo":
            # Every rank must arrive; one that does not is named (gloo only).
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_all_ranks=True)
        _inject(fault, rank, "run")
        result = fn(rank, world_size, **kwargs)
    finally:
        dist.destroy_process_group()
    # The launcher reads the result before this process ends; then leave
    # without finalizing (see exit_now). A failed rank exits as usual.
    atexit.register(exit_now, 0)
    return result


class StoppedRankError(RuntimeError):
    """A rank was stopped (SIGSTOP) while the others waited for it."""


def _agent_signals() -> tuple[signal.Signals, ...]:
    """The signals torch's elastic agent handles by default
    (TORCHELASTIC_SIGNALS_TO_HANDLE) that this system has: Windows has no
    SIGHUP and no SIGQUIT."""
    return tuple(getattr(signal, name) for name in
                 ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, name))


# The rendezvous backend name under which run's agent meets on labkit's store.
_RENDEZVOUS = "labkit-store"


def _rendezvous_on_our_store(params):  # -> RendezvousHandler
    """torch's c10d rendezvous, on the store that run passes in its config."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class OnOurStore(C10dRendezvousBackend):
        name = _RENDEZVOUS  # torch checks the handler's name against the config's

    store = params.config["store"]
    return create_handler(store, OnOurStore(store, params.run_id), params)


def run(fn: Callable, kwargs: dict, world_size: int, backend: str = "gloo",
        timeout_s: float = 60.0, port: int = 0,
        fault: tuple[str, int] | None = None) -> list:
    """`fn(rank, world_size, **kwargs)` on every rank; the results in rank order.

    Under torchrun this process is one rank: results come from all ranks by
    all_gather_object, so rank 0 can report them.
    """
    if under_torchrun():
        stalls.enable_dumps(f"rank {os.environ['RANK']}")
        rank, world_size = rendezvous.init_from_env(backend, timeout_s)
        try:
            result = fn(rank, world_size, **kwargs)
            results = [None] * world_size
            dist.all_gather_object(results, result)
            return results
        finally:
            dist.destroy_process_group()

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rendezvous.check_args(world_size, backend, port)
    if fault is not None and (fault[0] not in FAULTS or not 0 <= fault[1] < world_size):
        raise ValueError(f"fault must be one of {', '.join(FAULTS)} on a rank in "
                         f"0..{world_size - 1}, got {fault}")
    if fault is not None and fault[0] not in _faults_here():
        raise ValueError(i18n.t("fault_needs_signal", fault=fault[0],
                                signal=_FAULT_SIGNALS[fault[0]],
                                faults=", ".join(_faults_here())))
    # Every store is ours, on 127.0.0.1 only and a port the OS picked. Left to
    # itself the agent would host two that listen on every interface: one for
    # the rendezvous and one it shares with the workers (disabled below; the
    # workers join our store instead). The rendezvous runs on our store too:
    # torch's c10d rendezvous would make a TCPStore of its own, which asks for
    # libuv whatever USE_LIBUV says (torch 2.13, 2.14.1), and Windows' torch
    # has none.
    store = rendezvous.local_store(timeout_s, port)
    run_id = f"labkit-{uuid.uuid4().hex[:8]}"
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_RENDEZVOUS, _rendezvous_on_our_store)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=run_id,
        rdzv_backend=_RENDEZVOUS,
        rdzv_endpoint=f"127.0.0.1:{store.port}",
        rdzv_configs={"store": store},
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
    # The agent turns these signals into SignalException while it runs (so that
    # Ctrl-C stops the workers) and leaves its handler installed: give the
    # caller's back, or a later Ctrl-C in the same kernel or test process would
    # no longer be a KeyboardInterrupt.
    handlers = ({sig: signal.getsignal(sig) for sig in _agent_signals()}
                if threading.current_thread() is threading.main_thread() else {})
    stopped = {}
    watchdog = stalls.Watchdog(
        None, None, ranks=lambda: stalls.labelled_children(run_id),
        on_stopped=lambda label, pid, stacks: stopped.update(
            label=label, pid=pid, stacks=stacks)).start()
    try:
        results = elastic_launch(config, _worker)(fn, kwargs, backend, timeout_s,
                                                  store.port, f"{run_id}/pg", fault)
    except Exception as err:
        if stopped:
            raise StoppedRankError(
                f"{stopped['label']} (pid {stopped['pid']}) was stopped while the "
                "other ranks waited for it in a collective; it was killed to end the "
                "run. "
                f"The stacks of every rank at that moment:\n{stopped['stacks']}"
            ) from err
        raise
    finally:
        watchdog.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        log.setLevel(level)
        if shared is None:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        else:
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = shared
    return [results[r] for r in range(world_size)]
