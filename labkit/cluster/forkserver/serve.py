"""The fork server's own process: import once, then fork on request.

    python -m labkit.cluster.forkserver.serve REQUESTS ANSWERS MODULE...

REQUESTS and ANSWERS are the fds of its two pipes to the kernel: one JSON
line each way per fork. Its stdout and stderr are its log, so that a library
that prints cannot garble an answer. It imports the MODULEs in turn while it
waits, the first of them before anything else: a request to run that one
(the controller) is served at once, every other after the last import.

This module and the package's __init__ import only the standard library at
their top: before its first module, the server imports only setproctitle.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading

__all__ = ["NANNY_FDS", "nanny_from_fds", "serve"]

# How often the server checks that the process that started it is alive.
ORPHAN_CHECK_S = 0.5


def _std_streams(unbuffered: bool) -> None:
    """sys.stdin, stdout and stderr on fds 0, 1 and 2, as a new interpreter has them.

    The server's own write to its log, perhaps with text still in their
    buffers; a fork must not write that to its own output.
    """
    import io

    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    out = io.FileIO(1, "w", closefd=False)
    sys.stdout = io.TextIOWrapper(out if unbuffered else io.BufferedWriter(out),
                                  write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")


def _become(request: dict, close: tuple[int, ...], stdin: int | None = None,
            stdout: int | None = None) -> None:
    """In a fork: run `python -m module *argv` as a new process would; never returns.

    Its stdin is /dev/null and its output goes to `output_file`, unless `stdin`
    or `stdout` name other fds; the fds in `close` are the server's pipes to
    the kernel and the other forks'.
    """
    import atexit as _atexit
    import runpy
    import traceback
    import warnings

    import setproctitle

    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server may ignore it
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


def _fork_with_nanny(request: dict, close: tuple[int, ...]) -> list[int]:
    """Fork the engine of `request` and its nanny; returns their pids, the engine's
    first."""
    to_nanny, from_engine = os.pipe()  # engine -> nanny: its arguments, pickled
    to_engine, from_nanny = os.pipe()  # nanny -> engine: its address; then kept open
    nanny_env = dict(request["env"], PYTHONUNBUFFERED="1")
    try:
        nanny = os.fork()
        if nanny == 0:
            _become(dict(request, module=NANNY, argv=[], env=nanny_env),
                    close=(*close, from_engine, to_engine), stdin=to_nanny,
                    stdout=from_nanny)
        request["env"][NANNY_FDS] = f"{from_engine},{to_engine}"
        engine = os.fork()
        if engine == 0:
            _become(request, close=(*close, to_nanny, from_nanny))
    finally:
        # closed here, a nanny whose engine never came reads the end of its
        # input and ends
        for fd in (to_nanny, from_engine, to_engine, from_nanny):
            os.close(fd)
    return [engine, nanny]


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


def _threads() -> str | None:
    """Why this process must not fork now, if it has threads other than this one.

    A fork copies only the thread that forks: a lock another thread holds at
    that moment (the import lock, logging's, a stream's) stays held in the
    fork, and the fork hangs on it. Threads that run no Python (numpy's
    OpenBLAS pool, which stops itself at a fork) are only counted.
    """
    python = threading.enumerate()
    if len(python) == 1:
        return None
    try:
        everyone = f"{len(os.listdir('/proc/self/task'))} threads in all"
    except FileNotFoundError:  # macOS: no /proc
        everyone = "the others not counted: this system has no /proc"
    return (f"it has {len(python)} Python threads "
            f"({', '.join(t.name for t in python)}; {everyone}), and a fork copies "
            "only the thread that forks: a lock another thread holds then (the "
            "import lock, a logging or stream lock) stays held in the fork, which "
            "hangs on it. Something the server imported started them")


class _Refused(Exception):
    """A request the server answers with this text, as it is."""


class _Preload:
    """The server's imports, one at a time; what failed, and the forks to reap."""

    def __init__(self, modules: list[str]) -> None:
        self.pending = list(modules)
        self.error: str | None = None
        # Forks end by themselves, and the kernel watches each by its pid. Once
        # the imports are done the server ignores SIGCHLD, and the system reaps
        # them; ignored before, a subprocess run by an import would read
        # return code 0 (ECHILD). Until then the server reaps its own forks.
        self.unreaped: set[int] = set()
        if not self.pending:
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)

    def next(self) -> None:
        import importlib
        import traceback

        try:
            importlib.import_module(self.pending.pop(0))
        except Exception as err:
            traceback.print_exc()  # into the log, which the kernel's error shows
            self.error = f"{type(err).__name__}: {err}"
            self.pending.clear()
        if not self.pending:
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        self.reap()

    def forked(self, pids: list[int]) -> None:
        if self.pending:
            self.unreaped.update(pids)

    def reap(self) -> None:
        for pid in list(self.unreaped):
            try:
                ended, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                ended = pid
            if ended:
                self.unreaped.discard(pid)


def serve(requests: int, answers: int, preload: list[str]) -> None:
    """The server's loop: import, then fork one process per request line.

    The imports run while no request waits, and all of them before any fork
    but one of the first module's. It returns when the kernel closes its end of
    the requests' pipe or dies, and after an import failed (the next server
    tries again).
    """
    import setproctitle

    # setproctitle finds the command line's memory from the environment's, so
    # it must look before anything changes the environment (torch's import, or
    # a fork's own).
    setproctitle.setproctitle(setproctitle.getproctitle())
    imports = _Preload(preload)
    if imports.pending:
        imports.next()
    early = preload[0] if preload else None
    parent = os.getppid()
    # Read a line at a time: the kernel sends one request and waits for its
    # answer, so nothing waits in this buffer while select() waits.
    reader = os.fdopen(requests, "rb")
    pipes = (requests, answers)
    while True:
        ready, _, _ = select.select([reader], [], [],
                                    0 if imports.pending else ORPHAN_CHECK_S)
        if os.getppid() != parent:  # the kernel died; its forks end by themselves
            return
        if not ready:
            if imports.pending:
                imports.next()
            continue
        line = reader.readline()
        if not line:  # the kernel closed the pipe: stopped, or gone
            return
        try:
            request = json.loads(line)
            while imports.pending and request["module"] != early:
                imports.next()
            if imports.error:
                raise _Refused(imports.error)
            refusal = _threads()
            if refusal:
                raise _Refused(refusal)
            if request.get("nanny"):
                pids = _fork_with_nanny(request, close=pipes)
            else:
                pids = [os.fork()]
                if pids[0] == 0:
                    _become(request, close=pipes)
            imports.forked(pids)
        except _Refused as err:
            answer = {"error": str(err)}
        except Exception as err:
            answer = {"error": f"{type(err).__name__}: {err}"}
        else:
            answer = {"pid": pids[0]}
        if imports.error:  # the kernel's next start gets a new server
            answer["ending"] = True
        sys.stdout.flush()  # what the imports printed, in the log the kernel may read
        os.write(answers, json.dumps(answer).encode() + b"\n")
        if imports.error:
            return


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
