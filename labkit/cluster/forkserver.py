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
started it ends (its stdin closes) or when it is orphaned, and is replaced
when the environment it was started with changed (variables such as
OMP_NUM_THREADS are read when torch is imported).

numpy's OpenBLAS (imported with torch) has a thread of its own; it stops it
at a fork and starts it again when needed. Seen here: a process with numpy
had 2 threads, 1 right after a fork, and a matrix product ran in the fork.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

__all__ = ["ControllerLauncher", "EngineSetLauncher", "ForkServerError", "pid",
           "server", "serve"]

# What the controller needs, imported first: its fork starts while the server
# imports the rest.
CONTROLLER = "ipyparallel.controller"
# What the engines need, imported once in the server. torch._dynamo is what
# DDP's constructor imports, 1.5 s of a rank's first step here.
PRELOAD = ("ipyparallel.controller.app", "ipyparallel.engine.app", "torch",
           "torch.distributed", "torch.nn.parallel", "torch._dynamo")

# How long a command may wait for the server: its first answer waits for the
# imports, a minute at most on a loaded 2-core machine.
ANSWER_TIMEOUT_S = 120.0
# How often the server checks that the process that started it is alive.
ORPHAN_CHECK_S = 0.5


class ForkServerError(RuntimeError):
    """The fork server could not start or fork a process."""


class Server:
    """The kernel's handle on its fork server: one request at a time."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        # A process forked from the kernel (a DataLoader worker, a fork launcher's
        # rank) inherits this object; it must neither use nor stop the kernel's server.
        self.owner = os.getpid()
        self._log = tempfile.NamedTemporaryFile(prefix="labkit-forkserver-",
                                                suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, env=self.env,
            start_new_session=True)  # Ctrl-C in a terminal is for the kernel only
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, module: str, argv: list[str], env: dict[str, str], cwd: str,
             output_file: str, nanny: bool = False) -> int:
        """Fork a process that runs `python -m module *argv`; returns its pid.

        With `nanny`, also fork the nanny of the engine it is (see NANNY).
        """
        request = {"module": module, "argv": argv, "env": env, "cwd": cwd,
                   "output_file": output_file, "nanny": nanny}
        with self._lock:
            try:
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
            except OSError:
                raise self._failed("it is not running") from None
            ready, _, _ = select.select([self.process.stdout], [], [], ANSWER_TIMEOUT_S)
            if not ready:
                self.stop()
                raise self._failed(f"it did not answer within {ANSWER_TIMEOUT_S:g} s")
            line = self.process.stdout.readline()
        if not line:
            raise self._failed("it ended")
        answer = json.loads(line)
        if "error" in answer:
            raise self._failed(answer["error"])
        return answer["pid"]

    def _failed(self, why: str) -> ForkServerError:
        self._log.flush()
        with open(self._log.name, errors="replace") as f:
            log = f.read()[-2000:]
        return ForkServerError(
            f"labkit's fork server (pid {self.pid}) could not start a process: "
            f"{why}." + (f" Its output:\n{log}" if log else ""))

    def stop(self) -> None:
        """End the server (closing its stdin ends it); its forks live on."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self._log.close()
        os.unlink(self._log.name)


_server: Server | None = None
_server_lock = threading.Lock()


def _mine() -> Server | None:
    """This process's server: not one inherited through a fork."""
    return _server if _server is not None and _server.owner == os.getpid() else None


def server() -> Server:
    """This process's fork server, started on first use or when it must be replaced."""
    global _server
    with _server_lock:
        if _mine() is None:
            _server = None
        elif not (_server.alive() and _server.env == os.environ):
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
    if _mine() is not None:
        _server.stop()


# --- ipyparallel's launchers, forking instead of starting new processes ---------

from ipyparallel.cluster import launcher as _ipp  # noqa: E402
from traitlets import default  # noqa: E402


class _Forked(_ipp.LocalProcessLauncher):
    """LocalProcessLauncher.start with a fork of the server instead of Popen.

    A command that is not `<this python> -m <module> ...` is started as usual.
    """

    # The module whose engines take their nanny from the server (see NANNY).
    nanny_for: str | None = None

    def start(self) -> None:
        args = list(self.args)
        if args[:2] != [sys.executable, "-m"] or len(args) < 3:
            return super().start()
        if self.state != "before":
            raise _ipp.ProcessStateError(
                f"The process was already started and has state: {self.state}")
        import psutil

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
    """ipyparallel's local engines, each forked from the server."""

    launcher_class = EngineLauncher

    @default("delay")
    def _no_delay(self) -> float:
        # ipyparallel waits 0.1 s between engines to help them take their ids in
        # order; labkit orders the ranks by engine id, whatever the order.
        return 0.0


# --- the server ------------------------------------------------------------------

def _std_streams(unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr on fds 0, 1 and 2, as a new interpreter has them.

    The server's own are buffered pipes to the kernel; a fork must not write
    through them.
    """
    import io

    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    out = io.FileIO(1, "w", closefd=False)
    sys.stdout = io.TextIOWrapper(out if unbuffered else io.BufferedWriter(out),
                                  write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")


def _become(request: dict, stdin: int | None = None, stdout: int | None = None,
            close: tuple[int, ...] = ()) -> None:
    """In a fork: run `python -m module *argv` as a new process would; never returns.

    Its stdin is /dev/null and its output goes to `output_file`, unless `stdin`
    or `stdout` name other fds; the fds in `close` are the other forks'.
    """
    import atexit as _atexit
    import runpy
    import traceback
    import warnings

    import setproctitle

    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it
        signal.signal(signal.SIGINT, signal.default_int_handler)  # interrupts
        for fd in close:
            os.close(fd)
        out = os.open(request["output_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                      0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null if stdin is None else stdin, 0)
        os.dup2(out if stdout is None else stdout, 1)
        os.dup2(out, 2)
        for fd in {out, null, stdin, stdout} - {None, 0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _std_streams(bool(os.environ.get("PYTHONUNBUFFERED")))
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        sys.argv = [request["module"], *request["argv"]]
        # ps, top and py-spy show the command it stands for, not the server's
        setproctitle.setproctitle(" ".join([sys.executable, "-m", request["module"],
                                            *request["argv"]]))
        with warnings.catch_warnings():
            # the server imported the module already (the nanny's): runpy warns
            # that it runs a second copy as __main__, as `python -m` does anyway
            warnings.filterwarnings("ignore", "'.*' found in sys.modules",
                                    RuntimeWarning)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            _atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


# An ipyparallel engine starts a nanny process (python -m ipyparallel.engine.nanny):
# it relays signals to the engine (an interrupt) and tells the controller at once
# when the engine ends. As a new process it took 0.5 s of each engine's start. The
# server forks it beside the engine, joined by two pipes, as Popen would have
# joined them, and the engine's start_nanny uses those (see `nanny_from_fds`).
NANNY = "ipyparallel.engine.nanny"
NANNY_FDS = "LABKIT_NANNY_FDS"


def _fork_with_nanny(request: dict) -> int:
    """Fork the engine of `request` and its nanny; returns the engine's pid."""
    to_nanny, from_engine = os.pipe()  # engine -> nanny: its arguments, pickled
    to_engine, from_nanny = os.pipe()  # nanny -> engine: its address; then kept open
    nanny_env = dict(request["env"], PYTHONUNBUFFERED="1")
    try:
        if os.fork() == 0:
            _become(dict(request, module=NANNY, argv=[], env=nanny_env),
                    stdin=to_nanny, stdout=from_nanny, close=(from_engine, to_engine))
        request["env"][NANNY_FDS] = f"{from_engine},{to_engine}"
        pid = os.fork()
        if pid == 0:
            _become(request, close=(to_nanny, from_nanny))
    finally:
        # closed here, a nanny whose engine never came reads the end of its
        # input and ends
        for fd in (to_nanny, from_engine, to_engine, from_nanny):
            os.close(fd)
    return pid


def nanny_from_fds(**kwargs):
    """In an engine the server forked: ipyparallel's start_nanny, on the given pipes.

    Returns what ipyparallel's does: the nanny's address, and a handle the
    engine keeps (the nanny ends when the engine's end of the pipe closes).
    """
    import pickle

    to_nanny, from_nanny = (int(fd) for fd in os.environ.pop(NANNY_FDS).split(","))
    kwargs["pid"] = os.getpid()
    with os.fdopen(to_nanny, "wb") as f:
        pickle.dump(kwargs, f)
    pipe = os.fdopen(from_nanny, "rb")
    url = pipe.readline().decode().strip()
    if not url:
        raise RuntimeError("nanny failed")
    return url, pipe


def serve() -> None:
    """The server's loop: import once, then fork one process per request line.

    The imports run while no request waits, and all of them before any fork
    that is not the controller.
    """
    import importlib

    import setproctitle

    # setproctitle finds the command line's memory from the environment's, so
    # it must look before anything changes the environment (torch's import, or
    # a fork's own).
    setproctitle.setproctitle(setproctitle.getproctitle())
    pending = list(PRELOAD)
    importlib.import_module(pending.pop(0))
    # Forks end by themselves; ignoring SIGCHLD lets the system reap them, and the
    # kernel watches each by its pid.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    parent = os.getppid()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        ready, _, _ = select.select([stdin], [], [], 0 if pending else ORPHAN_CHECK_S)
        if os.getppid() != parent:  # the kernel died; its forks end by themselves
            return
        if not ready:
            if pending:
                importlib.import_module(pending.pop(0))
            continue
        line = stdin.readline()
        if not line:  # the kernel closed our stdin: stopped, or gone
            return
        try:
            request = json.loads(line)
            while pending and request["module"] != CONTROLLER:
                importlib.import_module(pending.pop(0))
            if request.get("nanny"):
                pid = _fork_with_nanny(request)
            else:
                pid = os.fork()
                if pid == 0:
                    _become(request)
        except Exception as err:
            answer = {"error": f"{type(err).__name__}: {err}"}
        else:
            answer = {"pid": pid}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    serve()
