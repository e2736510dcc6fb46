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

    group.execute(f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})")


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
    """Run `code` as ranks 0 and 1 in two Python processes, on a store of ours.

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
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
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
