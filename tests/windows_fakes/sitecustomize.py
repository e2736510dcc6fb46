"""Windows, as far as labkit meets it, in every Python process started with this
folder on PYTHONPATH (ipyparallel's engines and nannies, torchrun's agents and
workers, a notebook's kernel).

LABKIT_FAKE_WINDOWS names the conditions, comma-separated:
- libuv: torch built without libuv, as its Windows wheels are: a TCPStore that
  asks for it raises torch's own error.
- ifnames: socket.if_nameindex() gives Windows' names ("loopback_0"), which no
  gloo transport knows an interface by.
- sigint: psutil refuses every signal but SIGTERM, as on Windows.
- fork: no os.fork, and multiprocessing spawns.
- sigusr1: no SIGUSR1 and no faulthandler.register.
- cp932: standard output and error in cp932, as a Japanese Windows Python writes
  to a pipe or a file (strict: what cp932 lacks raises).
- nobash: no bash on PATH, and starting one fails as on a stock Windows.
"""

import importlib.abc
import importlib.util
import os
import sys

FAKES = set(filter(None, os.environ.get("LABKIT_FAKE_WINDOWS", "").split(",")))
NO_LIBUV = ("use_libuv was requested but PyTorch was built without libuv support, "
            "run with USE_LIBUV=0 to disable it.")


def _no_libuv(dist) -> None:
    """Make dist.TCPStore, and every name torch bound it to, refuse libuv."""
    real = dist.TCPStore

    class TCPStore(real):
        def __init__(self, *args, **kwargs):
            if (args[8] if len(args) > 8 else kwargs.get("use_libuv", True)):
                raise dist.DistStoreError(NO_LIBUV)
            super().__init__(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, "TCPStore",
                                                             None) is real:
            module.TCPStore = TCPStore


class _AfterTorchDistributed(importlib.abc.MetaPathFinder):
    """Runs _no_libuv once torch.distributed has been imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _no_libuv(module)

        spec.loader.exec_module = exec_module
        return spec


if "libuv" in FAKES:
    sys.meta_path.insert(0, _AfterTorchDistributed())

if "ifnames" in FAKES:
    import socket

    socket.if_nameindex = lambda: [(1, "loopback_0"), (2, "ethernet_32770")]

if "sigint" in FAKES:
    import signal

    import psutil

    _send_signal = psutil.Process.send_signal

    def send_signal(self, sig):
        if sig != signal.SIGTERM:  # psutil/_pswindows.py's check and words
            raise ValueError("only SIGTERM, CTRL_C_EVENT and CTRL_BREAK_EVENT "
                             "signals are supported on Windows")
        return _send_signal(self, sig)

    psutil.Process.send_signal = send_signal

if "fork" in FAKES:
    import multiprocessing.context

    for name in ("fork", "forkpty"):
        if hasattr(os, name):
            delattr(os, name)
    # multiprocessing's default, as on Windows (it chose fork at its import)
    multiprocessing.context._default_context._default_context = (
        multiprocessing.context._concrete_contexts["spawn"])

if "sigusr1" in FAKES:
    import faulthandler
    import signal

    for module, name in ((signal, "SIGUSR1"), (faulthandler, "register")):
        if hasattr(module, name):
            delattr(module, name)

if "cp932" in FAKES:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="cp932")

if "nobash" in FAKES:
    import shutil
    import subprocess

    _which, _Popen = shutil.which, subprocess.Popen

    def _is_bash(command) -> bool:
        return os.path.basename(str(command)).lower() in {"bash", "bash.exe"}

    def which(cmd, *args, **kwargs):
        return None if _is_bash(cmd) else _which(cmd, *args, **kwargs)

    class Popen(_Popen):
        def __init__(self, args, *rest, **kwargs):
            first = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
            if _is_bash(first) and not kwargs.get("shell"):
                raise FileNotFoundError(2, "No such file or directory", str(first))
            super().__init__(args, *rest, **kwargs)

    shutil.which, subprocess.Popen = which, Popen
