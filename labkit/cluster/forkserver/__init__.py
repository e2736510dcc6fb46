"""The controller and the engines, forked from one process that imported torch once.

Every rank needs torch, and a new Python process takes 2 s or more here to
import it, ipyparallel, and torch._dynamo (at its first DDP model): two
engines and a controller started as new processes took about 7 s from the
start asked for to a DDP model on both ranks (bench/README.md), while a
launcher that forks the kernel (Accelerate's, Lightning's ddp_notebook) finds
what the kernel has imported. Forking the kernel itself is not safe: it has
threads and sockets (ipykernel's), and a fork copies their state but not the
threads. So the first start in a kernel starts one more process, the fork
server: a fresh Python that imports torch and ipyparallel and then only waits,
with no thread of its own and no socket, for a command to fork. Each fork
becomes a controller or an engine, as if started by `python -m <module>`, in
milliseconds; every later start in the kernel (a restart after a failure
too) forks from the same server.

What stays as with new processes: each engine is its own process in its own
session (a learner can kill it; Ctrl-C in a terminal does not reach it), with
its output in ipyparallel's log file, and it ends with the kernel
(labkit.cluster.engine.end_with_kernel). The server ends when the process that
started it ends (its pipe of requests closes) or when it is orphaned, and is
replaced when it stops answering, or when a variable read at import time
(such as OMP_NUM_THREADS) changed in the kernel's environment.

The server refuses to fork while it has a Python thread besides its own: a
library it imported that started one is named in the error. numpy's OpenBLAS
(imported with torch) has a thread of its own too, outside Python; it stops it
at a fork and starts it again when needed. Seen here: a process with numpy had
2 threads, 1 right after a fork, and a matrix product ran in the fork.

Three modules: `serve` is the server's own process, `client` the kernel's
handle on it (`server()`), `launchers` ipyparallel's launchers that ask it for
forks. `usable()`, below, says where the server is not used: there
labkit.cluster.engine starts the ranks with ipyparallel's own launchers, as new
processes.
"""

from __future__ import annotations

import os
import sys

from .. import lazy_names
from .client import ForkServerError, Server, pid, server

__all__ = ["MACOS", "NO_FORK", "OFF", "VARIABLE", "ControllerLauncher",
           "EngineLauncher", "EngineSetLauncher", "ForkServerError", "Server", "pid",
           "server", "usable"]

# "0": start the ranks as new processes, on any system; "1": fork them, macOS
# too; unset: fork them wherever `usable()` finds nothing against it.
VARIABLE = "LABKIT_FORKSERVER"

# usable()'s answers: why the ranks start as new processes.
OFF, NO_FORK, MACOS = "off", "no-fork", "macos"


def usable() -> str | None:
    """Why labkit must start its ranks as new processes here; None where the fork
    server may fork them.

    OFF: LABKIT_FORKSERVER=0 asks for new processes. NO_FORK: this system has
    no os.fork (Windows). MACOS: macOS, where running code in a fork "is no
    longer reliable since macOS 10.14", as Python's multiprocessing says
    (bpo-33725) in choosing spawn as its default there; the server's forks run
    torch. LABKIT_FORKSERVER=1 forks there anyway (not tried: no Mac has run
    this course's tests). A value other than 0 or 1 raises ValueError; 1 where
    there is no os.fork raises ForkServerError.
    """
    value = os.environ.get(VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(
            f"{VARIABLE}={value!r}: set it to 0 (start the ranks as new processes) "
            "or 1 (fork them from labkit's fork server), or leave it unset")
    if value == "0":
        return OFF
    if not hasattr(os, "fork"):
        if value == "1":
            raise ForkServerError(
                f"{VARIABLE}=1 asks labkit to fork its ranks, but this system "
                f"({sys.platform}) has no os.fork: unset {VARIABLE} or set it to 0, "
                "and the ranks start as new processes")
        return NO_FORK
    if sys.platform == "darwin" and value != "1":
        return MACOS
    return None


# ipyparallel's launchers load on first use: the server's own process, which
# imports this package first, imports nothing but the standard library before
# its first module.
_LAUNCHERS = ("ControllerLauncher", "EngineLauncher", "EngineSetLauncher")


__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_LAUNCHERS, "launchers"))
