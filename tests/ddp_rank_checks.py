"""Rank-side checks for test_ddp_no_sync.py, run on every rank of a group.

A separate module so that pytest does not rewrite its asserts: the engines
import it by name and must run the same code as the test process sees.
"""

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import (
    checks,
    cli_experiments,
    comm_counting,
    compare,
    data,
    models,
    no_sync,
    workload,
)

TINY_BUCKET_MB = 0.002  # about 2 KB: doc 004's model (8 KB of gradients) gets several


def _global_batch(step, n=8, world_size=2):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n * world_size, 10, generator=g), torch.randn(n * world_size, 10,
                                                                    generator=g)


def _params_equal_across_ranks(model):
    flats = compare.gather_params(model)
    for other in flats[1:]:
        torch.testing.assert_close(other, flats[0], rtol=0, atol=0)


def _local_and_ddp():
    """The same weights twice: a local model and its DDP twin, with optimizers."""
    torch.manual_seed(0)
    local = models.MLP()
    model = DDP(copy.deepcopy(local), bucket_cap_mb=TINY_BUCKET_MB)
    return (local, model, torch.optim.SGD(local.parameters(), lr=0.1),
            torch.optim.SGD(model.parameters(), lr=0.1))


def _same_params(model, local):
    _params_equal_across_ranks(model)
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def accumulate_gradients_no_sync(num_iters=3, K=4):
    """Runs on every rank; raises on the first mismatch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local, model, opt_local, opt_ddp = _local_and_ddp()
    counter = comm_counting.CommCounter().attach(model)
    criterion = models.MyLoss()
    buckets = None
    for it in range(num_iters):
        batches = [_global_batch(it * K + i) for i in range(K)]
        opt_local.zero_grad()
        opt_ddp.zero_grad()
        counter.reset()
        for i, (X, y) in enumerate(batches):
            (criterion(local(X), y) / K).backward()
            Xr, yr = data.shard(X, rank, world_size), data.shard(y, rank, world_size)
            if i < K - 1:
                with model.no_sync():
                    (criterion(model(Xr), yr) / K).backward()
                # Inside no_sync each rank holds only its own slice's gradient.
                for p, q in zip(model.parameters(), local.parameters(), strict=True):
                    assert not torch.allclose(p.grad, q.grad)
            else:
                (criterion(model(Xr), yr) / K).backward()
                for p, q in zip(model.parameters(), local.parameters(), strict=True):
                    torch.testing.assert_close(p.grad, q.grad)
        if it > 1:  # DDP rebuilds its buckets after the first iteration
            assert counter.calls == buckets  # one all-reduce per bucket per K
        buckets = counter.calls
        opt_local.step()
        opt_ddp.step()
        _same_params(model, local)
    return buckets


def ddp_niter(num_iters=5):
    """DDP on slices == local model on the global batch, after every step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local, model, opt_local, opt_ddp = _local_and_ddp()
    criterion = models.MyLoss()
    for it in range(num_iters):
        X, y = _global_batch(100 + it)
        for opt, m, Xb, yb in ((opt_local, local, X, y),
                               (opt_ddp, model, data.shard(X, rank, world_size),
                                data.shard(y, rank, world_size))):
            opt.zero_grad()
            criterion(m(Xb), yb).backward()
            opt.step()
        _same_params(model, local)
    return True


def count_misuses(K=4):
    """All-reduce calls per K micro-batches for each way of (mis)using no_sync."""
    cfg = workload.Config(accum_steps=K, bucket_cap_mb=TINY_BUCKET_MB)
    dataset = workload.make_dataset(cfg)
    criterion = models.MyLoss()
    batches = workload.micro_batches(dataset, cfg, 0, dist.get_rank(),
                                     dist.get_world_size())

    def calls(run):
        calls, _, grads = no_sync.counted_update(cfg, criterion, batches, run)
        return calls, grads

    def bare(model):
        model.no_sync()
        no_sync.accumulate_no_sync(model, criterion, batches, use_no_sync=False)

    def forward_outside(model):
        for i, (X, y) in enumerate(batches):
            loss = criterion(model(X), y) / K
            with model.no_sync() if i < K - 1 else nullcontext():
                loss.backward()

    out = {
        "correct": calls(lambda m: no_sync.accumulate_no_sync(m, criterion, batches)),
        "sync": calls(lambda m: no_sync.accumulate_no_sync(m, criterion, batches,
                                                          use_no_sync=False)),
        "bare": calls(bare),
        "forward_outside": calls(forward_outside),
    }
    # The forward-outside mistake keeps the gradients right: only the count shows it.
    for p, q in zip(out["forward_outside"][1], out["correct"][1], strict=True):
        torch.testing.assert_close(p, q)
    return {k: v[0] for k, v in out.items()}


def nosync_experiment_small():
    cfg = workload.Config(accum_steps=4, steps=3, repeat=1,
                          bucket_cap_mb=TINY_BUCKET_MB)
    return cli_experiments.nosync_experiment(dist.get_rank(), dist.get_world_size(),
                                             cfg)


def misuse_experiment_small():
    cfg = workload.Config(accum_steps=4, steps=5)
    return cli_experiments.misuse_experiment(dist.get_rank(), dist.get_world_size(),
                                             cfg)


def my_rank(rank, world_size):
    return (rank, world_size, dist.get_backend())


def my_rank_once_seen(rank, world_size, seen_flag, timeout_s=60.0):
    """`my_rank`'s answer, once the file `seen_flag` exists: the group stays
    open until the test has looked at its sockets (or `timeout_s` passed)."""
    import os
    import time

    dist.barrier()
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(seen_flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return my_rank(rank, world_size)


def convergence_twice():
    """The DDP loss curve of lesson 04, run twice with the same seed."""
    cfg = workload.Config(accum_steps=2, steps=6, momentum=0.9)
    runs = [no_sync.convergence(dist.get_rank(), dist.get_world_size(), cfg, True)
            for _ in range(2)]
    return [r["losses"] for r in runs]


def all_reduce_forever():
    """Keep all-reducing until something breaks."""
    x = torch.ones(1000)
    while True:
        dist.all_reduce(x)


def hang_on_rank_1():
    """Rank 1 never reaches the all-reduce that rank 0 waits in."""
    import time

    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def accumulation_matches_large_batch(K, batch_per_rank, hidden, seed):
    """DDP + no_sync over K micro-batches == one process on the whole batch.

    Also counts the all-reduces: the K micro-batches must cost what one
    synchronized backward costs (without no_sync they cost K times as much).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = workload.Config(accum_steps=K, batch_per_rank=batch_per_rank,
                          hidden=hidden, seed=seed)
    dataset = workload.make_dataset(cfg)
    model, counter = workload.wrap(cfg)
    local = workload.make_model(cfg)
    (X, y), = workload.micro_batches(dataset, cfg, 0, rank, world_size, whole=True)
    models.MyLoss()(local(X), y).backward()
    batches = workload.micro_batches(dataset, cfg, 0, rank, world_size)
    no_sync.accumulate_no_sync(model, models.MyLoss(), batches)
    calls = counter.calls
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    counter.reset()
    models.MyLoss()(model(batches[0][0]), batches[0][1]).backward()  # one sync
    checks.allreduce_calls(calls, counter.calls)
    return calls


def one_over_k(K=4):
    """labkit's scaled path: the large batch's gradient; unscaled: K times it.

    Returns {scale: (grads_match message against the large batch, against K
    times it)}, None where the check passed.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = workload.Config(accum_steps=K)
    dataset = workload.make_dataset(cfg)
    model, _ = workload.wrap(cfg)
    local = workload.make_model(cfg)
    (X, y), = workload.micro_batches(dataset, cfg, 0, rank, world_size, whole=True)
    models.MyLoss()(local(X), y).backward()
    reference = [p.grad for p in local.parameters()]
    batches = workload.micro_batches(dataset, cfg, 0, rank, world_size)
    out = {}
    for scale in (True, False):
        model.zero_grad()
        no_sync.accumulate_no_sync(model, models.MyLoss(), batches, scale=scale)
        grads = [p.grad for p in model.parameters()]
        out[scale] = (_fails(checks.grads_match, grads, reference),
                      _fails(checks.grads_match, grads, [K * g for g in reference],
                             tol=K * checks.GRAD_TOL))
    return out


def _fails(check, *args, **kwargs):
    """The check's AssertionError message, or None when it passes."""
    try:
        check(*args, **kwargs)
    except AssertionError as e:
        return str(e)
    return None


def lesson_checks_on_variants(K=4):
    """Lessons 03-04's checks on the lessons' code and on a broken variant of it.

    Returns {claim: (message on the lesson's code, message on the broken
    variant)}, a message being the check's AssertionError text or None when
    it passed. The checks are labkit.checks, the ones the lessons call.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = workload.Config(accum_steps=K)
    dataset = workload.make_dataset(cfg)
    criterion = models.MyLoss()
    batches = workload.micro_batches(dataset, cfg, 0, rank, world_size)
    local = workload.make_model(cfg)
    (X, y), = workload.micro_batches(dataset, cfg, 0, rank, world_size, whole=True)
    criterion(local(X), y).backward()
    reference = [p.grad for p in local.parameters()]

    def counted(run):
        return no_sync.counted_update(cfg, criterion, batches, run)

    def correct(model):
        no_sync.accumulate_no_sync(model, criterion, batches)

    def no_sync_removed(model):
        no_sync.accumulate_no_sync(model, criterion, batches, use_no_sync=False)

    def not_divided(model):
        no_sync.accumulate_no_sync(model, criterion, batches, scale=False)

    def bare_call(model):  # lesson 04, misuse 1
        model.no_sync()
        no_sync_removed(model)

    def forward_outside(model):  # lesson 04, misuse 2
        for i, (Xi, yi) in enumerate(batches):
            loss = criterion(model(Xi), yi) / K
            with model.no_sync() if i < K - 1 else nullcontext():
                loss.backward()

    runs = {name: counted(run) for name, run in (
        ("correct", correct), ("no_sync_removed", no_sync_removed),
        ("not_divided", not_divided), ("bare_call", bare_call),
        ("forward_outside", forward_outside))}
    per_sync = runs["correct"][0]
    params = models.count_params(local)

    def calls_and_grads(name, want_calls):
        calls, _, grads = runs[name]
        return (_fails(checks.allreduce_calls, calls, want_calls)
                or _fails(checks.grads_match, grads, reference))

    out = {
        # 04: one update of K micro-batches, one synchronization.
        "allreduce_per_update": (_fails(checks.allreduce_calls, per_sync, 1),
                                 _fails(checks.allreduce_calls,
                                        runs["no_sync_removed"][0], 1)),
        # 04: the accumulated gradient is the large batch's.
        "grads_match_large_batch": (_fails(checks.grads_match, runs["correct"][2],
                                           reference),
                                    _fails(checks.grads_match, runs["not_divided"][2],
                                           reference)),
        # 04: what an update sends, synchronized vs no_sync; broken: no_sync removed.
        "one_sync_per_update": (
            _fails(checks.one_sync_per_update, K,
                   (runs["no_sync_removed"][0], per_sync),
                   (runs["no_sync_removed"][1], runs["correct"][1]), params),
            _fails(checks.one_sync_per_update, K,
                   (runs["no_sync_removed"][0], runs["no_sync_removed"][0]),
                   (runs["no_sync_removed"][1], runs["no_sync_removed"][1]),
                   params)),
        # 04, misuse 1: a bare call counts K all-reduces and keeps the gradient
        # right; broken: the call made to work (the with block it needs).
        "bare_call_count": (calls_and_grads("bare_call", K),
                            calls_and_grads("correct", K)),
        # 04, misuse 2: forward outside counts K, gradient right; broken: the
        # forward moved inside, where it belongs.
        "forward_outside_count": (calls_and_grads("forward_outside", K),
                                  calls_and_grads("correct", K)),
    }

    # 03 and 04: replicas stay equal; broken: optimizer.step inside no_sync.
    apart = {}
    for name in ("correct", "step_inside"):
        model, _ = workload.wrap(cfg)
        optimizer = workload.make_optimizer(model, cfg)
        for step in range(3):
            steps = workload.micro_batches(dataset, cfg, step, rank, world_size)
            if name == "correct":
                optimizer.zero_grad()
                no_sync.accumulate_no_sync(model, criterion, steps)
                optimizer.step()
            else:
                for Xi, yi in steps:
                    with model.no_sync():
                        optimizer.zero_grad()
                        criterion(model(Xi), yi).backward()
                        optimizer.step()
        apart[name] = _fails(checks.replicas_equal, model)
    out["replicas_equal"] = (apart["correct"], apart["step_inside"])

    # 03: DDP's gradient is the whole batch's, given equal shares; broken:
    # unequal shares (DDP still weighs the ranks alike).
    gaps = {}
    for name, n0 in (("equal", 32), ("unequal", 40)):  # rank 0's share of 64
        torch.manual_seed(0)
        model = DDP(models.MLP())
        whole = copy.deepcopy(model.module)  # as lesson 03: the same weights
        torch.manual_seed(1)
        Xg, yg = torch.randn(64, 10), torch.randn(64, 10)
        criterion(whole(Xg), yg).backward()
        part = slice(0, n0) if rank == 0 else slice(n0, 64)
        criterion(model(Xg[part]), yg[part]).backward()
        gaps[name] = _fails(checks.grads_match, [p.grad for p in model.parameters()],
                            [p.grad for p in whole.parameters()])
    out["ddp_grad_whole_batch"] = (gaps["equal"], gaps["unequal"])

    # 04: unequal micro-batches; the count-weighted loss fixes the mean of means.
    sizes = [[16, 16, 16, 4], [16, 16, 16, 16]]
    uneven, (Xw, yw) = workload.uneven_micro_batches(dataset, sizes, rank)
    local = workload.make_model(cfg)
    criterion(local(Xw), yw).backward()
    whole_grads = [p.grad for p in local.parameters()]
    fixed = {}
    for accumulate in (no_sync.accumulate_by_count, no_sync.accumulate_no_sync):
        model, _ = workload.wrap(cfg)
        accumulate(model, criterion, uneven)
        fixed[accumulate.__name__] = _fails(
            checks.grads_match, [p.grad for p in model.parameters()], whole_grads)
    out["uneven_weighted_by_count"] = (fixed["accumulate_by_count"],
                                       fixed["accumulate_no_sync"])
    return out


def bucket_logs(caps=(None, 25, 1), steps=3):
    """Bytes of each bucket per step of lesson 05's MLP, as a CommCounter saw them.

    A cap of None builds DDP(model) without bucket_cap_mb (DDP's own default).
    Also returns the model's gradient bytes.
    """
    out = {}
    cfg = workload.Config(hidden=1024, depth=3, accum_steps=1)
    X, y = workload.micro_batches(workload.make_dataset(cfg), cfg, 0, dist.get_rank(),
                                  dist.get_world_size())[0]
    for cap in caps:
        kwargs = {} if cap is None else {"bucket_cap_mb": cap}
        model = DDP(workload.make_model(cfg), **kwargs)
        log = comm_counting.CommCounter(per_step=True).attach(model)
        for _ in range(steps):
            log.step()
            models.MyLoss()(model(X), y).backward()
        out[cap] = log.steps
    return out, 4 * models.count_params(model.module)


def delay_until_last(timeline, bucket):
    """A broken comm hook: no all-reduce starts before the last bucket is ready.

    It holds every bucket and launches them all from the last one, i.e. after
    the last gradient (as a DDP without buckets would).
    """
    pending = timeline.__dict__.setdefault("_pending", [])
    fut = torch.futures.Future()
    pending.append((bucket.buffer(), fut))
    if bucket.is_last():
        for buffer, held in pending:
            timeline.allreduce(buffer).then(
                lambda f, held=held: held.set_result(f.value()))
        pending.clear()
    return fut


def allreduce_now(timeline, bucket):
    """Lesson 05's comm hook: each bucket's all-reduce as soon as DDP hands it over."""
    return timeline.allreduce(bucket.buffer())


def hook_grads_match_default(hook_name="allreduce_now"):
    """Gradients of one backward through a Timeline with `hook_name`, against
    the same weights and data in a DDP with its default hook: equal bits."""
    from labkit import buckets

    hook = globals()[hook_name]
    cfg = workload.Config(hidden=512, depth=8, bucket_cap_mb=1, accum_steps=1)
    X, y = workload.micro_batches(workload.make_dataset(cfg), cfg, 0, dist.get_rank(),
                                  dist.get_world_size())[0]
    grads = []
    for with_hook in (True, False):
        model = DDP(workload.make_model(cfg), bucket_cap_mb=cfg.bucket_cap_mb)
        if with_hook:
            timeline = buckets.Timeline(model, hook)
            timeline.backward(models.MyLoss()(model(X), y))
        else:
            models.MyLoss()(model(X), y).backward()
        grads.append(compare.grads(model))
    return compare.max_abs_diff(*grads)


def no_mean(timeline, bucket):
    """A broken hook: the sum of the ranks' gradients, not their mean."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda fut: fut.value()[0])


def timelines(delayed=False, steps=3):
    """Lesson 05's overlap record, with DDP's all-reduce or the delayed one."""
    from labkit import buckets

    cfg = workload.Config(hidden=512, depth=8, bucket_cap_mb=1, accum_steps=1)
    hook = delay_until_last if delayed else allreduce_now
    return buckets.bucket_timeline(dist.get_rank(), dist.get_world_size(), cfg, hook,
                                steps)


def interleaved_times_small(ks=(1, 2, 3), rounds=2):
    """Times of doc 004's model for several K, and the counted all-reduces."""
    cfg = workload.Config(accum_steps=max(ks))
    model, counter = workload.wrap(cfg)
    batches = workload.micro_batches(workload.make_dataset(cfg), cfg, 1,
                                     dist.get_rank(), dist.get_world_size())
    times = no_sync.interleaved_step_times(model, workload.make_optimizer(model, cfg),
                                          batches, ks, rounds, block_s=0.0)
    return times, counter.calls


def sent_shares(sizes=(16 * 2**20,)):
    """Bytes each rank sends per all-reduce over S, per size (Linux only)."""
    from labkit import comm

    return {size: comm.sent_per_allreduce(size) for size in sizes}


def sent_share_16mib(rank, world_size):
    """Under launch.run: bytes this rank sends per 16 MiB all-reduce, over S."""
    from labkit import comm

    return comm.sent_per_allreduce(16 * 2**20)
