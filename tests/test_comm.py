"""The communication cost model: definitions, fits, buckets, predictions."""

import pytest
from ddp_rank_checks import bucket_counts, interleaved_times_small

from labkit import comm, models, nosync


def test_ring_factor_and_bandwidths_follow_nccl_tests():
    assert comm.ring_factor(1) == 0
    assert comm.ring_factor(2) == 1
    assert comm.ring_factor(8) == pytest.approx(1.75)
    algbw, busbw = comm.bandwidths(8e6, 0.004, 8)
    assert algbw == pytest.approx(2e9)
    assert busbw == pytest.approx(3.5e9)
    with pytest.raises(ValueError, match="world_size"):
        comm.ring_factor(0)


def test_alpha_beta_fit_recovers_the_parameters():
    truth = comm.AlphaBeta(alpha=50e-6, beta=2e9)
    sizes = [4**k * 1024 for k in range(9)]
    seconds = [truth.time(s, 4) for s in sizes]
    fit = comm.fit_alpha_beta(sizes, seconds, 4)
    assert fit.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fit.beta == pytest.approx(truth.beta, rel=1e-6)
    assert truth.time(1e6, 1) == 0.0  # one rank sends nothing
    with pytest.raises(ValueError, match="do not grow"):
        comm.fit_alpha_beta(sizes, list(reversed(seconds)), 4)


def test_step_model_fit_predicts_unseen_k():
    truth = comm.StepModel(compute_s=0.004, sync_s=0.01, optimizer_s=0.001)
    times = {k: (truth.predict(k, False), truth.predict(k, True)) for k in (1, 2, 4, 8)}
    fit = comm.fit_step_model(times, fit_on=(1, 2, 4))
    assert comm.max_rel_error(fit, times) < 1e-9
    assert fit.predict(8, True) == pytest.approx(times[8][1])


def test_step_model_parts_are_never_negative():
    # A first micro-batch 3 ms cheaper than the others acts as o = -3 ms: the
    # fit keeps o at 0 and fits c and s again, rather than only clipping o
    # (which would add 3 ms to every prediction).
    truth = comm.StepModel(compute_s=0.010, sync_s=0.012, optimizer_s=-0.003)
    times = {k: (truth.predict(k, False), truth.predict(k, True)) for k in (1, 2, 4, 8)}
    fit = comm.fit_step_model(times, fit_on=(1, 2, 4))
    assert fit.optimizer_s == 0.0
    assert fit.compute_s > 0 and fit.sync_s > 0
    clipped = comm.StepModel(truth.compute_s, truth.sync_s, 0.0)
    assert comm.max_rel_error(fit, times) < comm.max_rel_error(clipped, times)


def test_bucket_plan_matches_what_ddp_does(ranks):
    for cap, (planned, calls) in ranks.run(bucket_counts)[0].items():
        assert planned == calls, cap


def test_interleaved_step_times_run_every_k_in_both_modes(ranks):
    # block_s=0: one step per block, so the all-reduces can be counted: each
    # (K, mode) runs one warm-up step and one step per round, and each K one
    # synchronized step that sets the block length; a synchronized step
    # all-reduces K times, a no_sync step once.
    ks, rounds = (1, 2, 3), 2
    for times, calls in ranks.run(interleaved_times_small, ks, rounds):
        assert sorted(times) == list(ks)
        assert all(s > 0 and n > 0 for s, n in times.values())
        assert calls == sum((1 + rounds) * (k + 1) + k for k in ks)


def test_interleaved_step_times_refuse_bad_arguments():
    cfg = nosync.NoSyncConfig()
    model = nosync.make_model(cfg)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        nosync.interleaved_step_times(model, None, [], (1,), 0)
    with pytest.raises(ValueError, match="K = 4 needs 4 micro-batches, got 2"):
        nosync.interleaved_step_times(model, None, [None, None], (1, 4), 3)


def test_bucket_sizes_close_a_bucket_once_it_is_full():
    model = models.WideMLP(hidden=1024, depth=3)  # two 4 MiB weights
    sizes = comm.bucket_sizes(model, bucket_cap_mb=4)
    assert len(sizes) == 3 and sum(sizes) == 4 * models.count_params(model)
    assert comm.bucket_sizes(model, 25) == [4 * models.count_params(model)]


@pytest.mark.parametrize("beta", list(comm.LINKS.values()) + [1e9])
def test_predicted_speedup_is_sane(beta):
    ab = comm.AlphaBeta(30e-6, beta)
    for n in (1, 2, 16, 256):
        for K in (1, 4):
            fast = comm.predicted_speedup(n, K, True, 10**7, 0.01, ab, 0.001)
            slow = comm.predicted_speedup(n, K, False, 10**7, 0.01, ab, 0.001)
            assert 0 < slow <= fast <= n
    assert comm.predicted_speedup(1, 4, False, 10**7, 0.01, ab) == pytest.approx(1.0)
