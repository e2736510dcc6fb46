"""labkit.send_less: what each way to send less sends, holds and costs, and its check.

The lesson asserts the measured relations (fp16 half, ZeRO's state shared out,
one gradient copy saved); these tests show the counting they rest on can tell
the difference, and that the PowerSGD exercise's check fails each typical
wrong answer with its hint.
"""

import math

import pytest
import torch
import torch.distributed as dist

from labkit import comm, comm_counting, exercises, send_less


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sent_keeps_all_reduces_and_broadcasts_apart(one_rank):
    # Counting itself: tests/test_comm_counting.py.
    with comm_counting.CollectiveLog() as sent:
        dist.all_reduce(torch.ones(10))
        dist.broadcast(tensor=torch.ones(3, dtype=torch.float16), src=0)  # as ZeRO does
        dist.broadcast(torch.ones(2), 0)
    assert send_less.Sent.of(sent) == send_less.Sent(40, 1, 14, 2)
    sent.reset()
    assert send_less.Sent.of(sent) == send_less.Sent(0, 0, 0, 0)


def test_storage_bytes_counts_a_shared_storage_once():
    model = torch.nn.Linear(4, 2)  # 8 + 2 values
    flat = torch.zeros(10)
    model.weight.grad = flat[:8].view(2, 4)  # views into one bucket-like buffer
    model.bias.grad = flat[8:]
    assert send_less.storage_bytes(model) == 40
    assert send_less.storage_bytes(model, {flat.untyped_storage().data_ptr(): 40}) == 40
    model.bias.grad = torch.zeros(2)  # a storage of its own: counted too
    assert send_less.storage_bytes(model) == 48


def test_optimizer_state_bytes_of_adam_are_twice_the_parameters():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    # exp_avg and exp_avg_sq per parameter, and a step count per parameter
    state = send_less.optimizer_state_bytes(optimizer)
    assert state >= 2 * 40 and state - 2 * 40 <= 2 * 8


def test_the_step_model_with_a_compression_factor():
    ab = comm.AlphaBeta(alpha=1e-4, beta=1e9)
    plain = (8_000_000, 2)
    same = send_less.predicted_step_s(0.02, plain, plain, ab, 2)
    assert same == pytest.approx(0.02)
    half = send_less.predicted_step_s(0.02, plain, (4_000_000, 2), ab, 2)
    saved = 2 * (ab.time(4e6, 2) - ab.time(2e6, 2))
    assert half == pytest.approx(0.02 - saved)
    assert send_less.predicted_step_s(0.02, plain, (0, 0), ab, 2) < half


def test_the_step_model_prices_a_broadcast_as_one_source_sending():
    ab = comm.AlphaBeta(alpha=1e-4, beta=1e9)
    plain = send_less.Sent(8_000_000, 2)
    zero = send_less.Sent(8_000_000, 2, broadcast_bytes=8_000_000, broadcast_calls=8)
    step = send_less.predicted_step_s(0.02, plain, zero, ab, 2)
    # On 2 ranks: 8 messages of 1 MB, one latency each; not 8 ring all-reduces.
    assert step == pytest.approx(0.02 + 8 * (1e-4 + 1e6 / 1e9))
    assert ab.broadcast_time(1e6, 2) < ab.time(1e6, 2)  # one latency step, not two
    assert ab.broadcast_time(1e6, 1) == 0.0


def test_the_step_model_adds_the_compute_a_method_adds():
    ab = comm.AlphaBeta(alpha=1e-4, beta=1e9)
    plain, small = send_less.Sent(8_000_000, 2), send_less.Sent(40_000, 3)
    bytes_only = send_less.predicted_step_s(0.02, plain, small, ab, 2)
    # No added compute: the bytes-only model, to the last bit.
    assert send_less.predicted_step_s(0.02, plain, small, ab, 2, 0.0) == bytes_only
    assert send_less.predicted_step_s(0.02, plain, small, ab, 2,
                                      added_compute_s=0.005) == pytest.approx(
        bytes_only + 0.005)
    # Less local work than DDP's (ZeRO updates a shard): the step shrinks.
    assert send_less.predicted_step_s(0.02, plain, plain, ab, 2, -0.002) \
        == pytest.approx(0.018)


def test_the_step_model_prices_a_method_s_all_reduces_with_their_own_fit():
    ab, slow16 = comm.AlphaBeta(alpha=1e-4, beta=1e9), comm.AlphaBeta(1e-4, 4e8)
    plain, half = send_less.Sent(8_000_000, 2), send_less.Sent(4_000_000, 2)
    as_fp32 = send_less.predicted_step_s(0.02, plain, half, ab, 2)
    as_fp16 = send_less.predicted_step_s(0.02, plain, half, ab, 2, sent_ab=slow16)
    # fp16's 2 MB halves, priced by the slower fit: the difference is the fits'
    assert as_fp16 - as_fp32 == pytest.approx(
        2 * (slow16.time(2e6, 2) - ab.time(2e6, 2)))


def test_what_ddp_hid_is_hidden_again_only_by_a_method_that_overlaps():
    ab = comm.AlphaBeta(alpha=1e-4, beta=1e9)
    plain, small = send_less.Sent(8_000_000, 2), send_less.Sent(40_000, 3)
    comm_ddp = send_less.predicted_step_s(0.0, (0, 0), plain, ab, 2)
    # a local step of 15 ms and a step of 20 ms: 15 + comm - 20 was hidden
    hid = send_less.hidden_s(0.02, 0.015, plain, ab, 2)
    assert hid == pytest.approx(0.015 + comm_ddp - 0.02)
    assert send_less.hidden_s(0.02, 0.001, plain, ab, 2) == 0.0  # never below 0
    # DDP itself, hiding as much as it did: its own step back
    assert send_less.predicted_step_s(0.02, plain, plain, ab, 2,
                                      ddp_hidden_s=hid) == pytest.approx(0.02)
    overlapping = send_less.predicted_step_s(0.02, plain, small, ab, 2,
                                             ddp_hidden_s=hid)
    after = send_less.predicted_step_s(0.02, plain, small, ab, 2, ddp_hidden_s=hid,
                                       hides=False)
    own = send_less.predicted_step_s(0.0, (0, 0), small, ab, 2)
    assert own < hid  # the small method's all-reduces are shorter than what DDP hid
    # it hides at most all of its own; after the backward, none
    assert overlapping == pytest.approx(0.015 + 0.0)
    assert after == pytest.approx(0.015 + own)
    assert send_less.hides("fp16") and send_less.hides("ZeRO + Adam")
    assert not send_less.hides("PowerSGD r=1")
    with pytest.raises(ValueError, match="ddp_hidden_s must be >= 0"):
        send_less.predicted_step_s(0.02, plain, small, ab, 2, ddp_hidden_s=-0.001)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_step_model_refuses_added_compute_that_is_not_finite(bad):
    ab = comm.AlphaBeta(alpha=1e-4, beta=1e9)
    plain = send_less.Sent(8_000_000, 2)
    with pytest.raises(ValueError, match="added_compute_s must be a finite"):
        send_less.predicted_step_s(0.02, plain, plain, ab, 2, bad)


def _sends_nothing() -> tuple[list[float], list[float], list[float]]:
    """Runs on every rank: an all-reduce and a broadcast of the rank's own
    values under no_communication (sync and async, as hooks and ZeRO call
    them), then a real all-reduce after it."""
    rank = dist.get_rank()
    x, b = torch.full((3,), float(rank + 1)), torch.full((2,), float(rank + 1))
    with send_less.no_communication():
        assert dist.all_reduce(x) is None
        future = dist.all_reduce(x, async_op=True).get_future()
        assert future.wait()[0] is x
        handle = dist.broadcast(tensor=b, src=0, async_op=True)
        assert handle.wait() and handle.is_completed()
    kept, broadcast = x.tolist(), b.tolist()
    dist.all_reduce(x)  # put back: a real one sums again
    return kept, broadcast, x.tolist()


def test_no_communication_leaves_each_rank_its_own_values(ranks):
    for rank, (kept, broadcast, summed) in enumerate(ranks.run(_sends_nothing)):
        assert kept == [rank + 1.0] * 3  # not summed over the ranks
        assert broadcast == [rank + 1.0] * 2  # not rank 0's
        assert summed == [3.0] * 3  # 1 + 2: the real all-reduce is back


def _compare_logged(names: tuple[str, ...], steps: int) -> tuple[dict, int]:
    """Runs on every rank: compare_methods with its local steps, and every
    collective that reached torch.distributed meanwhile."""
    with comm_counting.CollectiveLog() as log:
        runs = send_less.compare_methods(names, None, steps, True)
    return runs, len(log.calls)


def test_the_compute_powersgd_adds_shows_in_its_local_step(ranks):
    """Its step sending nothing, against DDP's, in the same rounds. On the large
    MLP here r = 1 added 4.5-5.4 ms and r = 4 6.0-6.8 ms to DDP's local step
    (22 medians of 100 rounds in 11 bench runs, 2026-12-06): r = 4 more by about 1 ms,
    within a busy machine's noise over 20 rounds, so the test asserts that
    each adds at least 1 ms, which a local step skipping the hook's products
    (about 0) would not."""
    names = ("DDP", "PowerSGD r=1", "PowerSGD r=4")
    for by, calls in ranks.run(_compare_logged, names, 20):
        # The local steps sent nothing: only the real steps' collectives, and
        # one all-reduce of each method's losses at the end.
        assert calls == sum(sum(by[name]["calls"]) + 1 for name in names)
        local = {name: by[name]["local_step_s"] for name in names}
        added = {r: local[f"PowerSGD r={r}"] - local["DDP"] for r in (1, 4)}
        assert min(added.values()) > 1e-3, local
        assert all(by[name]["step_s"] > 0 for name in names)


def test_gradient_as_bucket_view_still_copies_with_set_to_none(one_rank):
    """Lesson 06: the view saves memory, but zero_grad(set_to_none=True) drops the
    alias at every step, so DDP writes each gradient into its bucket again."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import profile

    def writes_into_buckets(set_to_none):
        torch.manual_seed(0)
        layers = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
        model = DDP(layers, gradient_as_bucket_view=True)
        for _ in range(3):  # past DDP's bucket rebuild
            model.zero_grad(set_to_none=set_to_none)
            with profile() as prof:
                model(torch.ones(2, 16)).sum().backward()
        grads = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        assert len(grads) == 1  # after the step, every .grad is a view into one bucket
        # The reducer copies a gradient that is not the bucket's alias into it
        # (at::mul_out with 1/world size, or copy_ under a comm hook).
        return sum(e.count for e in prof.key_averages()
                   if e.key in ("aten::mul", "aten::copy_"))

    # One more write per parameter when set_to_none drops the alias.
    assert writes_into_buckets(True) - writes_into_buckets(False) == 4


def test_build_names_the_methods_it_knows():
    with pytest.raises(ValueError, match="unknown method 'bf16'.*PowerSGD r=1"):
        send_less.build("bf16", send_less.large_config())


def test_a_run_too_short_for_powersgds_warm_up_is_refused():
    with pytest.raises(ValueError, match="steps must be at least 12"):
        send_less.compare_methods(steps=11)  # before any process group is needed


def test_small_run_of_every_method(ranks):
    """Every method on a small MLP: the relations lesson 06 asserts on the large one."""
    cfg = send_less.large_config(hidden=64, depth=2)
    runs = ranks.run(send_less.compare_methods, send_less.METHODS, cfg, 12)
    by = runs[0]
    plain = by["DDP"]["bytes"][-1]
    assert plain == 4 * sum(p.numel() for p in send_less.workload.make_model(cfg)
                            .parameters())
    assert 2 * by["fp16"]["bytes"][-1] == plain
    assert all(by[f"PowerSGD r={r}"]["bytes"][0] == plain for r in (1, 2, 4))
    assert by["PowerSGD r=1"]["bytes"][-1] < plain / 3
    assert by["ZeRO + Adam"]["bytes"][-1] == 2 * plain
    assert (sum(r["ZeRO + Adam"]["state_bytes"] for r in runs)
            == by["DDP + Adam"]["state_bytes"])
    assert by["ZeRO + Adam"]["loss"] == by["DDP + Adam"]["loss"]
    saved = by["DDP"]["grad_bytes"] - by["gradient_as_bucket_view"]["grad_bytes"]
    assert saved == plain
    assert by["static_graph"]["loss"] == by["DDP"]["loss"]
    assert "local_step_s" not in by["DDP"]  # only when asked for


# The PowerSGD exercise: the reference and the typical wrong answers.

def powersgd_bytes(shapes, r):
    values = 0
    for shape in shapes:
        if len(shape) == 1:
            values += shape[0]
            continue
        n, m = shape[0], math.prod(shape[1:])
        values += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return 4 * values


def every_matrix_compressed(shapes, r):
    return 4 * sum(s[0] if len(s) == 1 else (s[0] + math.prod(s[1:])) * r
                   for s in shapes)


def biases_left_out(shapes, r):
    return powersgd_bytes([s for s in shapes if len(s) > 1], r)


def values_not_bytes(shapes, r):
    return powersgd_bytes(shapes, r) // 4


def convolution_split_wrongly(shapes, r):
    return powersgd_bytes([s if len(s) <= 2 else (s[0] * s[1], math.prod(s[2:]))
                           for s in shapes], r)


@pytest.mark.timeout(300)
def test_powersgd_bytes_check(ranks, capsys):
    exercises.grade_powersgd_bytes(ranks, powersgd_bytes)
    assert "✓" in capsys.readouterr().out
    with pytest.raises(exercises.WrongAnswer) as none:
        exercises.grade_powersgd_bytes(ranks, lambda shapes, r: None)
    assert none.value.key == "ex_psgd_none"
    for answer, key in [(every_matrix_compressed, "ex_psgd_hint_rate"),
                        (biases_left_out, "ex_psgd_hint_vector"),
                        (values_not_bytes, "ex_psgd_hint_bytes"),
                        (convolution_split_wrongly, "ex_psgd_hint_view")]:
        with pytest.raises(exercises.WrongAnswer) as wrong:
            exercises.grade_powersgd_bytes(ranks, answer)
        assert wrong.value.key == key, answer.__name__


# The bucket-count exercise: the lesson's answer and the typical wrong ones.

def ddp_buckets(param_bytes, cap_mb, *, order=reversed, mib=2**20, first_mib=True,
                reach=True):
    cap = (25 if cap_mb is None else cap_mb) * mib
    first = 2**20 if cap_mb is None and first_mib else cap
    buckets, size = 0, 0
    for nbytes in order(param_bytes):
        size += nbytes
        limit = first if buckets == 0 else cap
        if (size >= limit) if reach else (size > limit):
            buckets, size = buckets + 1, 0
    return buckets + (size > 0)


@pytest.mark.timeout(300)
def test_bucket_count_check(ranks, capsys):
    exercises.grade_bucket_count(ranks, ddp_buckets)
    assert "✓" in capsys.readouterr().out
    for wrong, key in [({"order": list}, "ex_buckets_hint_order"),
                       ({"first_mib": False}, "ex_buckets_hint_first"),
                       ({"mib": 10**6}, "ex_buckets_hint_mib"),
                       ({"reach": False}, "ex_buckets_hint_close")]:
        with pytest.raises(exercises.WrongAnswer) as err:
            exercises.grade_bucket_count(
                ranks, lambda b, c, wrong=wrong: ddp_buckets(b, c, **wrong))
        assert err.value.key == key, wrong
    with pytest.raises(exercises.WrongAnswer) as err:
        exercises.grade_bucket_count(ranks, lambda b, c: len(b))  # one per parameter
    assert err.value.key == "ex_buckets_hint_rule"


def _powersgd_callers() -> list[tuple[int, str]]:
    """Runs on every rank: each all-reduce of a compressed PowerSGD step, with its
    bytes and the function of powerSGD_hook.py that called it."""
    import sys

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(64, 64), bucket_cap_mb=send_less.ONE_BUCKET_MB)
    model.register_comm_hook(ps.PowerSGDState(None, start_powerSGD_iter=2),
                             ps.powerSGD_hook)
    calls, original = [], dist.all_reduce

    def logged(tensor, *args, **kwargs):
        calls.append((tensor.numel() * tensor.element_size(),
                      sys._getframe(1).f_code.co_name))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = logged
    try:
        for _ in range(4):
            calls.clear()
            model(torch.ones(2, 64)).sum().backward()
    finally:
        dist.all_reduce = original
    return calls


def test_powersgd_sends_p_and_q_from_callbacks(ranks):
    """Lesson 06's reason for one bucket: the hook itself sends only the
    uncompressed tensors; P and Q go from the callbacks it chains on each
    all-reduce's future (`.then`), which run when the one before completes."""
    import inspect

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    source = inspect.getsource(ps.powerSGD_hook)
    for callback in ("unpack_uncompressed_tensors_and_allreduce_ps", "compute_qs"):
        assert f".then({callback})" in source.replace("\n", "").replace(" ", "")
    for calls in ranks.run(_powersgd_callers):
        # the bias as it is (256 bytes), then P and Q (64 x 1 floats each)
        assert calls == [(256, "powerSGD_hook"),
                         (256, "unpack_uncompressed_tensors_and_allreduce_ps"),
                         (256, "compute_qs")], calls
