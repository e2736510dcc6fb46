"""Faults on the notebook's engines: a killed rank, a hung rank, an interrupt.

Each case must end in an error that names the rank, within a bounded time, and
the next call on the same group must work (the group repairs itself).
"""

import os
import signal
import threading
import time

import pytest
from conftest import _add_tests_to_path, child_processes, leftovers
from ddp_rank_checks import all_reduce_forever, hang_on_rank_1

from labkit import cluster
from labkit.cluster import ranks

pytestmark = pytest.mark.procs  # every test here starts processes

# Calls on the group are interrupted after this many seconds: well past its
# collectives' 3 s timeout, so that a rank waiting in one fails by that first.
TASK_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def _group():
    """One group for the module: each test leaves it repaired, and asserts so.

    Every process a test started (fresh engines after a restart too) must be
    gone once the group stops: checked when the module ends.
    """
    before = {p.pid for p in child_processes()}
    g = cluster.start(2, timeout_s=3, task_timeout_s=TASK_TIMEOUT_S, activate=False)
    yield g
    g.stop()
    assert leftovers(before) == set()


@pytest.fixture
def group(_group):
    _add_tests_to_path(_group)  # again: a restart brings fresh engines
    _group.stall_s = ranks.STALL_S
    assert _group.damage is None  # the test before left it repaired
    return _group


@pytest.mark.timeout(120)  # an error, not a hang
def test_a_killed_rank_is_named_and_the_group_restarts(group):
    pids = group.run(os.getpid)
    threading.Timer(1.0, os.kill, (pids[1], signal.SIGKILL)).start()
    with pytest.raises(cluster.RankError) as err:
        group.run(all_reduce_forever)
    assert "rank 1's process died" in err.value.failures[1]
    assert group.damage == "restart"
    assert group.run(abs, -3) == [3, 3]  # fresh engines, transparently
    assert group.run(os.getpid)[1] != pids[1]


@pytest.mark.timeout(120)  # an error, not a hang
def test_a_hung_rank_is_named_and_interrupted(group):
    with pytest.raises(cluster.RankError) as err:
        group.run(hang_on_rank_1)
    assert f"rank 1 did not finish within {TASK_TIMEOUT_S} s" in err.value.failures[1]
    assert "rank 0" not in err.value.failures.get(1, "")
    assert 0 in err.value.failures  # rank 0's collective timed out
    assert group.run(abs, -2) == [2, 2]  # the group was reset and works


@pytest.mark.timeout(120)  # ended and named, not left waiting
def test_a_stopped_rank_is_named_with_the_stacks_of_the_waiting_one(group, capfd):
    """SIGSTOP on rank 1 in the middle of all-reduces: rank 0 waits in one.

    The call ends well before the collective's timeout would matter (the group's
    task timeout, 10 s: without the watchdog it would end there, naming rank 1
    only as unfinished), names rank 1 as stopped, and shows rank 0's stack
    inside all_reduce; the next call gets fresh ranks.
    """
    pids = group.run(os.getpid)
    threading.Timer(1.0, os.kill, (pids[1], signal.SIGSTOP)).start()
    with pytest.raises(cluster.RankError) as err:
        group.run(all_reduce_forever)
    note = err.value.failures[1]
    assert f"rank 1 (pid {pids[1]}) was stopped" in note
    waiting = note.split(f"=== rank 0 (pid {pids[0]}")[1]
    assert "in all_reduce" in waiting and "all_reduce_forever" in waiting
    assert "did not finish within" not in note  # not the task timeout
    assert "was stopped" in capfd.readouterr().err  # also said at once
    assert group.run(abs, -4) == [4, 4]
    assert group.run(os.getpid)[1] != pids[1]


def test_a_call_past_stall_s_prints_every_ranks_stacks(group, capfd):
    group.stall_s = 1.0
    assert group.run(time.sleep, 2.5) == [None, None]  # slow, not failed
    err = capfd.readouterr().err
    assert "labkit: this call is still running after 1 s" in err
    assert "=== kernel (pid" in err and "in _wait_for" in err
    for rank in (0, 1):  # each engine's main thread, in the call
        stacks = err.split(f"=== rank {rank} (pid ")[1].split("\n=== ")[0]
        assert "Current thread" in stacks and "in do_apply" in stacks


def test_interrupting_the_kernel_stops_the_ranks(group, sigint_raises):
    """KeyboardInterrupt while ranks work: they stop too, and the group recovers."""
    def interrupt_me():
        time.sleep(2)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=interrupt_me).start()
    with pytest.raises(KeyboardInterrupt):
        group.run(time.sleep, 3600)
    assert group.damage == "reset"
    assert group.run(abs, -1) == [1, 1]


FAILING_PX = ("%%px\nimport torch, torch.distributed as dist\nif rank == 0:\n"
              "    dist.all_reduce(torch.ones(1))  # rank 1 never joins it")
NEXT_PX = "%%px\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())"
LAST_FAILURE_CELLS = [
    "from labkit import cluster\nranks = cluster.start(2, timeout_s=2)",
    FAILING_PX,
    "failed = ranks.last_failure\n"
    "print('failed:', sorted(failed), 'Timed out' in failed[0])",
    NEXT_PX,
    "print('after:', ranks.last_failure)",
    # The same again, the repair turned off: the next cell fails.
    "ranks._repair = lambda: None",
    FAILING_PX,
    NEXT_PX,
    "ranks.stop()",
]


@pytest.mark.timeout(180)
def test_a_failed_px_cell_leaves_its_failures_for_the_next_cell():
    """What a lesson asserts after a cell that fails on purpose, and the repair:
    without it, the next cell fails on the group the timeout broke. (One kernel
    for both: the repair is turned off for the second failure.)"""
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in LAST_FAILURE_CELLS]
    nbclient.NotebookClient(nb, timeout=120, allow_errors=True,
                            kernel_name="python3").execute()
    out = ["".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                   for o in c.outputs) for c in nb.cells]
    assert nb.cells[1].outputs[-1]["output_type"] == "error"
    assert "failed: [0] True" in out[2]  # rank 0 waited; rank 1 did not fail
    assert out[3].count("sum 2.0") == 2  # the next %%px cell: a repaired group
    assert "after: None" in out[4]  # a %%px cell that ran clears it
    assert nb.cells[6].outputs[-1]["output_type"] == "error"
    assert out[7].count("sum 2.0") < 2, out[7]  # not repaired: fails
    assert nb.cells[7].outputs[-1]["output_type"] == "error"
    assert not any(o["output_type"] == "error" for o in nb.cells[8].outputs)
