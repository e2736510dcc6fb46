"""When a run stalls: the Python stacks of every rank, and the rank that stopped.

A rank that waits in a collective for a peer that never comes shows nothing: no
error until the collective's timeout, and then only the waiting rank's error,
not the reason. So every process labkit starts for a rank (an engine, a
launcher's worker, a torchrun rank) calls `enable_dumps`: from then on SIGUSR1
makes faulthandler write the stacks of all its threads to a file, even while
the rank is blocked inside a C++ collective. faulthandler needs no rights over
another process; py-spy needs ptrace rights (root on macOS, a relaxed
ptrace_scope on most Linux desktops) and cannot read a stopped process either.
A process that never called `enable_dumps` is never signalled: SIGUSR1 would
end it. Windows has neither SIGUSR1 nor faulthandler.register: there no rank
can be asked for its stacks and `enable_dumps` does nothing: a report reads
each rank's stacks with py-spy instead (from outside, which works there without
extra rights), and where py-spy is missing says so in their place.

`stacks_report` gathers the stacks of this process and of the ranks it started;
a `Watchdog` calls it when something takes far longer than it should;
`state` names what the operating system says a rank is doing (a stopped rank,
one that exited).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from .. import i18n

__all__ = ["Watchdog", "can_dump_stacks", "dump_file", "enable_dumps",
           "labelled_children", "process_stacks", "py_spy_dump", "stacks_report",
           "state", "this_process_stacks"]

i18n.register({
    "no_stack_dumps": {
        "ja": "(スタックなし: この OS には SIGUSR1 と faulthandler.register がないため "
              "(Windows)、ランクにスタックを書き出させることができません。"
              "py-spy dump --pid {pid} なら外から読めます)",
        "en": "(no stacks: this system has no SIGUSR1 and no faulthandler.register "
              "(Windows), so a rank cannot be asked to write its stacks; "
              "py-spy dump --pid {pid} reads them from outside)",
    },
})

# Where the dumps go: one file per process that enabled them. Children inherit
# the variable, so a test run can keep its own.
DIR_ENV = "LABKIT_STACKS_DIR"
_enabled: dict[str, object] = {}


def _dump_signal() -> int | None:
    """The signal that asks a process for its stacks, or None where there is none.

    Looked up at each call, not at import, so that a test can take it away.
    """
    if not hasattr(faulthandler, "register"):  # Windows
        return None
    return getattr(signal, "SIGUSR1", None)  # Windows has no SIGUSR1 either


def can_dump_stacks() -> bool:
    """Whether a rank can be asked for its stacks here (SIGUSR1: not on Windows)."""
    return _dump_signal() is not None


def _dir() -> Path:
    # One folder per user where the temporary folder is shared (/tmp); Windows
    # has no os.getuid, and its temporary folder is the user's own already.
    user = f"-{os.getuid()}" if hasattr(os, "getuid") else ""
    default = Path(tempfile.gettempdir()) / f"labkit-stacks{user}"
    return Path(os.environ.get(DIR_ENV) or default)


def _created(pid: int) -> int | None:
    """The process's start time, in 1/100 s: with the pid, names it uniquely."""
    import psutil

    try:
        return int(psutil.Process(pid).create_time() * 100)
    except psutil.NoSuchProcess:
        return None


def dump_file(pid: int) -> Path | None:
    """The file a process writes its stacks to, if it enabled dumps; else None."""
    created = _created(pid)
    path = _dir() / f"{pid}-{created}.stacks"
    return path if created is not None and path.exists() else None


def enable_dumps(label: str) -> Path | None:
    """From now on, SIGUSR1 writes this process's stacks to its dump file.

    `label` says what the process is ("rank 1"); it heads the file. Calling
    again only changes the label. Where there is no such signal (Windows),
    does nothing and returns None.
    """
    dump_signal = _dump_signal()
    if dump_signal is None:
        return None
    folder = _dir()
    folder.mkdir(parents=True, exist_ok=True)
    _sweep(folder)
    path = folder / f"{os.getpid()}-{_created(os.getpid())}.stacks"
    old = _enabled.get("file")
    file = open(path, "w")  # noqa: SIM115 - faulthandler writes to it until exit
    file.write(f"# {label}\n")
    file.flush()
    faulthandler.register(dump_signal, file=file, all_threads=True, chain=False)
    _enabled["file"] = file
    if old is not None:
        old.close()
    return path


def _sweep(folder: Path) -> None:
    """Remove the files of processes that have ended (or whose pid was reused)."""
    for path in folder.glob("*.stacks"):
        pid, _, created = path.stem.partition("-")
        if pid.isdigit() and str(_created(int(pid))) != created:
            path.unlink(missing_ok=True)


def labelled_children(contains: str = "") -> dict[str, int]:
    """{label: pid} of the processes started from this one (directly or not)
    that enabled dumps, and whose label contains `contains`."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        path = dump_file(child.pid)
        if path is not None:
            with open(path) as f:
                label = f.readline().removeprefix("# ").strip() or f"pid {child.pid}"
            if contains in label:
                found[label] = child.pid
    return found


def state(pid: int) -> str:
    """What the OS says the process is doing, in words a report can use.

    psutil reads "stopped" on Linux and macOS (SIGSTOP, Ctrl-Z, a debugger)
    and on Windows (every thread suspended). Where the OS does not let it read
    the state, "unknown": such a rank is never taken for a stopped one.
    """
    import psutil

    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "exited"
    except psutil.AccessDenied:
        return "unknown"
    return {psutil.STATUS_STOPPED: "stopped",
            psutil.STATUS_TRACING_STOP: "stopped",
            psutil.STATUS_ZOMBIE: "exited",
            psutil.STATUS_DEAD: "exited"}.get(status, status)


def process_stacks(pid: int, wait_s: float = 2.0) -> str | None:
    """Ask a process that enabled dumps for its stacks; None if it cannot answer."""
    dump_signal = _dump_signal()
    path = dump_file(pid)
    if dump_signal is None or path is None or state(pid) in ("stopped", "exited"):
        return None
    start = path.stat().st_size
    try:
        os.kill(pid, dump_signal)
    except ProcessLookupError:  # it ended after the question above
        return None
    deadline = time.monotonic() + wait_s
    size = start
    while time.monotonic() < deadline:
        time.sleep(0.05)
        new = path.stat().st_size
        if new > start and new == size:  # grew, then stopped growing
            break
        size = new
    with open(path) as f:
        f.seek(start)
        text = f.read()
    return text or None


def py_spy_dump(pid: int) -> subprocess.CompletedProcess:
    """`py-spy dump --pid PID`: another process's Python stacks, read from outside.

    py-spy is looked for on PATH, then beside this Python (a virtual
    environment's bin/, which a kernel started by `make lab` need not have on
    its PATH). Without py-spy, the result says so with return code 127, as a
    shell would.
    """
    py_spy = (shutil.which("py-spy")
              or shutil.which("py-spy", path=os.path.dirname(sys.executable)))
    if py_spy is None:
        return subprocess.CompletedProcess(
            ["py-spy"], 127, "", "py-spy is not installed (pip install py-spy)")
    # py-spy writes UTF-8 (a Rust program); paths in a stack may not be ASCII.
    return subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True,
                          encoding="utf-8", errors="replace", timeout=30)


def this_process_stacks() -> str:
    """The Python stacks of every thread of this process."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the thread writing the report
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"Thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts)


def stacks_report(pids: dict[str, int] | None = None, *, me: str | None = None) -> str:
    """The stacks of `pids` ({label: pid}), and of this process if `me` names it.

    Without `pids`: every process started from this one (directly or not) that
    enabled dumps. A rank that is stopped or has exited is named as such. Where
    no rank can be asked (no SIGUSR1), py-spy reads them, if it can.
    """
    if pids is None:
        pids = labelled_children()
    parts = []
    if me is not None:
        parts.append(f"=== {me} (pid {os.getpid()}) ===\n{this_process_stacks()}")
    for label, pid in pids.items():
        now = state(pid)
        if now == "stopped":
            parts.append(f"=== {label} (pid {pid}) is stopped (SIGSTOP, Ctrl-Z or a "
                         "debugger): it runs nothing, and every collective waits "
                         "for it ===")
            continue
        if now == "exited":
            parts.append(f"=== {label} (pid {pid}) has exited ===")
            continue
        stacks = process_stacks(pid)
        if stacks is None and not can_dump_stacks():  # Windows: read from outside
            spy = py_spy_dump(pid)
            stacks = spy.stdout if spy.returncode == 0 else None
        missing = ("(no stacks: it did not answer SIGUSR1)" if can_dump_stacks()
                   else i18n.t("no_stack_dumps", pid=pid))
        parts.append(f"=== {label} (pid {pid}, {now}) ===\n" + (stacks or missing))
    return "\n".join(parts)


def _kill(pid: int) -> None:
    """End the process at once: SIGKILL on Linux and macOS, TerminateProcess on
    Windows (which has no SIGKILL), both through psutil."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        psutil.Process(pid).kill()


class Watchdog:
    """Watches something running, from a thread, until `stop()`.

    - Past `after_s` (None: never), calls `report(elapsed_s)` once. What it
      watches goes on: a slow run may still finish.
    - With `ranks` ({label: pid}, a callable since ranks come and go): a rank
      seen stopped at two looks in a row, half a second apart, is killed, which
      ends every collective that waits for it, and `on_stopped(label, pid,
      stacks)` gets the stacks of every rank from just before. A stopped rank
      never fails by itself: the others would wait for it until their
      collective's timeout, and then report only that timeout.

    Use it as a context manager, or `start()` and `stop()` where the two ends
    are in different hooks.
    """

    def __init__(self, after_s: float | None, report: Callable[[float], None] | None,
                 *, ranks: Callable[[], dict[str, int]] | None = None,
                 on_stopped: Callable[[str, int, str], None] | None = None):
        self.after_s, self.report = after_s, report
        self.ranks, self.on_stopped = ranks, on_stopped
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="labkit-watchdog",
                                        daemon=True)

    def _watch(self) -> None:
        start = time.monotonic()
        reported, stopped_before = self.after_s is None, set()
        while not self._done.wait(0.5 if self.ranks else self.after_s):
            if self.ranks is not None:
                ranks = self.ranks()
                stopped = {pid for pid in ranks.values() if state(pid) == "stopped"}
                for label, pid in ranks.items():
                    if pid in stopped and pid in stopped_before:
                        stacks = stacks_report(ranks)
                        _kill(pid)
                        if self.on_stopped is not None:
                            self.on_stopped(label, pid, stacks)
                        return
                stopped_before = stopped
            elapsed = time.monotonic() - start
            if not reported and elapsed >= self.after_s:
                reported = True
                if self.report is not None:
                    self.report(elapsed)
                if self.ranks is None:
                    return

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
