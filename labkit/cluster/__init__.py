"""The ranks: processes that each run one rank of a process group.

Which launcher, for what:

=======================  ======================================================
module                   starts the ranks
=======================  ======================================================
``cluster/ranks.py``     in a notebook, as ipyparallel engines: ``%%px`` cells
                         run on every rank
``cluster/launch.py``    from the command line, with torch's elastic launcher,
                         or joins the ranks torchrun started
``cluster/torchrun.py``  as torchrun nodes, several simulated on one machine;
                         and the job scripts that run torchrun on a cluster
=======================  ======================================================

In a notebook, `cluster.start(2)` launches two ipyparallel engines on
127.0.0.1, makes engine i rank i and joins them in one gloo process group:
`%%px` cells then run on every rank, and `ranks.run(fn)` calls a function on
every rank (labkit.cluster.ranks). The ranks meet through
labkit.cluster.rendezvous, watch for stalls with labkit.cluster.stalls, and
report failures with labkit.cluster.failures.

The controller and the engines start one of two ways (forkserver.usable
decides; the first start without forks says why, in the lesson's language):

- forked from a process that imported torch once (labkit.cluster.forkserver),
  on Linux and wherever labkit may fork;
- as new processes, by ipyparallel's own launchers (LocalControllerLauncher,
  LocalEngineSetLauncher), each importing torch itself: on Windows (no
  os.fork), on macOS (where a fork is not reliable; LABKIT_FORKSERVER=1 forks
  there anyway), and anywhere with LABKIT_FORKSERVER=0.

What each costs, from the start asked for to a DDP model built on 2 ranks
(bench/start_phases.py, both ways, on this project's 2-core Linux machine):
forked, 4.5-6 s for a kernel's first start (the fork server imports torch)
and 1-2 s for each later one, a restart after a failure too; as new
processes, 9-13 s every time, each engine importing torch, then torch._dynamo
at its first DDP model (run twice each way, in turns, 2026-12-03). Only Linux
has run either here.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["ENGINE_BACKEND", "RankError", "Ranks", "current", "start"]

# The engines run `python -m labkit.cluster.engine`, which imports this package
# first. Importing ranks here would import torch before ipyparallel (engine.py
# says why that order matters) and engine.py before runpy runs it as __main__.
# So these names load on first use.
_HOMES = {"ENGINE_BACKEND": "ranks", "Ranks": "ranks", "current": "ranks",
          "start": "ranks", "RankError": "failures"}


def lazy_names(package: str, homes: dict[str, str]):
    """A package's `__getattr__` and `__dir__` for names that load on first use:
    `homes` maps each name to the submodule of `package` that defines it."""

    def __getattr__(name: str):
        if name in homes:
            return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *homes])

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
