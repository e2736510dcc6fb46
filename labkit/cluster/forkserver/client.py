"""The kernel's handle on its fork server: one server for each process, replaced
when it must be."""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping

__all__ = ["ANSWER_TIMEOUT_S", "IMPORT_TIME", "PRELOAD", "ForkServerError", "Server",
           "import_time_env", "pid", "server"]

# What the server imports, in order. The controller's module comes first: its
# fork starts while the server imports the rest. The engines need the others.
# torch._dynamo is what DDP's constructor imports, 1.5 s of a rank's first step
# here.
PRELOAD = ("ipyparallel.controller", "ipyparallel.controller.app",
           "ipyparallel.engine.app", "torch", "torch.distributed", "torch.nn.parallel",
           "torch._dynamo")

# How long a command may wait for the server: its first answer waits for the
# imports, a minute at most on a loaded 2-core machine.
ANSWER_TIMEOUT_S = 120.0

# The variables a fork cannot take from its request: those read before it was
# forked, by the interpreter and the dynamic loader when the server started
# (PYTHON*, LD_*), by the OpenMP and BLAS libraries torch and numpy load
# (OMP_*, GOMP_*, KMP_*, MKL_*, OPENBLAS_*), and by torch's modules when the
# server imported them (TORCH*, PYTORCH_*). A change to one of them needs a new
# server. Every other variable reaches the fork with its request, read from the
# kernel's environment when it asks (launchers.py); CUDA_* among them, which
# CUDA reads when a fork first uses it (the server never does). A few more
# libraries read a variable or two when imported (numpy's NPY_*, sympy's
# SYMPY_*): set those before the first start in a kernel.
IMPORT_TIME = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH",
               "PYTORCH_")


class ForkServerError(RuntimeError):
    """The fork server could not start or fork a process."""


def import_time_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that a server reads when it starts (IMPORT_TIME)."""
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME)}


class Server:
    """The kernel's handle on a fork server: one request at a time.

    Requests and answers travel over two pipes of their own; the server's
    stdout and stderr go to its log (`log_path`), which its errors quote.
    """

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.import_env = import_time_env(os.environ)
        # A process forked from the kernel (a DataLoader worker, a fork launcher's
        # rank) inherits this object; it must neither use nor stop the kernel's server.
        self.owner = os.getpid()
        self._lock = threading.Lock()
        self._stopped = False
        with tempfile.NamedTemporaryFile(prefix="labkit-forkserver-", suffix=".log",
                                         delete=False) as log:
            self.log_path = log.name
            requests, to_server = os.pipe()
            from_server, answers = os.pipe()
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", f"{__package__}.serve", str(requests),
                     str(answers), *preload],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    pass_fds=(requests, answers),
                    start_new_session=True)  # Ctrl-C in a terminal is for the kernel
            except BaseException:
                os.close(to_server)
                os.close(from_server)
                raise
            finally:
                os.close(requests)
                os.close(answers)
        self._requests = os.fdopen(to_server, "wb")
        self._answers = os.fdopen(from_server, "rb")

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, module: str, argv: list[str], env: dict[str, str], cwd: str,
             output_file: str, nanny: bool = False) -> int:
        """Fork a process that runs `python -m module *argv`; returns its pid.

        With `nanny`, also fork the nanny of the engine it is (serve.NANNY).
        A server that does not answer within ANSWER_TIMEOUT_S is stopped, and
        the next `server()` starts another.
        """
        request = {"module": module, "argv": argv, "env": env, "cwd": cwd,
                   "output_file": output_file, "nanny": nanny}
        with self._lock:
            try:
                self._requests.write(json.dumps(request).encode() + b"\n")
                self._requests.flush()
            except (OSError, ValueError):  # ValueError: stopped, its pipe closed
                raise self._failed("it is not running") from None
            ready, _, _ = select.select([self._answers], [], [], ANSWER_TIMEOUT_S)
            line = self._answers.readline() if ready else None
        if line is None:
            error = self._failed(f"it did not answer within {ANSWER_TIMEOUT_S:g} s")
            self._end()
            raise error
        if not line:
            error = self._failed("it ended")
            self._end()
            raise error
        answer = json.loads(line)
        if "error" in answer:
            error = self._failed(answer["error"])
            if answer.get("ending"):  # it cannot serve: the next start tries anew
                self._end()
            raise error
        return answer["pid"]

    def _failed(self, why: str) -> ForkServerError:
        """The error to raise, with the end of the server's log: read it before
        the server is stopped, which deletes the log."""
        try:
            with open(self.log_path, errors="replace") as f:
                log = f.read()[-2000:]
        except OSError:
            log = ""
        return ForkServerError(
            f"labkit's fork server (pid {self.pid}) could not start a process: "
            f"{why}." + (f" Its output:\n{log}" if log else ""))

    def _end(self) -> None:
        """Kill a server that cannot serve, and let the next `server()` replace it."""
        self.process.kill()
        self.stop()
        _forget(self)

    def stop(self) -> None:
        """End the server (closing its requests' pipe ends it); its forks live on.

        Stopping a stopped server does nothing.
        """
        if self._stopped:
            return
        self._stopped = True
        try:
            self._requests.close()
        except OSError:
            pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._answers.close()
        try:
            os.unlink(self.log_path)
        except FileNotFoundError:
            pass


_server: Server | None = None
_server_lock = threading.Lock()


def _mine() -> Server | None:
    """This process's server: not one inherited through a fork."""
    return _server if _server is not None and _server.owner == os.getpid() else None


def _forget(stopped: Server) -> None:
    global _server
    with _server_lock:
        if _server is stopped:
            _server = None


def server() -> Server:
    """This process's fork server, started on first use or when it must be replaced:
    it ended, or a variable read at import time (IMPORT_TIME) changed."""
    global _server
    with _server_lock:
        if _mine() is None:
            _server = None
        elif not (_server.alive()
                  and _server.import_env == import_time_env(os.environ)):
            _server.stop()
            _server = None
        if _server is None:
            _server = Server()
        return _server


def pid() -> int | None:
    """The pid of this process's fork server, if one is running."""
    mine = _mine()
    return mine.pid if mine is not None and mine.alive() else None


@atexit.register
def _stop_server() -> None:
    mine = _mine()
    if mine is not None:
        mine.stop()
