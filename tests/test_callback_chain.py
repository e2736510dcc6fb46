"""labkit.callback_chain and the step model's term for it.

The term is measured apart (a chain of PowerSGD's shape on the ranks), so
these tests check what the model does with it, that the chain has the hook's
shape (all-reduces issued inside callbacks), and that
the measurement holds together; never its seconds (the machine is shared).
"""

import importlib.util
from pathlib import Path

import callback_chain_checks as trials
import pytest

from labkit import callback_chain, comm, send_less

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

AB = comm.AlphaBeta(alpha=1e-4, beta=1e9)
PLAIN, SMALL = send_less.Sent(8_000_000, 2), send_less.Sent(40_000, 3)


def test_the_step_model_adds_the_chain_s_wait_and_is_unchanged_without_it():
    with_compute = send_less.predicted_step_s(0.02, PLAIN, SMALL, AB, 2, 0.005)
    # Default 0: today's model to the last bit (lessons 06 and 12 unchanged).
    assert send_less.predicted_step_s(0.02, PLAIN, SMALL, AB, 2, 0.005, 0.0) \
        == with_compute
    assert send_less.predicted_step_s(0.02, PLAIN, SMALL, AB, 2, 0.005,
                                      chain_wait_s=0.004) \
        == pytest.approx(with_compute + 0.004)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_step_model_refuses_a_chain_wait_that_is_not_finite(bad):
    with pytest.raises(ValueError, match="chain_wait_s must be a finite"):
        send_less.predicted_step_s(0.02, PLAIN, SMALL, AB, 2, 0.0, bad)


def test_only_powersgd_issues_all_reduces_in_callbacks():
    # P and Q of each bucket: two of its three all-reduces.
    assert callback_chain.chained_calls("PowerSGD r=2", 3) == 2
    assert callback_chain.chained_calls("PowerSGD r=1", 6) == 4
    for name in ("DDP", "fp16", "static_graph", "ZeRO + Adam"):
        assert callback_chain.chained_calls(name, 2) == 0


def _row(name, calls):
    return {"step_s": 0.03, "bytes": [40_000], "calls": [calls],
            "sent": [send_less.Sent(8_000_000 if name == "DDP" else 36_984, calls)],
            "local_step_s": 0.02, "final_loss": 0.1}


def test_the_bench_adds_the_measured_chain_to_powersgd_only():
    runs = {"DDP": _row("DDP", 2), "fp16": _row("fp16", 2),
            "PowerSGD r=1": _row("PowerSGD r=1", 3)}
    both = [runs, runs]
    chains = {"PowerSGD r=1": {"per_call_s": 0.002}}
    without = bench.levers_predictions(both, AB)
    table = bench.levers_predictions(both, AB, 2, chains)
    assert table["PowerSGD r=1"]["chain_wait_s"] == pytest.approx(0.004)  # P and Q
    assert table["PowerSGD r=1"]["predicted_ratio"] == pytest.approx(
        without["PowerSGD r=1"]["predicted_ratio"] + 0.004 / 0.03)
    assert table["fp16"] == without["fp16"]
    # The bench's chain has PowerSGD's shape: a third of its bytes per call,
    # its added compute in four pieces.
    shapes = bench.chain_shapes({"PowerSGD r=1": {
        "bytes_per_step": 36_984, "added_compute_s": 0.004}, "fp16": {}})
    assert shapes == {"PowerSGD r=1": (3082, pytest.approx(0.001))}


def test_the_chain_issues_all_but_its_first_all_reduce_inside_callbacks(ranks):
    # The hook's shape: the first from the caller, P's and Q's from callbacks
    # (which gloo runs on its own threads, unless the future is already
    # complete when the callback is attached: then the caller runs it, as in
    # torch's hook). A chain issuing all three from the caller would measure
    # isolated all-reduces and find no chain at all.
    for issued in ranks.run(trials.issuing_threads, 3):
        assert issued == [False, True, True]


def test_the_chain_wait_is_what_the_chain_adds_beyond_its_parts(ranks):
    for out in ranks.run(callback_chain.chain_wait_s, 3, 3082, 1e-3, 3):
        assert out["chain_s"] > out["local_s"] > 0  # the chain sends, its copy not
        assert out["isolated_s"] > 0
        assert set(out) == {"chain_s", "local_s", "isolated_s", "per_call_s"}
    with pytest.raises(Exception, match="calls must be at least 2"):
        ranks.run(callback_chain.chain_wait_s, 1)
