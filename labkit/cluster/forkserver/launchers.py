"""ipyparallel's local launchers, forking from the fork server instead of
starting new processes.

`LocalProcessLauncher.start` is copied here with the server's fork in place of
Popen; tests/test_forkserver.py notices when ipyparallel changes it.
"""

from __future__ import annotations

import logging
import os
import sys

from ipyparallel.cluster import launcher as _ipp

from .client import server

__all__ = ["ControllerLauncher", "EngineLauncher", "EngineSetLauncher"]


class _Forked(_ipp.LocalProcessLauncher):
    """LocalProcessLauncher.start with a fork of the server instead of Popen.

    A command that is not `<this python> -m <module> ...` is started as usual.
    """

    # The module whose engines take their nanny from the server (serve.NANNY).
    nanny_for: str | None = None

    def start(self) -> None:
        args = list(self.args)
        if args[:2] != [sys.executable, "-m"] or len(args) < 3:
            return super().start()
        if self.state != "before":
            raise _ipp.ProcessStateError(
                f"The process was already started and has state: {self.state}")
        import psutil

        # the kernel's environment as it is now: the fork takes all of it
        env = os.environ.copy()
        env.update(self.get_env())
        self.pid = server().fork(args[2], args[3:], env, self.work_dir,
                                 self.output_file, nanny=args[2] == self.nanny_for)
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        self._start_waiting()
        if 1 <= self.log.getEffectiveLevel() <= logging.DEBUG:
            self._start_streaming()


class ControllerLauncher(_Forked, _ipp.LocalControllerLauncher):
    """ipyparallel's local controller, forked from the server."""


class EngineLauncher(_Forked, _ipp.LocalEngineLauncher):
    """One ipyparallel engine, forked from the server with its nanny.

    labkit.cluster.engine takes the nanny's pipes; another engine command
    starts its own nanny.
    """

    nanny_for = "labkit.cluster.engine"


class EngineSetLauncher(_ipp.LocalEngineSetLauncher):
    """ipyparallel's local engines, each forked from the server (with no delay
    between them: labkit.cluster.engine.config)."""

    launcher_class = EngineLauncher
