"""Every POSIX-only feature labkit uses, taken away here: the message and the fallback.

Linux has them all; macOS lacks /proc and cannot open some of what Linux can;
Windows lacks SIGUSR1, SIGKILL, SIGSTOP, faulthandler.register, os.killpg,
os.getuid, and cannot open a folder as a file. Each test removes one piece
(monkeypatch) and checks what a learner there would see instead of a traceback.
None runs on macOS or Windows here: what those systems do with the fallback
(os._exit, TerminateProcess) is from their documentation, not a run.
"""

import faulthandler
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

import labkit
from labkit import checkpoint, comm, i18n
from labkit.__main__ import main
from labkit.cluster import launch, stalls, torchrun

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture
def lang():
    """Each test may switch the language; the next one starts in English."""
    yield labkit.set_lang
    labkit.set_lang("en")


# --- stacks on demand: SIGUSR1 and faulthandler.register (not on Windows) ---


@pytest.mark.parametrize("taken", ["signal.SIGUSR1", "faulthandler.register"])
def test_without_sigusr1_no_rank_is_signalled_and_the_report_says_why(
        monkeypatch, lang, taken):
    module, name = taken.split(".")
    monkeypatch.delattr({"signal": signal, "faulthandler": faulthandler}[module], name)
    registered = []
    if module == "signal":  # faulthandler.register is there: it must not be called
        monkeypatch.setattr(faulthandler, "register",
                            lambda *a, **k: registered.append(a))
    sent = []
    monkeypatch.setattr(os, "kill", lambda *args: sent.append(args))
    # and no py-spy, which a report reads the stacks with in their place
    monkeypatch.setattr(stalls, "py_spy_dump", lambda pid: subprocess.CompletedProcess(
        ["py-spy"], 127, "", "py-spy is not installed (pip install py-spy)"))
    assert not stalls.can_dump_stacks()
    assert stalls.enable_dumps("rank 0") is None and registered == []
    pid = os.getpid()  # a rank that is running: asked for nothing
    assert stalls.process_stacks(pid) is None and sent == []
    for code, words in (("en", "this system has no SIGUSR1"), ("ja", "SIGUSR1 と")):
        lang(code)
        report = stalls.stacks_report({"rank 1": pid})
        assert f"=== rank 1 (pid {pid}, " in report
        assert words in report and f"py-spy dump --pid {pid}" in report, report
        assert "did not answer SIGUSR1" not in report


def test_with_sigusr1_the_report_keeps_its_own_words(monkeypatch):
    """The message above only where the signal is missing."""
    assert stalls.can_dump_stacks()
    monkeypatch.setattr(stalls, "dump_file", lambda pid: None)  # never enabled
    report = stalls.stacks_report({"rank 1": os.getpid()})
    assert "(no stacks: it did not answer SIGUSR1)" in report
    assert "this system has no SIGUSR1" not in report


def test_the_dump_folder_needs_no_uid(monkeypatch, tmp_path):
    """Windows has no os.getuid; its temporary folder is the user's own."""
    monkeypatch.delenv(stalls.DIR_ENV, raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert stalls._dir() == tmp_path / f"labkit-stacks-{os.getuid()}"
    monkeypatch.delattr(os, "getuid")
    assert stalls._dir() == tmp_path / "labkit-stacks"
    assert stalls.dump_file(os.getpid()) is None  # looked up, no AttributeError


# --- the state of a rank, where psutil cannot read it ---


def test_a_state_psutil_cannot_read_is_unknown_and_never_killed(monkeypatch):
    def denied(self):
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "status", denied)
    killed = []
    monkeypatch.setattr(stalls, "_kill", killed.append)
    pid = os.getpid()
    assert stalls.state(pid) == "unknown"
    assert f"=== rank 1 (pid {pid}, unknown) ===" in stalls.stacks_report(
        {"rank 1": pid})
    stopped = []
    with stalls.Watchdog(None, None, ranks=lambda: {"rank 1": pid},
                         on_stopped=lambda *a: stopped.append(a)):
        time.sleep(1.3)  # two looks, half a second apart, and one more
    assert killed == [] and stopped == []


@pytest.mark.procs
def test_the_watchdog_ends_a_stopped_rank_without_naming_sigkill():
    """It kills through psutil (TerminateProcess on Windows, where SIGKILL is not)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        killed = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(psutil.Process, "kill", lambda self: killed.append(self.pid))
            mp.delattr(signal, "SIGKILL")
            stalls._kill(child.pid)
            assert killed == [child.pid]
            stalls._kill(child.pid + 10**7)  # gone already: nothing to do, no error
    finally:
        child.kill()
        child.wait()


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_lesson_10s_stack_cell_says_what_it_cannot_show_without_sigusr1(
        tmp_path, monkeypatch):
    """Lesson 10's py-spy cell as on Windows where py-spy fails: no SIGUSR1 to
    ask rank 0 with either, so rank 1 says so and asserts nothing about a stack;
    rank 0's collective still times out, as the cell's tag says."""
    import nbformat
    from conftest import two_rank_scripts
    from test_troubleshooting import _REFUSING_PY_SPY, _SPY_RANK, LESSON

    fake = tmp_path / "py-spy"
    fake.write_text(_REFUSING_PY_SPY)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    (cell,) = [c for c in nbformat.read(LESSON, as_version=4).cells
               if c.cell_type == "code" and "stalls.py_spy_dump" in c.source]
    windows = "import signal\ndel signal.SIGUSR1  # as on Windows\n" + _SPY_RANK
    rank0, rank1 = two_rank_scripts(windows, cell.source.removeprefix("%%px\n"),
                                    timeout_s=120)
    assert rank0.returncode == 3 and "raised:" in rank0.stdout, rank0.stdout[-2000:]
    shown = rank1.stdout
    assert rank1.returncode == 0, shown[-3000:]
    assert "Permission Denied" in shown and "labkit's own stack dump" not in shown
    assert "this system has no SIGUSR1" in shown, shown
    assert re.search(r"py-spy dump --pid \d+ reads them", shown), shown


# --- /proc/self/io (Linux only) ---


@pytest.fixture
def no_proc_io(monkeypatch):
    """/proc/self/io as on macOS and Windows: absent."""
    exists, opener = os.path.exists, open

    def fake_exists(path):
        return False if str(path) == "/proc/self/io" else exists(path)

    def fake_open(path, *args, **kwargs):
        if str(path) == "/proc/self/io":
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return opener(path, *args, **kwargs)

    monkeypatch.setattr(os.path, "exists", fake_exists)
    monkeypatch.setattr("builtins.open", fake_open)


def test_proc_io_is_read_where_it_exists():
    assert comm.can_count_bytes_written()
    assert comm.bytes_written() > 0


def test_without_proc_io_the_lessons_say_what_they_do_not_count(no_proc_io, lang):
    assert not comm.can_count_bytes_written()
    with pytest.raises(RuntimeError, match=r"needs /proc/self/io \(Linux\)"):
        comm.bytes_written()
    for code, words in (("en", "no /proc/self/io"), ("ja", "/proc/self/io がない")):
        lang(code)
        for key in ("bytes_sent_not_counted", "bytes_written_not_counted"):
            assert words in i18n.t(key)
    assert "tests/test_comm.py" in i18n.t("bytes_sent_not_counted")


def test_lesson_05s_cells_say_what_they_do_not_count_without_proc_io(
        no_proc_io, capsys, lang):
    """Its rank cell and the kernel's cell after it, with /proc/self/io taken
    away: no rank counts (nor calls a collective), the kernel says so in the
    lesson's language; then a rank that counted where the kernel cannot fails."""
    import nbformat

    for code in ("ja", "en"):
        nb = nbformat.read(NOTEBOOKS / code / "05_communication.ipynb", as_version=4)
        (i,) = [i for i, c in enumerate(nb.cells)
                if "comm.can_count_bytes_written()" in c.source
                and c.source.startswith("%%px")]
        rank_cell = nb.cells[i].source.removeprefix("%%px\n")
        kernel_cell = nb.cells[i + 1].source
        lang(code)
        shares = []
        for rank in (0, 1):
            ns = {"comm": comm, "rank": rank}
            exec(rank_cell, ns)
            shares.append(ns["share"])
        assert shares == [None, None] and capsys.readouterr().out == ""
        _run_kernel_cell(kernel_cell, shares)
        assert capsys.readouterr().out == i18n.t("bytes_sent_not_counted") + "\n"
        with pytest.raises(AssertionError):
            _run_kernel_cell(kernel_cell, [1.0, None])


def _run_kernel_cell(source: str, shares: list) -> None:
    """Run a kernel cell whose ranks.pull gives `shares`."""
    from types import SimpleNamespace

    exec(source, {"comm": comm, "labkit": labkit,
                  "ranks": SimpleNamespace(pull=lambda name: shares)})


def test_without_proc_io_send_less_reports_no_wire_bytes(no_proc_io):
    """compare_methods's "wire" is None per step, and the rest is counted."""
    import torch.distributed as dist

    from labkit import send_less

    # One rank in this process: its store in memory, no socket, no environment.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = send_less.large_config(hidden=8, depth=1)
        runs = send_less.compare_methods(["DDP"], cfg,
                                         steps=send_less.POWERSGD_WARMUP + 2)
    finally:
        dist.destroy_process_group()
    run = runs["DDP"]
    assert run["wire"] and all(w is None for w in run["wire"])
    assert all(b > 0 for b in run["bytes"])  # what is handed to collectives


# --- fsync of a folder (Windows cannot open one) ---


@pytest.fixture
def fsyncs(monkeypatch):
    calls = []
    real = os.fsync

    def counted(fd):
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    return calls


def test_save_fsyncs_the_folder_where_it_can(tmp_path, fsyncs):
    checkpoint.save({"step": 1}, tmp_path / "a.pt")
    assert len(fsyncs) == 2  # the file, then the folder (the rename)
    assert checkpoint.can_sync_folder(tmp_path)


def test_save_without_opening_a_folder_still_replaces_atomically(
        monkeypatch, tmp_path, fsyncs):
    real_open = os.open

    def windows_open(path, flags, *args, **kwargs):
        if os.path.isdir(path):  # as CreateFile without FILE_FLAG_BACKUP_SEMANTICS
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", windows_open)
    assert not checkpoint.can_sync_folder(tmp_path)
    path = tmp_path / "a.pt"
    checkpoint.save({"step": 1, "w": torch.ones(2)}, path)
    checkpoint.save({"step": 2, "w": torch.zeros(2)}, path)
    assert len(fsyncs) == 2  # each file, never the folder
    state = checkpoint.load(path)
    assert state["step"] == 2 and torch.equal(state["w"], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temporary left


# --- fault injection: SIGKILL and SIGSTOP (not on Windows) ---


class _Exited(Exception):
    pass


def test_crash_without_sigkill_ends_with_os_exit_and_says_so(monkeypatch, capsys,
                                                            lang):
    def fake_exit(code):
        raise _Exited(code)

    monkeypatch.delattr(signal, "SIGKILL")
    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(os, "kill", lambda *a: pytest.fail(f"os.kill{a}"))
    for code, words in (("en", "this system has no SIGKILL"), ("ja", "SIGKILL がない")):
        lang(code)
        with pytest.raises(_Exited) as ended:
            launch.crash()
        assert ended.value.args == (launch.CRASH_CODE,)
        err = capsys.readouterr().err
        assert words in err and f"pid {os.getpid()}" in err
        assert "os._exit(137)" in err


@pytest.mark.procs
def test_crash_with_sigkill_is_a_kill():
    code = "from labkit.cluster import launch; launch.crash(); print('lived')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL and "lived" not in done.stdout


def test_die_at_crashes_through_launch_crash():
    """So that --die-at takes the same fallback (its run needs torchrun's ranks)."""
    import inspect

    from labkit import cli_experiments

    assert cli_experiments.crash is launch.crash
    source = inspect.getsource(cli_experiments.resumable_training)
    assert "crash()" in source and "SIGKILL)" not in source


def test_without_sigstop_the_stop_fault_is_refused_before_any_rank(monkeypatch, lang):
    monkeypatch.delattr(signal, "SIGSTOP")
    started = []
    monkeypatch.setattr("labkit.cluster.rendezvous.local_store",
                        lambda *a: started.append(a))
    with pytest.raises(ValueError, match=r"--fault stop needs SIGSTOP.*"
                                         r"can show are raise, kill, hang$"):
        launch.run(abs, {}, 2, fault=("stop", 1))
    assert started == []
    assert "stop" not in launch._faults_here()
    monkeypatch.delattr(signal, "SIGKILL")  # kill has its fallback: still offered
    assert launch._faults_here() == ("raise", "kill", "hang")


def test_the_command_line_refuses_the_stop_fault_in_one_line(monkeypatch, capsys):
    monkeypatch.delattr(signal, "SIGSTOP")
    with pytest.raises(SystemExit) as exited:
        main(["--lang", "ja", "misuse", "--fault", "stop"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "--fault stop には SIGSTOP が要りますが" in err
    labkit.set_lang("en")


def test_every_fault_is_offered_where_the_signals_exist():
    assert launch._faults_here() == launch.FAULTS


def test_the_agents_signals_are_those_the_system_has(monkeypatch):
    """launch.run gives the caller's handlers back for these after the agent."""
    assert launch._agent_signals() == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                       signal.SIGQUIT)
    monkeypatch.delattr(signal, "SIGHUP")  # as on Windows
    monkeypatch.delattr(signal, "SIGQUIT")
    assert launch._agent_signals() == (signal.SIGTERM, signal.SIGINT)


# --- process groups: os.killpg (not on Windows) ---

AGENT = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an agent that does not stop
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(worker.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.procs
@pytest.mark.parametrize("killpg", [True, False])
def test_stopping_nodes_ends_agents_and_workers_with_or_without_killpg(
        monkeypatch, killpg):
    monkeypatch.setattr(torchrun, "GRACE_S", 0.5)
    if not killpg:
        monkeypatch.delattr(os, "killpg")
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    worker = psutil.Process(int(agent.stdout.readline()))
    torchrun._stop([agent])
    assert agent.returncode == -signal.SIGKILL
    worker.wait(timeout=10)  # gone too: psutil.TimeoutExpired if it lives
    agent.stdout.close()


# --- the site's offline build (Linux network namespaces) ---


@pytest.mark.procs  # the site's modules ask pandoc its version when imported
def test_the_offline_site_check_names_linux_elsewhere(monkeypatch, tmp_path):
    import importlib.util

    # Loaded under a name of its own: the test_site that pytest collects (and
    # skips without a built site) stays as it is.
    monkeypatch.setenv("LABKIT_SITE", str(tmp_path))  # else the module skips itself
    spec = importlib.util.spec_from_file_location(
        "test_site_on_other_systems", Path(__file__).with_name("test_site.py"))
    test_site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(test_site)

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.delattr(os, "geteuid")  # as on Windows: never reached
    monkeypatch.delenv("LABKIT_REQUIRE_NETNS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Linux's network namespaces"):
        test_site.test_the_site_builds_without_a_network(tmp_path)
    monkeypatch.setenv("LABKIT_REQUIRE_NETNS", "1")
    with pytest.raises(pytest.fail.Exception, match="this system is win32"):
        test_site.test_the_site_builds_without_a_network(tmp_path)
