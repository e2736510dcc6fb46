"""Ranks as ipyparallel engines: starting, calling, watching and repairing them.

`start(2)` launches two engine processes on 127.0.0.1, makes engine i rank i,
and joins them in one gloo process group, on any machine: the notebooks' `%%px`
cells build their models and tensors on the CPU, which nccl cannot take. GPUs
are for the command line (`torchrun ... -m labkit nosync --backend nccl`).
In the notebook, `%%px` cells then run on every rank and show each rank's
output and traceback; from Python, `ranks.run(fn, ...)` calls a function on
every rank and returns the results in rank order. Engines stop with the
kernel, or with `ranks.stop()`.

The engines are forked from labkit's fork server where it can be used, or
started as new processes (labkit.cluster.forkserver.usable says which; the
first start without it says why, and what it costs).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field

from .. import i18n
from ..i18n import t
from . import engine, failures, forkserver, notebook, rendezvous
from .cpus import usable_cpus
from .failures import RankError
from .watch import RankWatch

__all__ = ["ENGINE_BACKEND", "RankError", "Ranks", "current", "start"]

i18n.register({
    # Said once, at the first start without the fork server. The seconds are
    # bench/start_phases.py's, run both ways here, twice each in turns
    # (Linux, 2 cores, 2026-12-03; others' jobs running).
    "ranks_new_processes": {
        "ja": "labkit: ランクは fork サーバーから fork せず、新しいプロセスとして"
              "起動します ({why})。各ランクが torch を読み込み直すので、起動のたびに"
              "時間がかかります (2 コアの Linux マシンで、2 ランクが DDP のモデルを"
              "作れるまで毎回 9〜13 秒。fork サーバーではカーネルで最初の起動が "
              "4.5〜6 秒、2 回目からは 1〜2 秒)。",
        "en": "labkit: the ranks start as new processes, not forked from the fork "
              "server ({why}). Every start takes longer, since each rank imports "
              "torch anew (on a 2-core Linux machine, 9–13 s each time until 2 ranks "
              "have built a DDP model; with the fork server, 4.5–6 s for a kernel's "
              "first start and 1–2 s for each later one).",
    },
    "ranks_why_off": {
        "ja": "LABKIT_FORKSERVER=0 が設定されています",
        "en": "LABKIT_FORKSERVER=0 is set",
    },
    "ranks_why_no_fork": {
        "ja": "このシステム ({system}) には os.fork がありません",
        "en": "this system ({system}) has no os.fork",
    },
    "ranks_why_macos": {
        "ja": "macOS では fork したプロセスで実行するコードが確実には動きません。"
              "LABKIT_FORKSERVER=1 にすると、それでも fork します",
        "en": "on macOS, code run in a forked process is not reliable; "
              "LABKIT_FORKSERVER=1 forks anyway",
    },
})

# Whether this process has said why its ranks are new processes.
_said_why = False


def _say_why_not_forked(why: str) -> None:
    """Print, once in this process, why the ranks start as new processes and what
    that costs (forkserver.usable's reason `why`)."""
    global _said_why
    if _said_why:
        return
    _said_why = True
    if why == forkserver.OFF:
        reason = t("ranks_why_off")
    elif why == forkserver.NO_FORK:
        reason = t("ranks_why_no_fork", system=sys.platform)
    else:
        reason = t("ranks_why_macos")
    # stderr, as labkit's other notes on the ranks: a program's output (a
    # script that prints JSON) stays its own
    print(t("ranks_new_processes", why=reason), file=sys.stderr, flush=True)


# The backend of the notebooks' ranks, also on a machine with GPUs: the lessons'
# %%px cells put models and tensors on the CPU, and nccl takes CUDA tensors only.
# The mechanism they teach is the same on every backend.
ENGINE_BACKEND = "gloo"

# A cell or call on the ranks still running after this many seconds prints the
# stacks of the kernel and of every rank (labkit.cluster.stalls): the slowest
# lesson cell took 38 s here with another suite running. LABKIT_STALL_S changes
# it; 0: off.
STALL_S = float(os.environ.get("LABKIT_STALL_S", 120)) or None

@dataclass
class Ranks:
    """A running group of engines, one per rank."""

    world_size: int
    backend: str
    timeout_s: float
    threads_per_rank: int
    task_timeout_s: float | None = None
    activate: bool = True
    port: int = 0
    cluster: object = field(default=None, repr=False)
    client: object = field(default=None, repr=False)
    view: object = field(default=None, repr=False)
    store: object = field(default=None, repr=False)
    generation: int = 0
    _activated: bool = field(default=False, repr=False)
    # What the last failure left behind: "reset" (the process group may be out
    # of step) or "restart" (an engine is gone). The next call repairs it.
    damage: str | None = None
    # Each failed rank's traceback from the last `%%px` cell, if it failed: a
    # lesson's next cell asserts what failed, and where. Every %%px cell resets it.
    last_failure: dict[int, str] | None = field(default=None, repr=False)
    # The engines' pids, in rank order; watched while a call or cell runs.
    pids: list = field(default_factory=list, repr=False)
    stall_s: float | None = STALL_S
    # Watched while a call or cell runs (labkit.cluster.watch).
    watch: RankWatch = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.watch = RankWatch(lambda: self.pids, self._stopped_rank_killed)

    def _stopped_rank_killed(self) -> None:
        self.damage = "restart"

    def run(self, fn, *args, **kwargs) -> list:
        """Call `fn(*args, **kwargs)` on every rank; results in rank order."""
        self.wait()
        self._repair()
        return self._gather(self.view.apply_async(fn, *args, **kwargs))

    def execute(self, code: str) -> None:
        """Run `code` on every rank, like a `%%px` cell, and show its output."""
        self.wait()
        self._repair()
        result = self.view.execute(code, block=False)
        try:
            self._gather(result)
        finally:
            result.display_outputs()

    def pull(self, name: str) -> list:
        """The value of `name` in every rank's namespace, in rank order."""
        self.wait()
        self._repair()
        return self._gather(self.view.pull(name, block=False))

    def _gather(self, result) -> list:
        """Wait for every rank; turn any failure into a RankError naming ranks."""
        self.watch.push("this call", self.stall_s)
        try:
            return self._wait_for(result)
        finally:
            self.watch.pop()

    def _wait_for(self, result) -> list:
        import ipyparallel as ipp

        try:
            if not result.wait(self.task_timeout_s):
                stuck = self._unfinished(result)
                refused = self._interrupt(result, stuck)
                found = self._failures(result)
                for r in stuck:
                    note = (f"rank {r} did not finish within {self.task_timeout_s:g} s "
                            + ("and was interrupted (hung?)" if refused is None
                               else f"(hung?) and {refused}"))
                    found[r] = note + ("\n" + found[r] if r in found else "")
                self.damage = failures.worse(self.damage, "reset")
                raise RankError(found)
            return result.get()
        except KeyboardInterrupt:
            # The learner pressed stop: stop the ranks too, not just the wait.
            refused = self._interrupt(result, self._unfinished(result))
            if refused is not None:
                print(f"labkit: the ranks {refused}", file=sys.stderr, flush=True)
            self.damage = failures.worse(self.damage, "reset")
            raise
        except ipp.error.CompositeError as err:
            raise RankError(self._failures(result, err)) from None

    def _failures(self, result, err=None) -> dict[int, str]:
        """Each failed rank's message (labkit.cluster.failures); notes the damage."""
        import ipyparallel as ipp

        if err is None:
            try:
                result.get(timeout=0)
                return {}
            except ipp.error.CompositeError as e:
                err = e
            except Exception:  # still running, or a single engine's error
                return {}
        self.note_damage(err)
        found = failures.failures(err.elist, self._rank_of)
        for rank, note in self.watch.stopped.items():  # why that rank's process died
            found[rank] = note + ("\n" + found[rank] if rank in found else "")
        return found

    def note_damage(self, err) -> None:
        """Remember what a CompositeError broke; the next call repairs it."""
        self.damage = failures.worse(self.damage, failures.damage(err.elist))

    def _unfinished(self, result) -> list[int]:
        done = {self._rank_of(md.get("engine_id")) for md in result._metadata
                if md.get("completed")}
        return [r for r in range(self.world_size) if r not in done]

    def _interrupt(self, result, ranks: list[int]) -> str | None:
        """SIGINT the engines of `ranks`, and give them a moment to stop.

        Where the signal cannot be sent (Windows: the engine's nanny sends it with
        psutil, which refuses SIGINT there), the engines are restarted at the next
        call instead, since a rank stuck outside a collective never times out;
        returns what the learner is told then.
        """
        targets = [self.view.targets[r] for r in ranks]
        if targets:
            try:
                self.client.send_signal(signal.SIGINT, targets=targets, block=True)
            except Exception as err:  # the nanny's error, re-raised here
                self.damage = failures.worse(self.damage, "restart")
                why = str(err).strip().splitlines()[-1] if str(err).strip() else ""
                return ("could not be interrupted: this system does not let one "
                        f"process send SIGINT to another ({type(err).__name__}: "
                        f"{why}); fresh ranks replace them at the next call")
        result.wait(self.timeout_s + 5)  # a rank inside a collective returns late
        return None

    def _rank_of(self, engine_id) -> int:
        ids = list(self.view.targets)
        return ids.index(engine_id) if engine_id in ids else -1

    def _repair(self) -> None:
        """Make the group usable again after a failure: reset it, or restart it."""
        damage, self.damage = self.damage, None
        if damage == "reset":
            try:
                self.reset_process_group()
                return
            except RankError:
                damage = "restart"
        if damage == "restart":
            self.restart()

    def reset_process_group(self) -> None:
        """Destroy and re-create the process group on the same engines."""
        self._gather(self.view.apply_async(engine.leave_group))
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
                engine.setup_rank, rank, self.world_size, self.backend, port,
                prefix, self.timeout_s, self.threads_per_rank, kernel, controller,
                i18n.get_lang())
            for rank, eid in enumerate(self.view.targets)
        ]
        found, pids = {}, []
        for rank, result in enumerate(pending):
            try:
                pids.append(result.get(
                    timeout=max(self.timeout_s, rendezvous.JOIN_TIMEOUT_S) + 30))
            except Exception as err:  # report every rank, not only the first
                found[rank] = "".join(traceback.format_exception_only(err))
        if found:
            raise RankError(found)
        self.pids = pids

    def _launch(self) -> None:
        """Start the engines and join them in a new process group."""
        self.cluster = engine.new_cluster(self.world_size)
        try:
            self.client = self.cluster.start_and_connect_sync()
            self.client.wait_for_engines(self.world_size, timeout=60)
            self.view = self.client[sorted(self.client.ids)[: self.world_size]]
            self.view.block = True
            self.store = rendezvous.local_store(self.timeout_s, self.port)
            self._join()
        except BaseException:
            self._shutdown()
            raise

    def _launch_in_background(self) -> None:
        """Launch in a thread; `wait()` (and every call) waits for it."""
        self._starting = threading.Thread(target=self._launch_recording_errors,
                                          name="labkit-start-ranks", daemon=True)
        self._starting.start()

    def _launch_recording_errors(self) -> None:
        try:
            self._launch()
        except BaseException as err:  # re-raised in the kernel's thread by wait()
            self._start_error = err

    def wait(self) -> Ranks:
        """Wait until the ranks are up (after a background start); returns self."""
        starting = getattr(self, "_starting", None)
        if starting is not None:
            starting.join()
            self._starting = None
            err, self._start_error = getattr(self, "_start_error", None), None
            if err is not None:
                raise err
        if self.view is None:
            raise RuntimeError("these ranks were stopped; start them again with "
                               "cluster.start() or ranks.restart()")
        if self.activate and not self._activated:
            self.view.activate()  # in the kernel's thread, where magics live
            self._activated = True
        return self

    @property
    def ready(self) -> bool:
        """True once the ranks are up (always, unless started in the background)."""
        starting = getattr(self, "_starting", None)
        return self.view is not None and (starting is None or not starting.is_alive())

    def _shutdown(self) -> None:
        self.watch.stop()
        try:
            if self.client is not None:
                self.client.close()
        finally:
            if self.cluster is not None:
                self.cluster.stop_cluster_sync()
            self.cluster = self.client = self.view = self.store = None

    def stop(self) -> None:
        """Stop the engines and free the rendezvous port."""
        global _current
        starting = getattr(self, "_starting", None)
        if starting is not None:
            starting.join()  # never stop halfway through a start
            self._starting = None
        self._shutdown()
        if _current is self:
            _current = None

    def restart(self) -> Ranks:
        """Replace every engine with a fresh one, same settings; returns self."""
        global _current
        watched = self.watch.depth
        self._shutdown()
        self.generation, self.damage, self._activated = 0, None, False
        self._launch()
        _current = self
        for _ in range(watched):  # a cell that repairs its ranks stays watched
            self.watch.push("this cell", self.stall_s)
        return self.wait()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_current: Ranks | None = None


def current() -> Ranks | None:
    """The running group started by `start`, if any."""
    return _current


def _check_engine_backend(backend: str) -> None:
    """Refuse nccl for the engines, saying why and what to run instead."""
    if backend == "nccl":
        raise ValueError(
            "the notebook's ranks use backend 'gloo', also where there are GPUs: the "
            "%%px cells build their models and tensors on the CPU, and nccl takes CUDA "
            "tensors only. For DDP on GPUs, one GPU per rank, run the command line: "
            "torchrun --nproc-per-node N -m labkit nosync --backend nccl")


def start(world_size: int = 2, backend: str = ENGINE_BACKEND, *,
          timeout_s: float = 20.0, threads_per_rank: int | None = None,
          task_timeout_s: float | None = None,
          activate: bool = True, port: int = 0, background: bool = False) -> Ranks:
    """Start `world_size` engines on 127.0.0.1 and join them in a process group.

    The backend is gloo on every machine (nccl is refused: the cells' tensors
    are on the CPU; see ENGINE_BACKEND).
    A group already running in this kernel is stopped first, so running the
    cell again never leaves engines behind. `timeout_s` bounds every
    collective: a rank that never arrives raises instead of hanging.
    `task_timeout_s` bounds each `run`/`execute`/`pull`: ranks still busy then
    are interrupted and named. With `activate`, `%%px` cells run on these ranks.
    `port` 0 lets the system pick the rendezvous port (nothing can race for it).
    With `background`, return at once and start the engines in a thread, so
    a lesson can be read while they boot; the first use waits for them.
    """
    global _current
    _check_engine_backend(backend)
    # A port this kernel's running group holds is free once it stops (below).
    ours = _current is not None and _current.port == port
    rendezvous.check_args(world_size, backend, 0 if ours else port)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if task_timeout_s is not None and task_timeout_s <= 0:
        raise ValueError(f"task_timeout_s must be > 0, got {task_timeout_s}")
    if threads_per_rank is None:
        threads_per_rank = max(1, usable_cpus() // world_size)
    if threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank}")
    # A wrong LABKIT_FORKSERVER fails here, before any process starts.
    why = forkserver.usable()
    if why is not None:
        _say_why_not_forked(why)
    if _current is not None:
        _current.stop()
    ranks = Ranks(world_size, backend, timeout_s, threads_per_rank, task_timeout_s,
                  activate, port)
    _current = ranks
    notebook.install_hooks(current)
    if background:
        ranks._launch_in_background()
        return ranks
    try:
        ranks._launch()
    except BaseException:
        _current = None
        raise
    return ranks.wait()
