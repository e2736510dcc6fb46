"""The fork server: its forks run as `python -m` would, and it fails clearly."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from conftest import alive

from labkit.cluster import forkserver

pytestmark = pytest.mark.procs  # every test here starts processes

REPORT = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
                  "var": os.environ.get("LABKIT_TEST_VAR"), "pid": os.getpid(),
                  "sid": os.getsid(0), "torch": "torch" in sys.modules,
                  "stdin": sys.stdin.read(),
                  "cmdline": open("/proc/self/cmdline").read().replace("\\0", " ")}),
      flush=True)
sys.exit(3)
"""


def _wait_for(path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def test_a_fork_runs_a_module_as_python_m_would(tmp_path, monkeypatch):
    (tmp_path / "labkit_report.py").write_text(REPORT)
    out = tmp_path / "out.log"
    env = dict(os.environ, LABKIT_TEST_VAR="here")
    server = forkserver.server()
    pid = server.fork("labkit_report", ["a", "b"], env, str(tmp_path), str(out))
    report = json.loads(_wait_for(out))
    assert report["pid"] == pid != server.pid
    assert report["argv"] == ["a", "b"]
    assert report["cwd"] == report["path0"] == str(tmp_path)
    assert report["var"] == "here"  # the environment asked for, not the server's
    assert report["sid"] == pid  # its own session: a terminal's Ctrl-C misses it
    assert report["torch"]  # preloaded
    assert report["stdin"] == ""
    # what ps and py-spy show: its own command, not the server's
    assert report["cmdline"].split() == [sys.executable, "-m", "labkit_report",
                                         "a", "b"]
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:  # reaped, not a zombie
        time.sleep(0.05)
    assert not alive(pid)


def test_the_server_is_replaced_when_the_environment_changes(monkeypatch):
    first = forkserver.server()
    assert forkserver.server() is first
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read when torch is imported
    second = forkserver.server()
    assert second is not first and second.alive()
    first.process.wait(10)  # the old one ended


def test_a_server_that_cannot_start_says_why(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('a broken torch')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        server = forkserver.Server()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        with pytest.raises(forkserver.ForkServerError, match="could not start a "
                           "process: ImportError: a broken torch"):
            server.fork("labkit.cluster.engine", [], env, str(tmp_path),
                        str(tmp_path / "engine.log"))
    finally:
        server.stop()


SERVER_OF_A_KILLED_PARENT = """
import sys
from labkit.cluster import forkserver
print(forkserver.server().pid, flush=True)
sys.stdin.read()  # wait to be killed
"""


def test_the_server_ends_when_its_parent_is_killed():
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", SERVER_OF_A_KILLED_PARENT],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server = int(parent.stdout.readline())
        assert alive(server)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server)


def test_a_fork_of_the_kernel_leaves_the_kernels_server_alone():
    """A DataLoader worker or a fork launcher's rank inherits the server's handle."""
    server = forkserver.server()
    child = os.fork()
    if child == 0:  # a fork of this process: the server is not its own
        code = 0 if forkserver.pid() is None else 1
        forkserver._stop_server()  # what its exit would run
        os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert server.alive() and forkserver.server() is server
    assert os.path.exists(server._log.name)
