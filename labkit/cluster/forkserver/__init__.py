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
forks.
"""

from __future__ import annotations

from .. import lazy_names
from .client import ForkServerError, Server, pid, server

__all__ = ["ControllerLauncher", "EngineLauncher", "EngineSetLauncher",
           "ForkServerError", "Server", "pid", "server"]

# ipyparallel's launchers load on first use: the server's own process, which
# imports this package first, imports nothing but the standard library before
# its first module.
_LAUNCHERS = ("ControllerLauncher", "EngineLauncher", "EngineSetLauncher")


__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(_LAUNCHERS, "launchers"))
