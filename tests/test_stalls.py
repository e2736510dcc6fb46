"""A stall explains itself: stacks of every rank, and the rank that stopped.

labkit.cluster.stalls in one process and its children; then the same in a notebook
kernel, where a `%%px` cell is what stalls. The engines' and the launcher's
own cases are in test_faults.py and test_launch_and_failures.py.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import child_processes

from labkit.cluster import stalls

CHILD = textwrap.dedent("""
    import sys, time
    from labkit.cluster import stalls
    if sys.argv[1] == "dumps":
        stalls.enable_dumps("rank 7 of a test")
    def waiting_here():
        print("ready", flush=True)
        time.sleep(60)
    waiting_here()
""")


def _child(dumps: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "dumps" if dumps else "no"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


@pytest.mark.procs
def test_a_child_that_enabled_dumps_answers_with_its_stacks():
    proc = _child(dumps=True)
    try:
        assert stalls.labelled_children("of a test") == {"rank 7 of a test": proc.pid}
        report = stalls.stacks_report()
        section = report.split(f"=== rank 7 of a test (pid {proc.pid}, ")[1]
        assert "in waiting_here" in section and "Current thread" in section
        # Asked twice, it answers twice: each answer is the new dump only.
        again = stalls.process_stacks(proc.pid)
        assert again.count("in waiting_here") == 1
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.procs
def test_a_process_without_dumps_is_never_signalled():
    """SIGUSR1 would end a process that has no handler for it."""
    proc = _child(dumps=False)
    try:
        assert stalls.dump_file(proc.pid) is None
        assert stalls.labelled_children() == {}
        assert stalls.process_stacks(proc.pid) is None
        report = stalls.stacks_report({"rank 3": proc.pid})
        assert "did not answer SIGUSR1" in report
        time.sleep(0.2)
        assert proc.poll() is None  # still alive
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.procs
def test_a_stopped_process_is_named_not_asked():
    proc = _child(dumps=True)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while stalls.state(proc.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stalls.state(proc.pid) == "stopped"
        assert stalls.process_stacks(proc.pid) is None
        assert f"rank 1 (pid {proc.pid}) is stopped" in stalls.stacks_report(
            {"rank 1": proc.pid})
    finally:
        proc.kill()
        proc.wait()
    assert stalls.state(proc.pid) == "exited"


def test_the_watchdog_reports_once_and_only_when_late():
    calls = []
    with stalls.Watchdog(0.2, calls.append):
        time.sleep(0.6)
    with stalls.Watchdog(5, calls.append):
        pass
    time.sleep(0.1)
    assert len(calls) == 1 and calls[0] >= 0.2


@pytest.mark.procs
def test_the_watchdog_kills_a_rank_that_stays_stopped():
    proc = _child(dumps=True)
    other = _child(dumps=True)
    seen = []
    try:
        watchdog = stalls.Watchdog(None, None, ranks=lambda: {
            "rank 0": other.pid, "rank 1": proc.pid},
            on_stopped=lambda *args: seen.append(args)).start()
        os.kill(proc.pid, signal.SIGSTOP)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        watchdog.stop()
        (label, pid, report), = seen
        assert (label, pid) == ("rank 1", proc.pid)
        assert "in waiting_here" in report.split(f"=== rank 0 (pid {other.pid}")[1]
        assert other.poll() is None  # the rank that waited is left alone
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()


NOTEBOOK_CELLS = [
    "from labkit import cluster\nranks = cluster.start(2)\nranks.stall_s = 1",
    "%%px\nimport time\ntime.sleep(2.5)",
    "ranks.stall_s = None",
    # Rank 1 stops itself in the middle of the all-reduces.
    textwrap.dedent("""\
        %%px
        import os, signal, threading
        import torch, torch.distributed as dist
        if rank == 1:
            threading.Timer(1, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        x = torch.ones(1)
        while True:
            dist.all_reduce(x)"""),
    # Its start restarts the ranks (rank 1 was killed): still watched after that.
    "ranks.stall_s = 1",
    "%%px\nimport time\ntime.sleep(2.5)\nrank * 10",
    "ranks.stop()",
]


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_a_stalled_px_cell_shows_every_ranks_stacks_and_a_stopped_rank_ends():
    import nbclient
    import nbformat

    before = {p.pid for p in child_processes()}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NOTEBOOK_CELLS]
    nbclient.NotebookClient(nb, timeout=180, allow_errors=True,
                            kernel_name="python3").execute()

    def text(cell):
        return re.sub(r"\x1b\[[0-9;]*m", "", "".join(
            o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
            for o in cell.outputs))

    slow, stopped, after = (text(nb.cells[i]) for i in (1, 3, 5))
    assert "labkit: this cell is still running after 1 s" in slow
    assert "=== kernel (pid" in slow
    for rank in (0, 1):  # each engine's main thread, in the cell's code
        section = slow.split(f"=== rank {rank} (pid ")[1].split("\n=== ")[0]
        assert "line 2 in <module>" in section.split("Current thread")[1]
    assert "still running" not in stopped
    assert "labkit: rank 1 (pid" in stopped and "was stopped" in stopped
    waiting = stopped.split("=== rank 0 (pid ")[1].split("\n=== ")[0]
    assert "in all_reduce" in waiting
    assert "]: 0" in after and "]: 10" in after  # fresh ranks answer
    assert "labkit: this cell is still running after 1 s" in after
    assert {p.pid for p in child_processes()} - before == set()


@pytest.mark.procs
def test_a_hung_test_fails_by_name_with_the_stacks_of_its_ranks(tmp_path):
    """conftest's watchdog, run the way pytest runs it (loaded as a plugin)."""
    tests = Path(__file__).resolve().parent
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import time
        import pytest
        from test_stalls import _child

        @pytest.mark.procs
        @pytest.mark.timeout(4)
        def test_hangs():
            child = _child(dumps=True)
            try:
                time.sleep(60)
            finally:
                child.kill()
                child.wait()
    """))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p",
         "no:cacheprovider", "-o", "markers=procs", "test_hang.py"], cwd=tmp_path,
        capture_output=True, text=True, timeout=120,
        # tests/ first, then whatever path this run found labkit on.
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(tests), *filter(None, [os.environ.get("PYTHONPATH")])])})
    out = result.stdout
    assert result.returncode == 1, out[-2000:]
    assert "Timeout (>4.0s) from pytest-timeout" in out
    assert "labkit: test_hang.py::test_hangs still running after 3 s" in out
    assert "in waiting_here" in out.split("=== rank 7 of a test (pid ")[1]
    kept = tests.parent / "build" / "stalls" / "test_hang.py_test_hangs.txt"
    assert "=== rank 7 of a test" in kept.read_text()
