"""Rank-side checks for test_ddp_no_sync.py, run on every rank of a group.

A separate module so that pytest does not rewrite its asserts: the engines
import it by name and must run the same code as the test process sees.
"""

import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit import ddp, models, nosync

TINY_BUCKET_MB = 0.002  # about 2 KB: doc 004's model (8 KB of gradients) gets several


def _global_batch(step, n=8, world_size=2):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n * world_size, 10, generator=g), torch.randn(n * world_size, 10,
                                                                    generator=g)


def _params_equal_across_ranks(model):
    flats = ddp.gather_params(model)
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
    counter = ddp.CommCounter().attach(model)
    criterion = models.MyLoss()
    buckets = None
    for it in range(num_iters):
        batches = [_global_batch(it * K + i) for i in range(K)]
        opt_local.zero_grad()
        opt_ddp.zero_grad()
        counter.reset()
        for i, (X, y) in enumerate(batches):
            (criterion(local(X), y) / K).backward()
            Xr, yr = ddp.shard(X, rank, world_size), ddp.shard(y, rank, world_size)
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
                               (opt_ddp, model, ddp.shard(X, rank, world_size),
                                ddp.shard(y, rank, world_size))):
            opt.zero_grad()
            criterion(m(Xb), yb).backward()
            opt.step()
        _same_params(model, local)
    return True


def count_misuses(K=4):
    """All-reduce calls per K micro-batches for each way of (mis)using no_sync."""
    cfg = nosync.NoSyncConfig(accum_steps=K, bucket_cap_mb=TINY_BUCKET_MB)
    dataset = nosync.make_dataset(cfg)
    criterion = models.MyLoss()
    batches = nosync.micro_batches(dataset, cfg, 0, dist.get_rank(),
                                   dist.get_world_size())

    def calls(run):
        model, counter = nosync.wrap(cfg)
        nosync.accumulate_no_sync(model, criterion, batches)  # bucket rebuild
        model.zero_grad()
        counter.reset()
        run(model)
        return counter.calls, [p.grad.clone() for p in model.parameters()]

    def bare(model):
        model.no_sync()
        nosync.accumulate_no_sync(model, criterion, batches, use_no_sync=False)

    def forward_outside(model):
        for i, (X, y) in enumerate(batches):
            loss = criterion(model(X), y) / K
            with model.no_sync() if i < K - 1 else nullcontext():
                loss.backward()

    out = {
        "correct": calls(lambda m: nosync.accumulate_no_sync(m, criterion, batches)),
        "sync": calls(lambda m: nosync.accumulate_no_sync(m, criterion, batches,
                                                          use_no_sync=False)),
        "bare": calls(bare),
        "forward_outside": calls(forward_outside),
    }
    # The forward-outside mistake keeps the gradients right: only the count shows it.
    for p, q in zip(out["forward_outside"][1], out["correct"][1], strict=True):
        torch.testing.assert_close(p, q)
    return {k: v[0] for k, v in out.items()}


def nosync_experiment_small():
    cfg = nosync.NoSyncConfig(accum_steps=4, steps=3, repeat=1,
                              bucket_cap_mb=TINY_BUCKET_MB)
    return nosync.nosync_experiment(dist.get_rank(), dist.get_world_size(), cfg)


def misuse_experiment_small():
    cfg = nosync.NoSyncConfig(accum_steps=4, steps=5)
    return nosync.misuse_experiment(dist.get_rank(), dist.get_world_size(), cfg)


def raise_on_rank_1(rank, world_size):
    """Fails on rank 1 only, the way a learner's bug would."""
    if rank == 1:
        raise ValueError("rank 1 got a batch of the wrong shape")
    return rank


def my_rank(rank, world_size):
    return (rank, world_size, dist.get_backend())


def pause(rank, world_size, seconds=3.0):
    """Hold the group open for a while, so the test can look at its sockets."""
    import time

    dist.barrier()
    time.sleep(seconds)
    return rank


def convergence_twice():
    """The DDP loss curve of lesson 04, run twice with the same seed."""
    cfg = nosync.NoSyncConfig(accum_steps=2, steps=6, momentum=0.9)
    runs = [nosync.convergence(dist.get_rank(), dist.get_world_size(), cfg, True)
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
    """DDP + no_sync over K micro-batches == one process on the whole batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = nosync.NoSyncConfig(accum_steps=K, batch_per_rank=batch_per_rank,
                              hidden=hidden, seed=seed)
    dataset = nosync.make_dataset(cfg)
    model, counter = nosync.wrap(cfg)
    local = nosync.make_model(cfg)
    (X, y), = nosync.micro_batches(dataset, cfg, 0, rank, world_size, whole=True)
    models.MyLoss()(local(X), y).backward()
    nosync.accumulate_no_sync(model, models.MyLoss(),
                              nosync.micro_batches(dataset, cfg, 0, rank, world_size))
    for p, q in zip(model.parameters(), local.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    return counter.calls


def bucket_logs(caps=(None, 25, 1), steps=3):
    """Bytes of each bucket per step of lesson 05's MLP, as a BucketLog saw them.

    A cap of None builds DDP(model) without bucket_cap_mb (DDP's own default).
    Also returns the model's gradient bytes.
    """
    from labkit import comm

    out = {}
    cfg = nosync.NoSyncConfig(hidden=1024, depth=3, accum_steps=1)
    X, y = nosync.micro_batches(nosync.make_dataset(cfg), cfg, 0, dist.get_rank(),
                                dist.get_world_size())[0]
    for cap in caps:
        kwargs = {} if cap is None else {"bucket_cap_mb": cap}
        model = DDP(nosync.make_model(cfg), **kwargs)
        log = comm.BucketLog().attach(model)
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


def timelines(delayed=False, steps=3):
    """Lesson 05's overlap record, with DDP's all-reduce or the delayed one."""
    from labkit import comm

    cfg = nosync.NoSyncConfig(hidden=512, depth=8, bucket_cap_mb=1, accum_steps=1)
    return comm.bucket_timeline(dist.get_rank(), dist.get_world_size(), cfg, steps,
                                comm_hook=delay_until_last if delayed else None)


def interleaved_times_small(ks=(1, 2, 3), rounds=2):
    """Times of doc 004's model for several K, and the counted all-reduces."""
    cfg = nosync.NoSyncConfig(accum_steps=max(ks))
    model, counter = nosync.wrap(cfg)
    batches = nosync.micro_batches(nosync.make_dataset(cfg), cfg, 1, dist.get_rank(),
                                   dist.get_world_size())
    times = nosync.interleaved_step_times(model, nosync.make_optimizer(model, cfg),
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
