"""The `procs` mark: a test without it that starts a process fails, by name.

`pytest -m "not procs"` (make check) is quick because the tests it selects
start no process; conftest's guard keeps it so. Run here as pytest runs it,
on tests that start processes each way the guard watches.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # it runs pytest in a process of its own

TESTS = textwrap.dedent("""
    import multiprocessing, os, subprocess, sys, threading
    import pytest
    from labkit.cluster import forkserver

    def test_popen():
        subprocess.run([sys.executable, "-c", "pass"])

    def test_started_in_a_thread_and_its_error_caught():
        def start():
            try:
                subprocess.run([sys.executable, "-c", "pass"])
            except Exception:
                pass
        thread = threading.Thread(target=start)
        thread.start()
        thread.join()

    def test_fork():
        if os.fork() == 0:
            os._exit(0)

    def test_multiprocessing_spawn():
        process = multiprocessing.get_context("spawn").Process(target=print)
        process.start()
        process.join()

    def test_fork_server():
        forkserver.Server.fork(None, "labkit.cluster.engine", [], {}, ".", "x.log")

    @pytest.fixture(scope="module")
    def server():
        return subprocess.Popen([sys.executable, "-c", "pass"]).wait()

    def test_in_a_module_fixture(server):
        pass

    @pytest.mark.procs
    def test_marked():
        assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0

    def test_quiet():
        assert sum([1, 2]) == 3
""")
UNMARKED = ["test_popen", "test_started_in_a_thread_and_its_error_caught",
            "test_fork", "test_multiprocessing_spawn", "test_fork_server",
            "test_in_a_module_fixture"]


def _pytest(tmp_path):
    tests = Path(__file__).resolve().parent
    (tmp_path / "test_starts.py").write_text(TESTS)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "conftest", "-p",
         "no:cacheprovider", "-o", "markers=procs", "test_starts.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(tests), *filter(None, [os.environ.get("PYTHONPATH")])])})


def test_an_unmarked_test_that_starts_a_process_fails_by_name(tmp_path):
    out = _pytest(tmp_path).stdout
    # the module fixture's start is an error in the setup of the test using it
    assert "5 failed, 2 passed, 1 error" in out.splitlines()[-1], out[-3000:]
    for name in UNMARKED:
        assert f"test_starts.py::{name} started a process (" in out, (name, out)
    assert "test_starts.py::test_fork started a process (os.fork)" in out
    assert "not marked procs" in out


def test_without_posixsubprocess_the_guard_watches_windows_process_creation(
        monkeypatch):
    """Windows has no _posixsubprocess: the guard watches _winapi.CreateProcess,
    where subprocess and multiprocessing start processes there."""
    import types

    import conftest

    winapi = types.ModuleType("_winapi")
    winapi.CreateProcess = lambda *args: None
    monkeypatch.setitem(sys.modules, "_posixsubprocess", None)  # import fails
    monkeypatch.setitem(sys.modules, "_winapi", winapi)
    watched = {(owners[0].__name__, name)
               for owners, name, _ in conftest._start_points()}
    assert ("_winapi", "CreateProcess") in watched
    assert ("subprocess", "_fork_exec") not in watched
