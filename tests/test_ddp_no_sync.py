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
    lesson_checks_on_variants,
    misuse_experiment_small,
    nosync_experiment_small,
    one_over_k,
)
from torch import nn

from labkit import checks, data, no_sync


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
    from conftest import step_time_problems  # seconds of one step, as configured

    assert step_time_problems(result, accum_steps=4, repeat=1) == []


def test_stepping_inside_no_sync_diverges_and_stays_apart(ranks):
    result = ranks.run(misuse_experiment_small)[0]
    assert result["bare_call_allreduce_calls"] == result["sync_allreduce_calls"] == 4
    assert result["forward_outside_allreduce_calls"] == 4
    assert result["correct_allreduce_calls"] == 1
    assert result["diverged_max_param_diff"] > 1e-3
    diverged = result["diverged_max_param_diff"]
    assert result["param_diff_after_sync_steps"] > 0.5 * diverged


def test_accumulation_needs_the_one_over_k(ranks):
    """labkit's unscaled path gives K times the large batch's gradient, on real DDP."""
    for rank_result in ranks.run(one_over_k, 4):
        scaled, unscaled = rank_result[True], rank_result[False]
        assert scaled[0] is None, scaled[0]  # 1/K: the large batch's gradient
        assert scaled[1] is not None  # and not K times it
        assert unscaled[0] is not None  # without 1/K: not the large batch's
        assert unscaled[1] is None, unscaled[1]  # but exactly K times it


CLAIMS = ("allreduce_per_update", "grads_match_large_batch", "one_sync_per_update",
          "bare_call_count", "forward_outside_count", "replicas_equal",
          "ddp_grad_whole_batch", "uneven_weighted_by_count")


def test_lesson_checks_fail_on_broken_variants(ranks):
    """Each key check of lessons 03-04 passes on the lesson's code, fails on a break.

    Breaks: no_sync removed, loss not divided by K, optimizer.step inside
    no_sync, the bare call made to work, the forward moved inside, unequal
    shares, micro-batches of unequal sizes averaged as means of means.
    """
    for rank, result in enumerate(ranks.run(lesson_checks_on_variants)):
        assert set(result) == set(CLAIMS)
        for claim in CLAIMS:
            right, broken = result[claim]
            assert right is None, f"rank {rank}, {claim}: {right}"
            assert broken is not None, f"rank {rank}, {claim}: the break passed"


def test_batchnorm_breaks_the_large_batch_equality():
    """Lesson 04's BatchNorm counter-example, and the same net without BatchNorm."""
    torch.manual_seed(1)
    X, y = torch.randn(64, 10), torch.randn(64, 10)

    def net(norm):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(10, 32),
                             nn.BatchNorm1d(32) if norm else nn.Identity(),
                             nn.ReLU(), nn.Linear(32, 10))

    with_bn = no_sync.accumulated_and_whole_grads(net(True), nn.MSELoss(), X, y, 4)
    without = no_sync.accumulated_and_whole_grads(net(False), nn.MSELoss(), X, y, 4)
    checks.grads_differ(*with_bn)
    checks.grads_match(*without)
    with pytest.raises(AssertionError, match="differ from the reference by only"):
        checks.grads_differ(*without)
    with pytest.raises(AssertionError, match="at most 1e-06 allowed"):
        checks.grads_match(*with_bn)


def test_faster_needs_the_margin_in_the_medians():
    sync, nosync_s = [0.10, 0.11, 0.30, 0.10, 0.12], [0.05, 0.06, 0.20, 0.05, 0.07]
    assert checks.faster(nosync_s, sync) == pytest.approx(0.11 / 0.06)  # a stray round
    with pytest.raises(AssertionError, match="1.20 times or more expected"):
        checks.faster([0.095, 0.1, 0.105], [0.1, 0.11, 0.1])  # within the noise
    with pytest.raises(AssertionError):
        checks.faster(sync, nosync_s)  # the other way round


def test_one_sync_per_update_and_call_counts_reject_wrong_counts():
    checks.one_sync_per_update(4, (4, 1), (4 * 8440, 8440), 2110)
    for calls, nbytes in (((4, 4), (4 * 8440, 4 * 8440)), ((4, 1), (4 * 8440, 8000)),
                          ((0, 0), (0, 0))):
        with pytest.raises(AssertionError, match="K = 4"):
            checks.one_sync_per_update(4, calls, nbytes, 2110)
    with pytest.raises(AssertionError, match="4 all-reduce call"):
        checks.allreduce_calls(4, 1)


def test_shard_refuses_uneven_or_too_small_batches():
    X = torch.arange(10.0)
    assert data.shard(X, 1, 2).tolist() == [5.0, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="cannot be shared by 4 ranks"):
        data.shard(X[:3], 0, 4)
    with pytest.raises(ValueError, match="does not split evenly over 3"):
        data.shard(X, 0, 3)


def test_ddp_loss_curves_are_identical_run_to_run(ranks):
    for first, second in ranks.run(convergence_twice):
        assert first == second  # bit for bit, on the CPU
