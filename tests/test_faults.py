"""Faults on the notebook's engines: a killed rank, a hung rank, an interrupt.

Each case must end in an error that names the rank, within a bounded time, and
the next call on the same group must work (the group repairs itself).
"""

import os
import signal
import threading
import time

import pytest
from conftest import child_processes
from ddp_rank_checks import all_reduce_forever, hang_on_rank_1

from labkit import cluster


@pytest.fixture
def group():
    before = {p.pid for p in child_processes()}
    g = cluster.start(2, timeout_s=3, task_timeout_s=15, activate=False)
    from conftest import _add_tests_to_path

    _add_tests_to_path(g)
    yield g
    g.stop()
    deadline = time.monotonic() + 10
    while {p.pid for p in child_processes()} - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {p.pid for p in child_processes()} - before == set()


def test_a_killed_rank_is_named_and_the_group_restarts(group):
    pids = group.run(os.getpid)
    threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
    t0 = time.perf_counter()
    with pytest.raises(cluster.RankError) as err:
        group.run(all_reduce_forever)
    assert time.perf_counter() - t0 < 30  # an error, not a hang
    assert "rank 1's process died" in err.value.failures[1]
    assert group.damage == "restart"
    assert group.run(abs, -3) == [3, 3]  # fresh engines, transparently
    assert group.run(os.getpid)[1] != pids[1]


def test_a_hung_rank_is_named_and_interrupted(group):
    t0 = time.perf_counter()
    with pytest.raises(cluster.RankError) as err:
        group.run(hang_on_rank_1)
    assert time.perf_counter() - t0 < 40
    assert "rank 1 did not finish within 15 s" in err.value.failures[1]
    assert "rank 0" not in err.value.failures.get(1, "")
    assert 0 in err.value.failures  # rank 0's collective timed out
    assert group.run(abs, -2) == [2, 2]  # the group was reset and works


def test_interrupting_the_kernel_stops_the_ranks(group):
    """KeyboardInterrupt while ranks work: they stop too, and the group recovers."""
    def interrupt_me():
        time.sleep(2)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=interrupt_me).start()
    with pytest.raises(KeyboardInterrupt):
        group.run(time.sleep, 3600)
    assert group.damage == "reset"
    assert group.run(abs, -1) == [1, 1]
