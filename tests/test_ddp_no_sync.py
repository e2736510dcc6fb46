"""DDP and no_sync on two real ranks, after PyTorch's own DDP tests.

Like `_test_accumulate_gradients_no_sync` and `_test_DDP_niter` in torch's
distributed test suite: a local model trains on the whole global batch, DDP on
each rank's slice, and the two are compared step by step.
"""

import pytest
import torch
from ddp_rank_checks import (
    accumulate_gradients_no_sync,
    convergence_twice,
    count_misuses,
    ddp_niter,
    misuse_experiment_small,
    nosync_experiment_small,
)

from labkit import ddp, models


def test_accumulate_gradients_no_sync(ranks):
    buckets = ranks.run(accumulate_gradients_no_sync)
    assert buckets[0] == buckets[1] > 1  # several buckets were exercised


def test_ddp_niter(ranks):
    assert ranks.run(ddp_niter) == [True, True]


def test_misuses_are_caught_by_counting(ranks):
    counts = ranks.run(count_misuses)[0]
    buckets = counts["correct"]
    assert buckets > 1
    assert counts["sync"] == counts["bare"] == counts["forward_outside"] == 4 * buckets


def test_nosync_experiment_reports_equivalence_and_counts(ranks):
    result = ranks.run(nosync_experiment_small)[0]
    assert result["grad_max_abs_diff"] <= 1e-6
    assert result["replica_max_param_diff"] == 0.0
    calls_per_sync = result["allreduce_calls_per_step_nosync"]
    assert calls_per_sync > 1
    assert result["allreduce_calls_per_step_sync"] == 4 * calls_per_sync
    assert result["step_s_sync"] > 0 and result["step_s_nosync"] > 0


def test_stepping_inside_no_sync_diverges_and_stays_apart(ranks):
    result = ranks.run(misuse_experiment_small)[0]
    assert result["bare_call_allreduce_calls"] == result["sync_allreduce_calls"] == 4
    assert result["forward_outside_allreduce_calls"] == 4
    assert result["correct_allreduce_calls"] == 1
    assert result["diverged_max_param_diff"] > 1e-3
    diverged = result["diverged_max_param_diff"]
    assert result["param_diff_after_sync_steps"] > 0.5 * diverged


def test_accumulation_needs_the_one_over_k():
    """Without 1/K the accumulated gradient is K times the large batch's (1 process)."""
    torch.manual_seed(0)
    model = models.MLP()
    X, y = torch.randn(32, 10), torch.randn(32, 10)
    models.MyLoss()(model(X), y).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    for scale, factor in ((True, 1.0), (False, 4.0)):
        model.zero_grad()
        for Xi, yi in zip(X.chunk(4), y.chunk(4), strict=True):
            loss = models.MyLoss()(model(Xi), yi)
            (loss / 4 if scale else loss).backward()
        for p, r in zip(model.parameters(), reference, strict=True):
            torch.testing.assert_close(p.grad, factor * r)


def test_shard_refuses_uneven_or_too_small_batches():
    X = torch.arange(10.0)
    assert ddp.shard(X, 1, 2).tolist() == [5.0, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="cannot be shared by 4 ranks"):
        ddp.shard(X[:3], 0, 4)
    with pytest.raises(ValueError, match="does not split evenly over 3"):
        ddp.shard(X, 0, 3)


def test_ddp_loss_curves_are_identical_run_to_run(ranks):
    for first, second in ranks.run(convergence_twice):
        assert first == second  # bit for bit, on the CPU
