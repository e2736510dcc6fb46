"""What a failure on the ranks says, and what it broke.

ipyparallel reports a failed call or `%%px` cell as a CompositeError: one
(name, value, traceback, info) entry per failed engine. From it, `failures`
makes each failed rank's message, and `damage` says what the group needs
before the next call: nothing after a plain error in a rank's code (a typo),
a reset of the process group after a failed or timed-out collective (the
ranks may be out of step), a restart after an engine died.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = ["RankError", "damage", "failures", "worse"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Words in the errors of a collective that failed or timed out. gloo raises a
# plain RuntimeError whose message starts with the C++ source of the error
# (".../gloo/transport/tcp/pair.cc:537] Read error ... Connection reset by
# peer" when a peer died, ".../unbound_buffer.cc:78] Timed out waiting 3000ms
# for recv" on a timeout: torch 2.13, seen in tests/test_cluster_failures.py),
# so the type alone cannot tell; torch's own DistBackendError and nccl's errors
# name themselves.
_COLLECTIVE_FAILURES = ("gloo", "Gloo", "NCCL", "Timed out", "timed out",
                        "Connection reset", "Connection closed", "monitoredBarrier",
                        "DistBackendError", "DistNetworkError", "ProcessGroup")
_SEVERITY = {None: 0, "reset": 1, "restart": 2}


class RankError(RuntimeError):
    """One or more ranks raised; names them and carries their tracebacks."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        ranks = ", ".join(str(r) for r in sorted(failures))
        details = "\n".join(f"--- rank {r} ---\n{tb}"
                            for r, tb in sorted(failures.items()))
        super().__init__(f"rank {ranks} raised an error:\n{details}")


def damage(elist: list[tuple]) -> str | None:
    """What the failures in a CompositeError's `elist` broke: "restart" (an
    engine process is gone), "reset" (a collective failed or timed out), or None
    (plain errors in the ranks' code, which break nothing)."""
    found = None
    for ename, evalue, _tb, _info in elist:
        if ename == "EngineError":
            return "restart"
        if any(word in f"{ename} {evalue}" for word in _COLLECTIVE_FAILURES):
            found = "reset"
    return found


def worse(a: str | None, b: str | None) -> str | None:
    """The more serious of two damages (a restart also resets)."""
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def failures(elist: list[tuple], rank_of: Callable[[int | None], int]
             ) -> dict[int, str]:
    """Each failed rank's traceback, without colours, or how its engine died.

    `rank_of` maps an engine id to its rank.
    """
    out = {}
    for ename, evalue, tb, info in elist:
        rank = rank_of(info.get("engine_id"))
        if ename == "EngineError":  # the engine process itself is gone
            dead = re.search(r"Engine (\d+) died", str(evalue))
            if dead:
                rank = rank_of(int(dead.group(1)))
            out[rank] = f"rank {rank}'s process died: {evalue}"
            continue
        text = tb if tb else f"{ename}: {evalue}"
        out[rank] = _ANSI.sub("", text if isinstance(text, str) else "\n".join(text))
    return out
