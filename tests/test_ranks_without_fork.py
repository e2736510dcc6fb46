"""Ranks started as new processes, without the fork server: where labkit chooses
that, what it tells the learner, and the rank machinery and a lesson run that way.

No Windows or Mac has run these tests. Their cases are forced here (os.fork
removed, sys.platform "darwin"), and the path they take, ipyparallel's own
launchers, runs for real on Linux with LABKIT_FORKSERVER=0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from conftest import _add_tests_to_path, child_processes, leftovers

import labkit
from labkit import cluster
from labkit.cluster import engine, forkserver, ranks

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def system(monkeypatch):
    """`system(platform, fork, variable)`: this process looks like `platform`
    (sys.platform), has os.fork or not, and LABKIT_FORKSERVER is `variable`
    (None: unset)."""

    def fake(platform: str, fork: bool = True, variable: str | None = None) -> None:
        monkeypatch.setattr(sys, "platform", platform)
        if not fork:
            monkeypatch.delattr(os, "fork")
        if variable is None:
            monkeypatch.delenv(forkserver.VARIABLE, raising=False)
        else:
            monkeypatch.setenv(forkserver.VARIABLE, variable)

    return fake


@pytest.mark.parametrize(("platform", "fork", "variable", "why"), [
    ("linux", True, None, None),
    ("linux", True, "", None),
    ("linux", True, "1", None),
    ("linux", True, "0", forkserver.OFF),
    ("linux", True, " 0\n", forkserver.OFF),
    ("darwin", True, None, forkserver.MACOS),
    ("darwin", True, "1", None),  # asked for, at the learner's risk
    ("darwin", True, "0", forkserver.OFF),
    ("win32", False, None, forkserver.NO_FORK),
    ("win32", False, "0", forkserver.OFF),
    ("linux", False, None, forkserver.NO_FORK),  # any system without os.fork
])
def test_usable_says_why_the_ranks_are_not_forked(system, platform, fork, variable,
                                                  why):
    system(platform, fork, variable)
    assert forkserver.usable() == why


def test_asking_for_forks_where_there_is_no_fork_names_the_variable(system):
    system("win32", fork=False, variable="1")
    with pytest.raises(forkserver.ForkServerError,
                       match=r"LABKIT_FORKSERVER=1 asks labkit to fork its ranks, but "
                             r"this system \(win32\) has no os.fork: unset "
                             r"LABKIT_FORKSERVER or set it to 0"):
        forkserver.usable()


@pytest.mark.parametrize("variable", ["yes", "true", "2", "off"])
def test_a_value_other_than_0_or_1_is_refused(system, variable):
    system("linux", variable=variable)
    with pytest.raises(ValueError, match=f"LABKIT_FORKSERVER='{variable}': set it "
                                         "to 0 .* or 1"):
        forkserver.usable()


@pytest.mark.parametrize(("platform", "fork", "variable", "forked"), [
    ("linux", True, None, True),
    ("linux", True, "0", False),
    ("darwin", True, None, False),
    ("darwin", True, "1", True),
    ("win32", False, None, False),
])
def test_new_cluster_takes_the_launchers_usable_chooses(system, platform, fork,
                                                        variable, forked):
    """Built, not started: nothing runs until the cluster starts."""
    from ipyparallel.cluster import launcher

    system(platform, fork, variable)
    c = engine.new_cluster(2)
    launchers = (c.controller_launcher_class, c.engine_launcher_class)
    if forked:
        assert launchers == (forkserver.ControllerLauncher,
                             forkserver.EngineSetLauncher)
    else:  # ipyparallel's own: new processes
        assert launchers == (launcher.LocalControllerLauncher,
                             launcher.LocalEngineSetLauncher)


@pytest.mark.parametrize("launcher_name", ["LocalEngineSetLauncher",
                                           "EngineSetLauncher"])
def test_both_ways_the_engines_run_labkit_s_engine_without_a_delay(launcher_name):
    from ipyparallel.cluster import launcher

    cls = getattr(forkserver if launcher_name == "EngineSetLauncher" else launcher,
                  launcher_name)
    engines = cls(config=engine.config(), profile_dir=".", cluster_id="test")
    assert engines.engine_cmd == [sys.executable, "-m", "labkit.cluster.engine"]
    assert engines.delay == 0


# What each reason says, in each language.
REASONS = {
    forkserver.OFF: {"en": "LABKIT_FORKSERVER=0 is set",
                     "ja": "LABKIT_FORKSERVER=0 が設定されています"},
    forkserver.NO_FORK: {"en": "this system (win32) has no os.fork",
                         "ja": "このシステム (win32) には os.fork がありません"},
    forkserver.MACOS: {"en": "on macOS, code run in a forked process is not "
                             "reliable; LABKIT_FORKSERVER=1 forks",
                       "ja": "macOS では fork したプロセスで実行するコードが"},
}


@pytest.mark.parametrize(("why", "platform"), [
    (forkserver.OFF, "linux"), (forkserver.NO_FORK, "win32"),
    (forkserver.MACOS, "darwin")])
@pytest.mark.parametrize("lang", ["en", "ja"])
def test_the_notice_says_why_and_what_it_costs_once_in_the_lesson_s_language(
        monkeypatch, capsys, why, platform, lang):
    labkit.set_lang(lang)
    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(ranks, "_said_why", False)
    ranks._say_why_not_forked(why)
    said = capsys.readouterr().err
    assert REASONS[why][lang] in said
    assert ("new processes" if lang == "en" else "新しいプロセス") in said
    assert ("takes longer" if lang == "en" else "時間がかかります") in said
    # what it costs, both ways: three ranges of seconds
    assert len(re.findall(r"\d(?:\.\d)?(?:–|〜)\d+ (?:s|秒)", said)) == 3, said
    ranks._say_why_not_forked(why)
    assert capsys.readouterr() == ("", "")  # once


def test_a_wrong_variable_fails_the_start_before_any_process(system):
    """Not marked procs: the guard in conftest fails this test if start() got as
    far as starting a process."""
    system("linux", variable="yes")
    with pytest.raises(ValueError, match="LABKIT_FORKSERVER='yes'"):
        cluster.start(2, activate=False)
    system("win32", fork=False, variable="1")
    with pytest.raises(forkserver.ForkServerError, match="LABKIT_FORKSERVER=1"):
        cluster.start(2, activate=False, background=True)


def _ppids(pids: list[int]) -> list[int]:
    return [psutil.Process(pid).ppid() for pid in pids]


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_ranks_as_new_processes_train_fail_and_are_repaired(monkeypatch, capfd):
    """LABKIT_FORKSERVER=0 on Linux: the path Windows and macOS take."""
    from ddp_rank_checks import all_reduce_forever, ddp_niter, hang_on_rank_1

    monkeypatch.setenv(forkserver.VARIABLE, "0")
    monkeypatch.setattr(ranks, "_said_why", False)
    before = {p.pid for p in child_processes()}
    server = forkserver.pid()
    # A loaded machine's DDP steps on new processes may take longer than the 10 s
    # the hang is given below: the bound is that short only for the hang.
    group = cluster.start(2, timeout_s=3, task_timeout_s=120, activate=False)
    try:
        assert "LABKIT_FORKSERVER=0 is set" in capfd.readouterr().err
        _add_tests_to_path(group)
        pids = group.run(os.getpid)
        # started by this process (ipyparallel's Popen), not forked by a server
        assert _ppids(pids) == [os.getpid()] * 2
        assert forkserver.pid() == server  # none started for them
        assert group.run(ddp_niter, 2) == [True, True]

        # a rank killed in a collective: named, and fresh engines replace both
        # (psutil's kill: SIGKILL, or TerminateProcess where there are no signals)
        threading.Timer(1.0, psutil.Process(pids[1]).kill).start()
        with pytest.raises(cluster.RankError) as err:
            group.run(all_reduce_forever)
        assert "rank 1's process died" in err.value.failures[1]
        assert group.damage == "restart"
        assert group.run(abs, -3) == [3, 3]
        fresh = group.run(os.getpid)
        assert fresh[1] != pids[1] and _ppids(fresh) == [os.getpid()] * 2
        _add_tests_to_path(group)

        # a hung rank: interrupted through its nanny, which the engine started
        group.task_timeout_s = 10
        with pytest.raises(cluster.RankError) as err:
            group.run(hang_on_rank_1)
        assert "rank 1 did not finish within 10 s" in err.value.failures[1]
        group.task_timeout_s = 120
        assert group.run(abs, -2) == [2, 2]  # the group was reset and works
        assert group.run(os.getpid) == fresh  # reset, not restarted
        assert "new processes" not in capfd.readouterr().err  # said once
    finally:
        group.stop()
    assert leftovers(before) == set()


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_lesson_03_runs_whole_with_its_ranks_as_new_processes(tmp_path):
    """Every cell of the English lesson 03, as make test runs a lesson (nbval and
    its recorder: no process outlives the kernel), with LABKIT_FORKSERVER=0."""
    import executed
    import nbformat

    lesson = ROOT / "notebooks" / "en" / "03_ddp.ipynb"
    env = dict(executed.tools_env(), **{forkserver.VARIABLE: "0"})
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *executed.nbval_args(tmp_path), str(lesson)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=570)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    ran = nbformat.read(executed.copy_of(lesson, tmp_path), as_version=4)
    said = "".join(out.get("text", "") for cell in ran.cells
                   for out in cell.get("outputs", ()))
    # the kernel took the variable: its ranks were new processes
    assert "LABKIT_FORKSERVER=0 is set" in said
