"""A pytest plugin for nbval: keep each notebook as it ran; check what nbval lets by.

    PYTHONPATH=tools pytest -p nbval_record --nbval-lax ... notebooks/ja notebooks/en

nbval executes every cell and fails a cell that raises, but keeps nothing: its
outputs are read and dropped. With this plugin, each notebook nbval runs is written
to build/executed/<lang>/<name>.ipynb (tools/executed.py: the site renders those
copies; the output checks read them), with its outputs as a notebook client would
save them and the run's facts in its metadata. Besides, for every notebook:

- a cell tagged `raises-exception` must raise: nbval accepts one that no longer does,
  so a failure a lesson shows on purpose could quietly stop happening;
- once its kernel has stopped, no process it started may be left (engines,
  controllers, fork servers): one left is an error of the notebook's last cell;
- the end of the run lists each notebook with the kernels started for it, its cells
  and its seconds: the run's own log that every lesson ran once.

It reads nbval's messages by wrapping two methods of nbval's RunningKernel
(`execute_cell_input`, `get_message`): nbval 0.11 hands nothing on otherwise.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import executed
import nbformat
import psutil
import pytest

_OUTPUTS = ("stream", "display_data", "execute_result", "error")


def pytest_addoption(parser) -> None:
    parser.addoption("--executed-dir", default=str(executed.FOLDER),
                     help="where the executed notebooks go (nbval_record)")
    parser.addoption("--executed-leftover-wait", type=float, default=15.0,
                     help="seconds a notebook's processes get to end after its "
                     "kernel (nbval_record)")


def _tape_kernel() -> None:
    """Make every RunningKernel keep the id of the cell it runs and the iopub
    messages nbval reads for it."""
    from nbval.kernel import RunningKernel

    if getattr(RunningKernel, "_labkit_taped", False):
        return
    for name in ("execute_cell_input", "get_message"):
        if not callable(getattr(RunningKernel, name, None)):
            raise pytest.UsageError(f"nbval_record: nbval's RunningKernel has no "
                                    f"{name}(); this plugin knows nbval 0.11")
    execute, get = RunningKernel.execute_cell_input, RunningKernel.get_message

    def execute_cell_input(self, *args, **kwargs):
        self._labkit_tape = []
        self._labkit_msg_id = execute(self, *args, **kwargs)
        return self._labkit_msg_id

    def get_message(self, stream, timeout=None):
        msg = get(self, stream, timeout=timeout)
        if stream == "iopub" and hasattr(self, "_labkit_tape"):
            self._labkit_tape.append(msg)
        return msg

    RunningKernel.execute_cell_input = execute_cell_input
    RunningKernel.get_message = get_message
    RunningKernel._labkit_taped = True


def outputs(messages: list[dict], msg_id: str) -> list:
    """A cell's outputs from its iopub messages, as a notebook client keeps them:
    consecutive streams joined, `clear_output` honoured (also with wait=True),
    a display updated in place by `update_display_data`."""
    outs: list = []
    displays: dict[str, list[int]] = {}
    clear_next = False
    for msg in messages:
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "clear_output":
            if content.get("wait"):
                clear_next = True
            else:
                outs, displays, clear_next = [], {}, False
            continue
        if kind == "update_display_data":
            for i in displays.get(content.get("transient", {}).get("display_id"), []):
                outs[i]["data"], outs[i]["metadata"] = content["data"], content[
                    "metadata"]
            continue
        if kind not in _OUTPUTS:
            continue
        if clear_next:
            outs, displays, clear_next = [], {}, False
        out = nbformat.v4.output_from_msg(msg)
        if (kind == "stream" and outs and outs[-1].output_type == "stream"
                and outs[-1].name == out.name):
            outs[-1].text += out.text
            continue
        display_id = content.get("transient", {}).get("display_id")
        if kind == "display_data" and display_id:
            displays.setdefault(display_id, []).append(len(outs))
        outs.append(out)
    return outs


class _Notebook:
    """What one notebook's run gathered."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.t0 = time.perf_counter()
        self.kernels = 0
        self.cells = 0
        self.failed = False
        self.seconds = 0.0
        self.seen: dict[int, psutil.Process] = {}  # what its kernel started


class Recorder:
    def __init__(self, config) -> None:
        self.folder = Path(config.getoption("executed_dir")).resolve()
        self.wait_s = config.getoption("executed_leftover_wait")
        self.runs: dict[str, _Notebook] = {}
        self.count = 0

    def _run(self, item) -> _Notebook:
        parent = item.parent
        if parent.nodeid not in self.runs:
            self.runs[parent.nodeid] = _Notebook(Path(str(parent.fspath)))
        return self.runs[parent.nodeid]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        if not _is_cell(item):
            return (yield)
        run = self._run(item)
        kernel = item.parent.kernel
        try:
            return (yield)
        finally:
            if item.parent.kernel is not None and item.parent.kernel is not kernel:
                run.kernels += 1  # nbval started this notebook's kernel

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        if not _is_cell(item):
            return (yield)
        run = self._run(item)
        kernel = item.parent.kernel
        try:
            result = yield
        finally:
            run.cells += 1
            # Seen while the kernel lives: once it is gone, what it started is
            # no longer this process's descendant (orphans go to init).
            run.seen.update((p.pid, p) for p in psutil.Process().children(
                recursive=True))
            if getattr(kernel, "_labkit_tape", None) is not None and not item.options[
                    "skip"]:
                self.count += 1
                item.cell.outputs = outputs(kernel._labkit_tape, kernel._labkit_msg_id)
                item.cell.execution_count = self.count
                kernel._labkit_tape = None
        if item.options["check_exception"] and not any(
                o.output_type == "error" for o in item.cell.outputs):
            raise AssertionError(
                f"{item.parent.fspath.basename}, code cell {item.cell_num}: tagged "
                "raises-exception, but it raised nothing. The failure the notebook "
                "shows on purpose no longer happens: fix the cell, or drop the tag "
                "and the text that says it fails.")
        return result

    def pytest_runtest_logreport(self, report) -> None:
        run = self.runs.get(report.nodeid.split("::")[0])
        if run is not None and report.failed:
            run.failed = True

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        result = yield
        if not _is_cell(item) or (nextitem is not None
                                  and nextitem.parent is item.parent):
            return result
        # nbval stopped the notebook's kernel: the notebook is done
        run = self._run(item)
        run.seconds = time.perf_counter() - run.t0
        left = _leftovers(run.seen.values(), self.wait_s)
        run.failed = run.failed or bool(left)
        self._write(run, item.parent.nb)
        if left:
            raise AssertionError(
                f"{run.path.name}: processes left after its kernel stopped:\n"
                + "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in left.items()))
        return result

    def _write(self, run: _Notebook, nb) -> None:
        # only a notebook under notebooks/<lang> is a lesson with a place to go
        lang = run.path.parent.name
        copy = self.folder / lang / run.path.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        nb = nbformat.from_dict(nb)
        nb.metadata[executed.META] = executed.run_facts(
            run.path, seconds=run.seconds, kernels=run.kernels, passed=not run.failed,
            started=run.started)
        nbformat.write(nb, copy)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.runs:
            return
        write = terminalreporter.write_line
        terminalreporter.section("notebooks executed (nbval_record)")
        write(f"{'notebook':44} {'kernels':>7} {'cells':>5} {'seconds':>8}  result")
        for run in self.runs.values():
            name = f"{run.path.parent.name}/{run.path.name}"
            write(f"{name:44} {run.kernels:>7} {run.cells:>5} {run.seconds:>8.1f}  "
                  + ("failed" if run.failed else "passed"))
        runs = self.runs.values()
        write(f"{len(runs)} notebooks, {sum(r.kernels for r in runs)} kernels started,"
              f" {sum(r.seconds for r in runs):.0f} s; kept in {self.folder}")


def _is_cell(item) -> bool:
    from nbval.plugin import IPyNbCell

    return isinstance(item, IPyNbCell)


def _leftovers(seen, wait_s: float) -> dict[int, str]:
    """{pid: command line} of the processes in `seen` (psutil.Process) still alive
    after `wait_s`: engines and servers end a moment after their kernel, so they
    are given that long. is_running() also tells a reused pid apart."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {}
        for proc in seen:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    left[proc.pid] = " ".join(proc.cmdline())[:200]
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def pytest_configure(config) -> None:
    _tape_kernel()
    config.pluginmanager.register(Recorder(config), "nbval_record_recorder")
