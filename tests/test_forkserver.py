"""The fork server: its forks run as `python -m` would, and it fails clearly."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from conftest import alive

from labkit.cluster import forkserver


def procs(test):
    """Every test here but the last two starts processes, forked by a server: they
    run where labkit forks its ranks by default (not on Windows, which has no
    os.fork, nor on macOS: forkserver.usable). Not tried on either."""
    skip = pytest.mark.skipif(
        not hasattr(os, "fork") or sys.platform == "darwin",
        reason=f"labkit does not fork its ranks on {sys.platform} "
               "(forkserver.usable); tests/test_ranks_without_fork.py tests the "
               "launchers it uses there")
    return pytest.mark.procs(skip(test))


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


@procs
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


@procs
def test_the_server_is_replaced_when_the_environment_changes(monkeypatch):
    first = forkserver.server()
    assert forkserver.server() is first
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read when torch is imported
    second = forkserver.server()
    assert second is not first and second.alive()
    first.process.wait(10)  # the old one ended


@procs
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
        assert not server.alive()  # the next start tries a new one
    finally:
        server.stop()


SERVER_OF_A_KILLED_PARENT = """
import sys
from labkit.cluster import forkserver
print(forkserver.server().pid, flush=True)
sys.stdin.read()  # wait to be killed
"""


@procs
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


@procs
def test_a_fork_of_the_kernel_leaves_the_kernels_server_alone():
    """A DataLoader worker or a fork launcher's rank inherits the server's handle."""
    server = forkserver.server()
    child = os.fork()
    if child == 0:  # a fork of this process: the server is not its own
        code = 0 if forkserver.pid() is None else 1
        forkserver.client._stop_server()  # what its exit would run
        os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert server.alive() and forkserver.server() is server
    assert os.path.exists(server.log_path)


def _on_path(tmp_path, monkeypatch) -> None:
    """Pythons started from now on in this test import modules from `tmp_path`."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))


def _run_first_in_new_pythons(tmp_path, monkeypatch, code: str) -> None:
    """Pythons started from now on in this test run `code` first (a sitecustomize)."""
    (tmp_path / "sitecustomize.py").write_text(code)
    _on_path(tmp_path, monkeypatch)


def _report(server, tmp_path, name: str = "out.log") -> dict:
    """What a fork of `server` running REPORT saw."""
    (tmp_path / "labkit_report.py").write_text(REPORT)
    out = tmp_path / name
    pid = server.fork("labkit_report", [], dict(os.environ), str(tmp_path), str(out))
    report = json.loads(_wait_for(out))
    assert report["pid"] == pid
    return report


@procs
def test_a_server_that_does_not_answer_fails_clearly_and_is_replaced(tmp_path,
                                                                      monkeypatch):
    with monkeypatch.context() as patch:  # the next server is a plain one
        patch.setattr(forkserver.client, "ANSWER_TIMEOUT_S", 2.0)
        _run_first_in_new_pythons(tmp_path, patch, "import time\ntime.sleep(600)\n")
        stuck = forkserver.server()
        with pytest.raises(forkserver.ForkServerError,
                           match="it did not answer within 2 s"):
            _report(stuck, tmp_path)
    assert not stuck.alive()
    assert forkserver.pid() is None  # not the kernel's server any more
    stuck.stop()  # again: nothing left to do
    server = forkserver.server()
    assert server is not stuck
    assert _report(server, tmp_path, "next.log")["torch"]


@procs
def test_a_line_printed_in_the_server_goes_to_its_log(tmp_path, monkeypatch):
    """Its answers have a pipe of their own: a library that prints when imported
    (here, the server's first import) cannot garble them."""
    _run_first_in_new_pythons(tmp_path, monkeypatch,
                              "print('a line from an import', flush=True)\n")
    server = forkserver.Server()
    try:
        assert _report(server, tmp_path)["torch"]
        with open(server.log_path) as log:
            assert "a line from an import" in log.read()
    finally:
        server.stop()


@procs
def test_a_server_with_a_thread_refuses_to_fork(tmp_path, monkeypatch):
    """A fork copies only the thread that forks: a lock another thread holds
    stays held in the fork forever."""
    _run_first_in_new_pythons(tmp_path, monkeypatch, (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), name='a library thread',"
        " daemon=True).start()\n"))
    server = forkserver.Server()
    try:
        with pytest.raises(forkserver.ForkServerError,
                           match=r"it has 2 Python threads \(MainThread, a library "
                                 r"thread; \d+ threads in all\), and a fork copies "
                                 r"only the thread that forks"):
            _report(server, tmp_path)
        assert server.alive()  # it refuses, and goes on refusing
        with pytest.raises(forkserver.ForkServerError, match="2 Python threads"):
            _report(server, tmp_path)
    finally:
        server.stop()


@procs
def test_a_variable_read_after_the_imports_reaches_the_fork_from_the_same_server(
        tmp_path, monkeypatch):
    """ipyparallel's launcher sends the kernel's environment, as it is when it
    asks, with each request: only what is read at import time needs a new server."""
    first = forkserver.server()
    monkeypatch.setenv("LABKIT_TEST_VAR", "changed")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")  # torch's, at CUDA's start
    assert forkserver.server() is first
    (tmp_path / "labkit_report.py").write_text(REPORT)
    launcher = forkserver.ControllerLauncher(
        work_dir=str(tmp_path), output_file=str(tmp_path / "out.log"),
        controller_cmd=[sys.executable, "-m", "labkit_report"], controller_args=[])
    launcher.start()
    try:
        report = json.loads(_wait_for(tmp_path / "out.log"))
    finally:
        launcher._stop_waiting.set()
    assert report["pid"] == launcher.pid
    assert report["var"] == "changed"
    assert forkserver.server() is first


CHILD = """
import subprocess, sys
CODE = subprocess.run([sys.executable, "-c", "raise SystemExit(3)"]).returncode
"""


@procs
def test_a_subprocess_an_import_runs_in_the_server_gets_its_return_code(tmp_path,
                                                                       monkeypatch):
    """SIGCHLD ignored while the server imports would make it 0 (ECHILD)."""
    (tmp_path / "labkit_child.py").write_text(CHILD)
    (tmp_path / "labkit_child_code.py").write_text(
        "import sys\nprint(sys.modules['labkit_child'].CODE, flush=True)\n")
    _on_path(tmp_path, monkeypatch)
    server = forkserver.Server(preload=(*forkserver.client.PRELOAD, "labkit_child"))
    try:
        out = tmp_path / "out.log"
        server.fork("labkit_child_code", [], dict(os.environ), str(tmp_path), str(out))
        assert _wait_for(out) == "3\n"
    finally:
        server.stop()


# ipyparallel's code that labkit copies, replaces or talks to, with what to
# re-check in labkit when it changes (ipyparallel~=9.2 in pyproject.toml).
PINNED = {
    "ipyparallel.cluster.launcher:LocalProcessLauncher.start": (
        "27114e85bf6c0400", "forkserver.launchers._Forked.start is a copy of it, "
        "with a fork of the server in place of Popen"),
    "ipyparallel.cluster.launcher:LocalProcessLauncher._start_waiting": (
        "293aaf4999eaa259", "forkserver.launchers._Forked.start calls it"),
    "ipyparallel.cluster.launcher:LocalProcessLauncher._start_streaming": (
        "c1df912b928d3e5b", "forkserver.launchers._Forked.start calls it"),
    "ipyparallel.cluster.launcher:BaseLauncher.notify_start": (
        "f2b6ea7ff1f9ab1a", "forkserver.launchers._Forked.start calls it"),
    "ipyparallel.cluster.launcher:LocalEngineSetLauncher.start": (
        "5290ab3d61158454", "forkserver.launchers.EngineSetLauncher sets its "
        "launcher_class; labkit.cluster.engine.config its delay and engine_cmd, "
        "for ipyparallel's own launcher too"),
    "ipyparallel.engine.app:IPEngine.start_nanny": (
        "98775c367dd3c256", "labkit.cluster.engine.main replaces the start_nanny "
        "it calls with forkserver.serve.nanny_from_fds"),
    "ipyparallel.engine.nanny:start_nanny": (
        "cd75f853335b6079", "forkserver.serve.nanny_from_fds does its job on the "
        "pipes the server made"),
    "ipyparallel.engine.nanny:main": (
        "db62e170597e3a8e", "forkserver.serve._fork_with_nanny gives the nanny its "
        "arguments on stdin and takes its address from stdout"),
    "ipyparallel.engine.nanny:KernelNanny.start": (
        "eeebb29f1b3427b3", "forkserver.serve._fork_with_nanny expects the address "
        "as a line on stdout, and the nanny to end when that pipe closes"),
}


def _source_hash(target: str) -> str:
    import hashlib
    import importlib
    import inspect

    module, qualname = target.split(":")
    found = importlib.import_module(module)
    for name in qualname.split("."):
        found = getattr(found, name)
    return hashlib.sha256(inspect.getsource(found).encode()).hexdigest()[:16]


def _changed(pinned: dict[str, tuple[str, str]]) -> list[str]:
    from importlib.metadata import version

    return [f"ipyparallel {version('ipyparallel')} changed {target}: {what}. "
            "Re-check that, then update its hash in tests/test_forkserver.py"
            for target, (digest, what) in pinned.items()
            if _source_hash(target) != digest]


def test_the_ipyparallel_code_labkit_relies_on_is_as_it_was():
    changed = _changed(PINNED)
    assert not changed, "\n".join(changed)


def test_a_change_in_pinned_code_names_the_function_and_what_to_check():
    target = "ipyparallel.engine.nanny:start_nanny"
    wrong = {**PINNED, target: ("0" * 16, "what labkit does with it")}
    assert _changed(wrong) == [
        f"ipyparallel {__import__('ipyparallel').__version__} changed {target}: "
        "what labkit does with it. Re-check that, then update its hash in "
        "tests/test_forkserver.py"]
