"""The communication cost model: definitions, fits, buckets, predictions."""

import os

import pytest
import torch
import torch.distributed as dist
from ddp_rank_checks import (
    allreduce_now,
    bucket_logs,
    hook_grads_match_default,
    interleaved_times_small,
    sent_share_16mib,
    sent_shares,
    timelines,
)

from labkit import buckets, comm, no_sync, workload
from labkit.cluster import launch


def test_ring_factor_and_bandwidths_follow_nccl_tests():
    assert comm.ring_factor(1) == 0
    assert comm.ring_factor(2) == 1
    assert comm.ring_factor(8) == pytest.approx(1.75)
    assert [comm.ring_steps(n) for n in (1, 2, 8)] == [0, 2, 14]
    algbw, busbw = comm.bandwidths(8e6, 0.004, 8)
    assert algbw == pytest.approx(2e9)
    assert busbw == pytest.approx(3.5e9)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size"):
            comm.ring_factor(bad)
        with pytest.raises(ValueError, match="world_size"):
            comm.ring_steps(bad)
    with pytest.raises(ValueError, match="seconds must be > 0"):
        comm.bandwidths(8e6, 0.0, 2)


def test_alpha_beta_pays_one_alpha_per_ring_step():
    ab = comm.AlphaBeta(alpha=10e-6, beta=1e9)
    assert ab.time(1e6, 1) == 0.0  # one rank sends nothing
    assert ab.time(1e6, 2) == pytest.approx(2 * 10e-6 + 1e6 / 1e9)
    assert ab.time(1e6, 8) == pytest.approx(14 * 10e-6 + 1.75 * 1e6 / 1e9)
    # Latency grows with n, the bytes term levels off at 2 S / beta.
    assert ab.time(0, 64) == pytest.approx(63 * ab.time(0, 2))
    assert ab.time(1e9, 64) < 2 * 1e9 / 1e9 + 126 * 10e-6


def test_alpha_beta_fit_recovers_the_parameters_at_any_world_size():
    truth = comm.AlphaBeta(alpha=50e-6, beta=2e9)
    sizes = [4**k * 1024 for k in range(9)]
    for n in (2, 4):
        fit = comm.fit_alpha_beta(sizes, [truth.time(s, n) for s in sizes], n)
        assert fit.alpha == pytest.approx(truth.alpha, rel=1e-6)
        assert fit.beta == pytest.approx(truth.beta, rel=1e-6)
    # Fitted on 2 ranks, it predicts 8 ranks through the step count.
    fit = comm.fit_alpha_beta(sizes, [truth.time(s, 2) for s in sizes], 2)
    assert fit.time(1024, 8) == pytest.approx(truth.time(1024, 8), rel=1e-6)
    seconds = [truth.time(s, 4) for s in sizes]
    with pytest.raises(ValueError, match="do not grow"):
        comm.fit_alpha_beta(sizes, list(reversed(seconds)), 4)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        comm.fit_alpha_beta(sizes, seconds, 1)
    with pytest.raises(ValueError, match="as many times as sizes"):
        comm.fit_alpha_beta(sizes, seconds[:-1], 4)
    with pytest.raises(ValueError, match="> 0"):
        comm.fit_alpha_beta(sizes, [0.0] * len(sizes), 4)


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


def test_ddp_default_buckets_are_rebuilt_after_the_first_step(ranks):
    # What DDP(model) does in torch 2.13 on lesson 05's MLP: one bucket in
    # step 1 (DDP does not know the gradients' order yet), then buckets
    # rebuilt in arrival order, the first closed once past 1 MiB
    # (dist._DEFAULT_FIRST_BUCKET_BYTES). bucket_cap_mb=25 is not the same.
    for logs, param_bytes in ranks.run(bucket_logs):
        assert param_bytes == 4 * 2_120_714
        buckets.check_buckets_rebuilt(logs[None], param_bytes)
        assert logs[None][1] == [4_239_400, 4_243_456]  # 4.04 + 4.05 MiB
        assert logs[None][1][0] >= dist._DEFAULT_FIRST_BUCKET_BYTES
        assert logs[25] == [[param_bytes]] * 3
        assert len(logs[1][1]) == 3 and sum(logs[1][1]) == param_bytes
        # The broken variant: an explicit 25 MiB cap never rebuilds a split.
        with pytest.raises(AssertionError, match="no rebuild"):
            buckets.check_buckets_rebuilt(logs[25], param_bytes)


def test_check_buckets_rebuilt_refuses_bad_logs():
    with pytest.raises(ValueError, match="at least 3"):
        buckets.check_buckets_rebuilt([[8]], 8)
    with pytest.raises(AssertionError, match="sum to 7 bytes, not 8"):
        buckets.check_buckets_rebuilt([[8], [4, 3], [4, 4]], 8)
    with pytest.raises(AssertionError, match="step 1 sent 2 buckets"):
        buckets.check_buckets_rebuilt([[4, 4], [4, 4], [4, 4]], 8)
    with pytest.raises(AssertionError, match="no rebuild"):
        buckets.check_buckets_rebuilt([[8], [4, 4], [2, 6]], 8)
    buckets.check_buckets_rebuilt([[8], [4, 4], [4, 4]], 8)


def test_lesson_05s_hook_gives_the_default_hooks_gradients(ranks):
    """Lesson 05 says its hook does what DDP's default does (mean over the ranks)."""
    assert ranks.run(hook_grads_match_default) == [0.0, 0.0]
    assert all(d > 0 for d in ranks.run(hook_grads_match_default, "no_mean"))


def test_overlap_check_passes_with_ddp_and_fails_when_all_reduces_wait(ranks):
    for steps in ranks.run(timelines):
        assert len(steps) == 3 and len(steps[0]["events"]) == 1
        buckets.check_overlap(steps)  # the lesson's assertion
        for step in steps[1:]:
            assert len(step["events"]) > 3
            assert step["grad_end"] <= step["backward_end"]
    # The broken variant: every all-reduce held until the last bucket is ready.
    for steps in ranks.run(timelines, True):
        assert all(s["hidden_s"] == 0 and s["exposed_s"] > 0 for s in steps)
        with pytest.raises(AssertionError, match="nothing overlapped"):
            buckets.check_overlap(steps)


def test_split_at_counts_each_second_once():
    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]
    assert buckets.split_at(spans, 2.5) == pytest.approx((2.5, 1.5))
    assert buckets.split_at(spans, 0.0) == pytest.approx((0.0, 4.0))
    assert buckets.split_at([], 1.0) == (0.0, 0.0)
    with pytest.raises(ValueError, match="must end after it starts"):
        buckets.split_at([(2.0, 1.0)], 1.0)
    with pytest.raises(ValueError, match="finite"):
        buckets.split_at(spans, float("nan"))


def test_check_overlap_refuses_too_few_steps():
    step = {"events": [(0.0, 1.0)], "grad_end": 0.5, "hidden_s": 0.5}
    with pytest.raises(ValueError, match="need more than skip=1"):
        buckets.check_overlap([step])
    with pytest.raises(ValueError, match="need more than skip=-1"):
        buckets.check_overlap([step, step], skip=-1)
    buckets.check_overlap([step, step])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        buckets.bucket_timeline(0, 2, workload.Config(), allreduce_now, steps=0)


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
    cfg = workload.Config()
    model = workload.make_model(cfg)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        no_sync.interleaved_step_times(model, None, [], (1,), 0)
    with pytest.raises(ValueError, match="K = 4 needs 4 micro-batches, got 2"):
        no_sync.interleaved_step_times(model, None, [None, None], (1, 4), 3)


@pytest.mark.parametrize("beta", list(comm.LINKS.values()) + [1e9])
def test_predicted_speedup_is_sane(beta):
    ab = comm.AlphaBeta(30e-6, beta)
    buckets = [4e6, 4e6, 32e6]
    for n in (1, 2, 16, 256):
        for K in (1, 4):
            fast = comm.predicted_speedup(n, K, True, buckets, 0.01, ab, 0.001)
            slow = comm.predicted_speedup(n, K, False, buckets, 0.01, ab, 0.001)
            assert 0 < slow <= fast <= n
    assert comm.predicted_speedup(1, 4, False, buckets, 0.01, ab) == pytest.approx(1.0)
    # Two all-reduces pay alpha twice: fewer buckets, less latency.
    one = comm.predicted_speedup(64, 1, False, [8e6], 0.01, ab)
    assert comm.predicted_speedup(64, 1, False, [4e6, 4e6], 0.01, ab) < one


def test_predicted_speedup_refuses_bad_input():
    ab = comm.AlphaBeta(30e-6, 1e9)
    with pytest.raises(ValueError, match="bucket_bytes"):
        comm.predicted_speedup(2, 1, False, [], 0.01, ab)
    with pytest.raises(ValueError, match="bucket_bytes"):
        comm.predicted_speedup(2, 1, False, [4e6, 0], 0.01, ab)
    with pytest.raises(ValueError, match="K must be >= 1"):
        comm.predicted_speedup(2, 0, False, [4e6], 0.01, ab)
    with pytest.raises(ValueError, match="world_size"):
        comm.predicted_speedup(0, 1, False, [4e6], 0.01, ab)
    with pytest.raises(ValueError, match="compute_s"):
        comm.predicted_speedup(2, 1, False, [4e6], 0.0, ab)


def test_nosync_config_default_means_ddp_default():
    cfg = workload.Config()
    assert cfg.bucket_cap_mb is None
    cfg.check()
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="bucket_cap_mb must be > 0"):
            workload.Config(bucket_cap_mb=bad).check()


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc")
def test_busbw_is_what_each_rank_sends_over_time(ranks):
    # busbw = algbw * 2(n-1)/n because each rank of a ring sends 2(n-1)/n of
    # S: counted by the kernel on both ranks (2 ranks: all of S). A tree, or a
    # reduce to rank 0 and a broadcast back, would send other shares.
    for shares in ranks.run(sent_shares):
        share = shares[16 * 2**20]
        assert share == pytest.approx(comm.ring_factor(2), rel=0.01)
        algbw, busbw = comm.bandwidths(16 * 2**20, 0.01, 2)
        assert busbw == pytest.approx(algbw * share, rel=0.01)


@pytest.mark.procs
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc")
def test_three_ranks_each_send_four_thirds_of_the_message():
    # On 3 ranks a ring rank sends 2(n-1)/n = 4/3 of S; reduce-then-broadcast
    # through rank 0 would not send the same on every rank.
    shares = launch.run(sent_share_16mib, {}, world_size=3)
    assert shares == pytest.approx([comm.ring_factor(3)] * 3, rel=0.01)


def test_sent_per_allreduce_refuses_bad_input():
    with pytest.raises(ValueError, match="nbytes >= 4"):
        comm.sent_per_allreduce(2)
    with pytest.raises(ValueError, match="repeat >= 1"):
        comm.sent_per_allreduce(1024, repeat=0)


def test_the_workload_runs_on_this_rank_s_gpu_under_nccl(monkeypatch):
    """No GPU here: fake a nccl group and the current device, as a GPU rank has."""
    from labkit import workload

    assert workload.device() == torch.device("cpu")  # no group: the CPU
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert workload.device() == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert workload.device() == torch.device("cpu")


def test_sent_share_is_the_ring_s_except_gloo_s_reduce_scatter():
    # The ring's reduce-scatter and all-gather are an all-reduce's halves;
    # gloo's reduce-scatter all-reduces the whole input (measured below).
    for n in (1, 2, 3, 8):
        whole = comm.ring_factor(n)
        assert comm.sent_share("all_reduce", n) == whole
        assert comm.sent_share("reduce_scatter", n) == whole / 2
        assert comm.sent_share("all_gather", n) == whole / 2
        assert comm.sent_share("reduce_scatter", n, "gloo") == whole
        assert comm.sent_share("all_gather", n, "gloo") == whole / 2
    with pytest.raises(ValueError, match="op must be one of"):
        comm.sent_share("broadcast", 2)
    with pytest.raises(ValueError, match="implementation must be one of"):
        comm.sent_share("reduce_scatter", 2, "nccl")
    with pytest.raises(ValueError, match="world_size"):
        comm.sent_share("all_reduce", 0)


def test_gloo_prices_its_reduce_scatter_as_the_all_reduce():
    ab = comm.AlphaBeta(alpha=10e-6, beta=1e9)
    for n in (2, 3, 8):
        assert ab.reduce_scatter_time(1e6, n) == pytest.approx(ab.time(1e6, n) / 2)
        assert ab.reduce_scatter_time(1e6, n, "gloo") == ab.time(1e6, n)
        assert ab.all_gather_time(1e6, n) == pytest.approx(ab.time(1e6, n) / 2)
    assert ab.reduce_scatter_time(1e6, 1, "gloo") == 0.0
    with pytest.raises(ValueError, match="implementation must be one of"):
        ab.reduce_scatter_time(1e6, 2, "tree")


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc")
def test_gloo_s_reduce_scatter_writes_an_all_reduce_s_bytes(ranks):
    # Counted by the kernel on both ranks: a ring reduce-scatter would write
    # half of what the all-reduce writes; gloo's writes all of it.
    ranks.execute(
        "import torch\nimport torch.distributed as dist\nfrom labkit import comm\n"
        "n = dist.get_world_size()\n"
        "S = 4 * 2**20 * n\n"
        "whole, piece = torch.ones(S // 4), torch.empty(S // 4 // n)\n"
        "written = {op: comm.bytes_written_per_call(fn) / S for op, fn in {\n"
        "    'all_reduce': lambda: dist.all_reduce(whole),\n"
        "    'reduce_scatter': lambda: dist.reduce_scatter_single(piece, whole),\n"
        "    'all_gather': lambda: dist.all_gather_single(whole, piece)}.items()}\n")
    for written in ranks.pull("written"):
        for op, share in written.items():
            assert share == pytest.approx(comm.sent_share(op, 2, "gloo"), rel=0.01), op
        assert written["reduce_scatter"] > 1.9 * comm.sent_share("reduce_scatter", 2)


def test_bytes_written_per_call_refuses_bad_input():
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        comm.bytes_written_per_call(lambda: None, repeat=0)


def test_a_stall_at_the_start_of_a_sweep_leaves_the_fit_standing(monkeypatch):
    """A busy moment as the sweep begins (the first 15 calls 30 ms late) falls on
    one round of every size, not on the small sizes alone: timed one size after
    the other, their medians rose above the large ones' and no bandwidth fitted."""
    import time

    calls = []

    def all_reduce(x, *args, **kwargs):  # 50 us + the bytes at 2 GB/s
        calls.append(x.numel())
        time.sleep(30e-3 if len(calls) <= 15 else 50e-6 + x.numel() * 4 / 2e9)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: None)
    monkeypatch.setattr(dist, "get_backend", lambda *args, **kwargs: "gloo")
    sizes = [2**k for k in range(10, 23, 2)]  # 1 KiB to 4 MiB, as lesson 13
    seconds = comm.allreduce_sweep(sizes, repeat=7)
    assert max(seconds) < 20e-3, seconds  # no median is a stalled call
    ab = comm.fit_alpha_beta(sizes, seconds, world_size=2)
    assert 0.5e9 < ab.beta < 8e9, ab  # 2 GB/s given; sleeps only add to the times


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_lesson_05s_sweep_cell_draws_every_round_or_fails(lang):
    """The kernel cells after the sweep (the fit, then its folded check and
    figure), on fixed rounds: 7 a size are drawn (a point each, the median a
    line); a round short, and the assert fails."""
    from types import SimpleNamespace

    from lesson_cells import finder
    from matplotlib import pyplot as plt

    import labkit
    from labkit import plots

    find = finder("05_communication", lang)
    cell = find("ranks.pull(\"rounds\")") + find('title="allreduce_rounds_title"')
    sizes = [4**k * 1024 for k in range(9)]
    good = [[1e-4 + s / 1e9 * (1 + j / 10) for j in range(7)] for s in sizes]
    for rounds, ok in ((good, True), ([r[:6] for r in good], False)):
        pulled = {"sizes": [sizes, sizes], "rounds": [rounds, rounds]}
        ns = {"comm": comm, "labkit": labkit, "plots": plots,
              "ranks": SimpleNamespace(pull=pulled.__getitem__)}
        try:
            if ok:
                exec(cell, ns)
                points, median, _ = ns["fig"].axes[0].get_lines()
                assert len(points.get_xdata()) == 7 * 9
                assert list(median.get_ydata()) == [r[3] * 1e3 for r in good]
            else:
                with pytest.raises(AssertionError):
                    exec(cell, ns)
        finally:
            plt.close("all")


def _step(events, grad_end):
    return {"events": events, "grad_end": grad_end}


def test_check_by_cap_passes_fewer_buckets_and_fails_on_wrong_panels():
    """Lesson 05's small multiples over bucket_cap_mb: what the cell asserts."""
    small = _step([(0.001, 0.002), (0.002, 0.004), (0.004, 0.006)], 0.005)
    default = _step([(0.003, 0.005), (0.005, 0.007)], 0.005)
    one = _step([(0.0052, 0.008)], 0.005)
    buckets.check_by_cap([small, default, one])  # the lesson's shape
    with pytest.raises(AssertionError, match="a larger cap must make fewer"):
        buckets.check_by_cap([default, default, one])  # equal caps
    with pytest.raises(AssertionError, match="a larger cap must make fewer"):
        buckets.check_by_cap([default, small, one])  # panels swapped
    with pytest.raises(AssertionError, match="expected one bucket"):
        buckets.check_by_cap([small, default])  # the largest cap still splits
    with pytest.raises(AssertionError, match="before the last gradient"):
        buckets.check_by_cap([small, _step([(0.004, 0.008)], 0.005)])  # swapped times
    with pytest.raises(ValueError, match="at least 2 caps"):
        buckets.check_by_cap([one])
