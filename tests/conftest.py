import sys
import time
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

# tools/ holds the maintainers' scripts that tests check (build_notebooks,
# student_copies, links, ledger, ...): importable by name, as they import
# each other when run.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))


# A test that runs past its timeout (pyproject's `timeout`, or its own
# `timeout` mark) is failed by pytest-timeout, which prints this process's
# stacks. A little before that, this also writes the stacks of every rank the
# test started (engines, launcher workers) into the test's output and into
# build/stalls/, so that a one-off stall leaves its evidence behind.
STALL_BEFORE_TIMEOUT = 0.8


def _report_stall(item, elapsed_s: float) -> None:
    import re
    import sys
    from pathlib import Path

    from labkit.cluster import stalls

    report = (f"labkit: {item.nodeid} still running after {elapsed_s:.0f} s; the "
              "stacks of this test process and of every rank it started:\n"
              + stalls.stacks_report(me="pytest"))
    folder = Path(__file__).resolve().parent.parent / "build" / "stalls"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / (re.sub(r"[^\w.-]+", "_", item.nodeid) + ".txt")).write_text(report)
    print(report, file=sys.stderr, flush=True)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """Start the stall report's watchdog; pytest-timeout then sets its own timer."""
    from labkit.cluster import stalls

    if settings.timeout and settings.timeout > 0:
        item._labkit_watchdog = stalls.Watchdog(
            settings.timeout * STALL_BEFORE_TIMEOUT,
            lambda elapsed: _report_stall(item, elapsed)).start()


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    watchdog = getattr(item, "_labkit_watchdog", None)
    if watchdog is not None:
        watchdog.stop()


# --- tests that start processes, and the guard on those that say they do not ---
#
# A test that starts a process (ranks, a subprocess, a kernel, a server, a
# browser) is marked `procs`; `pytest -m "not procs"` runs the others, in
# about two minutes (`make check`). While a test without the mark is set up and
# run, starting a process fails it, naming the test and what it started, so
# that the quick selection stays quick. Caught where every start goes through:
# subprocess's fork_exec (Popen, asyncio's subprocesses), multiprocessing's
# spawn (the same fork_exec), os.fork, os.forkpty, os.posix_spawn, os.system,
# and a fork asked of labkit's fork server.

# The tests of the site, the browser, nbgrader and the environments start
# processes; their modules do not carry the mark, so it is given here: a whole
# module (None) or the tests named.
PROCS_TESTS = {
    "test_browser": None, "test_site": None, "test_nbgrader": None,
    "test_troubleshooting": {
        "test_the_stack_cell_shows_labkit_s_dump_where_py_spy_is_refused"},
    "test_environments": {"test_the_dev_container_sets_up_with_the_readme_s_command",
                          "test_the_binder_build_installs_the_course_with_the_cpu_torch"},
}
# A test that takes one of these fixtures starts processes through it.
PROCS_FIXTURES = {"ranks", "_two_ranks"}


def _uses_ranks(item) -> bool:
    return "ranks" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items):
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", "")
        module = module.rpartition(".")[2]
        function = getattr(item, "originalname", item.name)
        named = module in PROCS_TESTS and (PROCS_TESTS[module] is None
                                           or function in PROCS_TESTS[module])
        if named or PROCS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.procs)
    # The tests on the shared ranks first, the rest in their order after them: a
    # test that starts a group of its own stops the shared one (one group per
    # kernel), and each later test on the ranks would wait for it to restart.
    items.sort(key=lambda item: not _uses_ranks(item))


class ProcessNotAllowed(RuntimeError):
    """A test not marked `procs` tried to start a process."""


_running = None  # the test being set up or run, while the guard is on
_starts = {}  # nodeid -> what it tried to start


def _guarded(what: str, real):
    def guard(*args, **kwargs):
        item = _running
        if item is not None and item.get_closest_marker("procs") is None:
            _starts.setdefault(item.nodeid, what)
            raise ProcessNotAllowed(
                f"{item.nodeid} started a process ({what}) but is not marked "
                "procs: mark it @pytest.mark.procs, or start nothing "
                "(`pytest -m 'not procs'` must start no process)")
        return real(*args, **kwargs)
    guard.labkit_guard = True
    # Pickled by reference as the function it stands for (test_checkpoint
    # pickles os.system), found there since that module holds the guard too.
    guard.__module__, guard.__name__ = real.__module__, real.__name__
    guard.__qualname__ = real.__qualname__
    return guard


def _start_points() -> list[tuple[tuple, str, str]]:
    """(owners, name, what) of every function a process start goes through here.

    On POSIX, subprocess and multiprocessing's spawn go through _posixsubprocess;
    on Windows, which has none, both go through _winapi.CreateProcess (read in
    CPython's subprocess.py and multiprocessing/popen_spawn_win32.py; never run
    on Windows here)."""
    import os
    import subprocess

    try:
        import _posixsubprocess
    except ImportError:
        import _winapi

        targets = [((_winapi,), "CreateProcess", "subprocess or multiprocessing")]
    else:
        targets = [((subprocess,), "_fork_exec", "subprocess"),
                   ((_posixsubprocess,), "fork_exec", "multiprocessing's spawn")]
    targets += [((os, os.sys.modules[os.name]), name, f"os.{name}")
                for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp",
                             "system")]
    forkserver = sys.modules.get("labkit.cluster.forkserver")
    if forkserver is not None:
        targets.append(((forkserver.Server,), "fork", "a fork of labkit's fork server"))
    return targets


def _install_guards() -> None:
    for owners, name, what in _start_points():
        real = getattr(owners[0], name, None)
        if real is not None and not getattr(real, "labkit_guard", False):
            guard = _guarded(what, real)
            for owner in owners:
                setattr(owner, name, guard)


def _watched(item):
    """Wrap a phase of `item`: process starts are checked against its mark."""
    global _running
    _running = item
    try:
        return (yield)
    finally:
        _running = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _install_guards()  # again: the fork server's module may be new
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # Also when the start was tried in a thread, or its error was caught.
    what = _starts.get(item.nodeid)
    if what is not None and call.when in ("setup", "call") and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started a process ({what}) but is not "
                           "marked procs: mark it @pytest.mark.procs")
    return report


@pytest.fixture(autouse=True)
def _lang_and_figures():
    """Each test starts in English and leaves no figure open."""
    import matplotlib.pyplot as plt

    import labkit

    labkit.set_lang("en")
    yield
    labkit.set_lang("en")
    plt.close("all")


def _add_tests_to_path(group):
    from pathlib import Path

    folder = str(Path(__file__).parent)
    group.execute(f"import sys\nif {folder!r} not in sys.path:\n"
                  f"    sys.path.insert(0, {folder!r})")


@pytest.fixture(scope="session")
def _two_ranks():
    from labkit import cluster

    group = cluster.start(2, timeout_s=10, activate=False)
    _add_tests_to_path(group)
    yield group
    group.stop()


@pytest.fixture
def ranks(_two_ranks):
    """Two engines in one gloo group, shared by the tests that need ranks.

    Rank-side test functions live in tests/ddp_rank_checks.py; the engines
    import it by name, so the tests folder goes on their sys.path. A test that
    starts a cluster of its own stops this one (one group per kernel): it is
    started again for the next test that needs it.
    """
    if _two_ranks.view is None:
        _two_ranks.restart()
    # Every time: the group restarts its engines itself after some failures
    # (Ranks._repair), and the new engines start without the tests folder.
    _add_tests_to_path(_two_ranks)
    return _two_ranks


def alive(process) -> bool:
    """Whether a process (psutil.Process or pid) is running and not a zombie.

    A process may end between any two questions about it: ending is an answer.
    """
    import psutil

    try:
        if not isinstance(process, psutil.Process):
            process = psutil.Process(process)
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def two_rank_scripts(code: str, *args: str, timeout_s: float = 90):
    """Run `code` as ranks 0 and 1 in two Python processes (rank_scripts)."""
    return rank_scripts(code, *args, world_size=2, timeout_s=timeout_s)


def rank_scripts(code: str, *args: str, world_size: int, timeout_s: float = 90):
    """Run `code` as ranks 0 to world_size - 1, a Python process each, on a store
    of ours.

    Each gets argv [rank, port, *args] (joining with labkit.cluster.rendezvous
    .init_rank is the script's job); returns each one's CompletedProcess, its
    stdout and stderr together.
    """
    import subprocess
    import sys

    from labkit.cluster import rendezvous

    store = rendezvous.local_store(timeout_s=30)
    procs = [subprocess.Popen(
        [sys.executable, "-c", code, str(r), str(store.port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world_size)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:  # none left behind, also when one timed out
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out)
            for p, out in zip(procs, outs, strict=True)]


def child_processes():
    """Live processes started (directly or not) by this test process.

    Not its fork server (labkit.cluster.forkserver), which lives as long as this
    process, as in a kernel; what it forked is counted.
    """
    import psutil

    from labkit.cluster import forkserver

    server = forkserver.pid()
    return [p for p in psutil.Process().children(recursive=True)
            if alive(p) and p.pid != server]


def leftovers(before: set[int], wait_s: float = 10) -> set[int]:
    """Pids of processes this test process started since `before` (pids) that are
    still alive after up to `wait_s` seconds: what a test left behind."""
    deadline = time.monotonic() + wait_s
    while (left := {p.pid for p in child_processes()} - before) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt, as in a kernel, whatever was inherited.

    A test run started in the background (`make test &`, nohup) inherits
    SIGINT ignored, and Python then leaves it ignored.
    """
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def fake_gpus(monkeypatch):
    """`fake_gpus(n)`: this process sees n CUDA devices (engines it starts see none).

    No GPU has been available to this project; the choices labkit makes from
    the device count are tested this way.
    """
    import torch

    def fake(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name",
                            lambda device=None: f"Fake GPU {device}")
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)

    return fake


# --- what a test needs from the machine: a skip that says so, or a failure ---
#
# A test that cannot run here (no browser, no way to cut the network off, an
# extra not installed) is skipped, and its reason says what is missing and how
# to get it. Where CI provides the thing, it sets the variable that requires it
# (.ci/run: LABKIT_REQUIRE_BROWSER, LABKIT_REQUIRE_NETNS; make ecosystem-check:
# LABKIT_REQUIRE_ECOSYSTEM), and the same test fails instead of passing unseen.


def unavailable(reason: str, required_by: str, *, module: bool = False):
    """Skip for `reason` (what is missing, how to get it), or fail where the
    environment variable `required_by` is set, to anything but "0" (LABKIT_NBGRADER
    is "1" or "all"). `module`: at a module's top."""
    import os

    __tracebackhide__ = True  # the report names the test that called this

    if (value := os.environ.get(required_by, "0")) not in ("", "0"):
        pytest.fail(f"{reason} ({required_by}={value} requires it)", pytrace=False)
    pytest.skip(f"{reason} ({required_by}=1 makes this a failure)",
                allow_module_level=module)


def netns_missing() -> list[str]:
    """What `unshare -n` with loopback up needs and this machine lacks, each
    with how to get it; [] when the network can be cut off here."""
    import os
    import shutil

    # Windows has no os.geteuid, and no network namespaces either
    missing = [] if getattr(os, "geteuid", lambda: -1)() == 0 else [
        "root (unshare -n makes a network namespace; .ci/run runs as root)"]
    missing += [f"{tool} (apt-get install {package})"
                for tool, package in (("unshare", "util-linux"), ("ip", "iproute2"))
                if shutil.which(tool) is None]
    return missing


def step_time_problems(result: dict, *, accum_steps: int, repeat: int,
                       within_s: float | None = None) -> list[str]:
    """What is wrong with a no_sync experiment's step times (labkit nosync's
    step_s_sync and step_s_nosync), one line each; [] when they stand for what
    they say: seconds of one optimizer step of K micro-batches in each mode,
    measured (finite, > 0) with the K and rounds asked for, and, as parts of a
    run that lasted `within_s` seconds, shorter than it together."""
    import math

    problems = []
    times = {key: result.get(key) for key in ("step_s_sync", "step_s_nosync")}
    for key, value in times.items():
        if not isinstance(value, float) or not math.isfinite(value) or value <= 0:
            problems.append(f"{key} is {value!r}, not a measured time in seconds")
    config = result.get("config", {})
    asked = {"accum_steps": accum_steps, "repeat": repeat}
    problems += [f"measured with {key}={config.get(key)!r}, asked {want}"
                 for key, want in asked.items() if config.get(key) != want]
    if within_s is not None and not problems and sum(times.values()) >= within_s:
        problems.append(f"one step of each mode, {sum(times.values()):.3g} s, is not "
                        f"a part of the {within_s:.3g} s run that timed it")
    return problems
