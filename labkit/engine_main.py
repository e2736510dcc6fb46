"""How labkit.cluster starts its processes, and the engines' main.

The engine is ipyparallel's, with torch imported early.

Every rank needs torch, and importing it takes about 2 s here. Started in a
thread once ipyparallel's engine is imported, the import overlaps the engine's
registration with the controller instead of following it; the first task
that imports torch waits only for what is left of it.
"""

from __future__ import annotations

import threading

# Scheduler threads, not processes: 6 processes for 2 ranks instead of 13.
# The controller admits an engine at the heartbeat after its first answer;
# beating every 0.5 s instead of 3 s cuts about 4 s from a start (60 missed
# beats, 30 s, still make an engine dead, as 10 of 3 s do by default).
CONTROLLER_ARGS = ["--IPController.use_threads=True", "--HeartMonitor.period=500",
                   "--HeartMonitor.max_heartmonitor_misses=60"]


def config():  # -> traitlets.config.Config
    """ipyparallel's settings that make the engines run this module."""
    import sys

    from traitlets.config import Config

    config = Config()
    config.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-m",
                                                "labkit.engine_main"]
    return config


def main() -> None:
    """The engine process: ipyparallel's engine, torch imported in a thread."""
    # ipyparallel's own imports first: begun at the same time, the two imports
    # wait for each other on the modules both need (seen with py-spy), and
    # the engine registers later.
    from ipyparallel.engine.app import main as engine_main

    threading.Thread(target=__import__, args=("torch",), name="labkit-import-torch",
                     daemon=True).start()
    engine_main()


if __name__ == "__main__":
    main()
