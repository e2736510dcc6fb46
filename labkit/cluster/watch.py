"""Watching the notebook's ranks while a call or a cell runs.

A rank that is stopped (SIGSTOP, Ctrl-Z, a debugger) never fails by itself:
the others would wait for it until their collective's timeout. While a call
or a cell runs, a labkit.cluster.stalls.Watchdog looks at the engines: a
stopped one is killed and named, and past `stall_s` the stacks of the kernel
and of every rank are printed. Calls nest (a `ranks.run` inside a watched
cell): only the outermost one watches.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from . import stalls

__all__ = ["RankWatch"]


class RankWatch:
    """The watchdogs of one group of ranks, one per nesting level at most."""

    def __init__(self, pids: Callable[[], list[int]], on_stopped: Callable[[], None]):
        self._pids = pids  # the engines' pids, in rank order, as they are now
        self._on_stopped = on_stopped
        # What happened to each rank found stopped, for the failure's report.
        self.stopped: dict[int, str] = {}
        self._levels: list[stalls.Watchdog | None] = []

    @property
    def depth(self) -> int:
        """How many calls and cells are being watched, nested."""
        return len(self._levels)

    def push(self, what: str, stall_s: float | None) -> None:
        """Watch until the matching `pop`, unless an outer level already does."""
        if self._levels:
            self._levels.append(None)
            return
        self.stopped.clear()

        def ranks() -> dict[str, int]:
            return {f"rank {r}": pid for r, pid in enumerate(self._pids())}

        def report(elapsed_s: float) -> None:
            print(f"labkit: {what} is still running after {elapsed_s:.0f} s; the "
                  "stacks of the kernel and of every rank:\n"
                  + stalls.stacks_report(ranks(), me="kernel"), file=sys.stderr,
                  flush=True)

        def on_stopped(label: str, pid: int, stacks: str) -> None:
            rank = int(label.split()[1])
            self.stopped[rank] = (
                f"{label} (pid {pid}) was stopped (SIGSTOP, Ctrl-Z or a debugger) "
                "while the other ranks waited for it; labkit killed it so that they "
                "do not wait until their timeout, and the next call starts fresh "
                f"ranks. The stacks of every rank just before:\n{stacks}")
            self._on_stopped()
            print(f"labkit: {self.stopped[rank]}", file=sys.stderr, flush=True)

        self._levels.append(stalls.Watchdog(stall_s, report, ranks=ranks,
                                            on_stopped=on_stopped).start())

    def pop(self) -> None:
        if self._levels:
            watchdog = self._levels.pop()
            if watchdog is not None:
                watchdog.stop()

    def stop(self) -> None:
        """Stop watching at every level."""
        while self._levels:
            self.pop()
