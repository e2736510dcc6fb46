"""What a failure on the ranks broke, judged from ipyparallel's error entries.

The messages are the ones torch 2.13's gloo raised here (a plain RuntimeError
in both cases) when a peer died during an all_reduce and when one never came:
test_faults.py makes the same failures happen on real ranks.
"""

import subprocess
import sys

import pytest

from labkit.cluster import failures

PEER_DIED = ("RuntimeError", "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
             "tcp/pair.cc:537] Read error [127.0.0.1]:22659: Connection reset by peer")
PEER_LATE = ("RuntimeError", "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
             "tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation "
             "to complete")
TYPO = ("NameError", "name 'modle' is not defined")
ENGINE_DIED = ("EngineError", "Engine 3 died while running task 'abc'")


def _elist(*errors, engine_ids=None):
    ids = engine_ids or range(len(errors))
    return [(name, value, None, {"engine_id": eid})
            for (name, value), eid in zip(errors, ids, strict=True)]


@pytest.mark.parametrize(("errors", "want"), [
    ((TYPO,), None),
    ((TYPO, TYPO), None),
    ((PEER_DIED,), "reset"),
    ((PEER_LATE, TYPO), "reset"),
    ((("DistBackendError", "NCCL communicator was aborted"),), "reset"),
    ((PEER_LATE, ENGINE_DIED), "restart"),
    ((ENGINE_DIED, TYPO), "restart"),
])
def test_damage_tells_a_typo_from_a_broken_collective_and_a_dead_engine(errors, want):
    assert failures.damage(_elist(*errors)) == want


def test_the_worse_damage_wins_and_nothing_downgrades_it():
    assert failures.worse(None, "reset") == "reset"
    assert failures.worse("restart", "reset") == "restart"
    assert failures.worse("reset", None) == "reset"
    assert failures.worse(None, None) is None


def test_failures_name_each_rank_and_the_engine_that_died():
    ranks_of = {10: 0, 11: 1, 3: 1}
    found = failures.failures(
        [("NameError", "x", "\x1b[31mNameError\x1b[0m: x", {"engine_id": 10}),
         ("EngineError", ENGINE_DIED[1], None, {"engine_id": None})],
        lambda eid: ranks_of.get(eid, -1))
    assert found == {0: "NameError: x",
                     1: f"rank 1's process died: {ENGINE_DIED[1]}"}
    err = failures.RankError(found)
    assert str(err).startswith("rank 0, 1 raised an error:")


@pytest.mark.procs
def test_the_engines_package_imports_neither_torch_nor_the_engine_module():
    """`python -m labkit.cluster.engine` imports the package first: torch must
    come after ipyparallel (engine.py), and runpy warns if the engine module is
    imported before it runs it."""
    code = ("import sys, labkit.cluster\n"
            "print(sorted(m for m in ('torch', 'labkit.cluster.engine', "
            "'labkit.cluster.ranks') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"
