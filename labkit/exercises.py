"""Checks of the lessons' exercises: right, or what is wrong and a hint.

A check prints its verdict in the lesson's language when the answer is right,
and raises WrongAnswer (an AssertionError) naming the problem and a hint when
it is not. Checks that take `ranks` run the learner's function on every rank;
the functions named `_..._trial` are what the ranks run. The checks of
lessons 06 and 07 live in labkit.exercises_scale; lessons call them from here.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import comm, ddp, models, nosync
from . import data as datasets
from . import data_parallel as dp
from .exercises_scale import (
    check_global_statistics,
    check_shard_sizes,
    check_torchrun_env,
    check_warmup_schedule,
)
from .feedback import WrongAnswer
from .feedback import off as _off
from .feedback import right as _right

if TYPE_CHECKING:
    from .cluster import Ranks

__all__ = [
    "WrongAnswer",
    "check_accumulation",
    "check_allreduce_prediction",
    "check_average_gradients",
    "check_chunk_sizes",
    "check_global_statistics",
    "check_keeps_batch",
    "check_manual_data_parallel",
    "check_replicas_agree",
    "check_set_epoch",
    "check_shard_sizes",
    "check_step_prediction",
    "check_torchrun_env",
    "check_train_step",
    "check_warmup_schedule",
]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([x.detach().reshape(-1) for x in tensors])


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return _flat(torch.zeros_like(p) if p.grad is None else p.grad
                 for p in model.parameters())


def _gap(a, b) -> float:
    """Largest difference between two models' parameters."""
    return (_flat(a.parameters()) - _flat(b.parameters())).abs().max().item()


def _apart(x: torch.Tensor) -> float:
    """Largest difference between this rank's `x` and rank 0's (collective)."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return max((o - out[0]).abs().max().item() for o in out)


def check_keeps_batch(model_cls: type) -> None:
    """Doc 004's model with `view(-1)` fixed: the output keeps every sample."""
    torch.manual_seed(0)
    model, reference = model_cls(), models.MLP()
    reference.load_state_dict(model.state_dict())
    shapes = [(100, 10), (1, 10), (4, 2, 5)]
    for shape in shapes:
        X = torch.randn(shape)
        want = reference(X)
        try:
            got = model(X)
        except (RuntimeError, ValueError) as e:
            raise WrongAnswer("ex_batch_error", shape=shape,
                              err=str(e).splitlines()[0]) from None
        if got.shape != want.shape:
            raise WrongAnswer("ex_batch", shape=shape, got=tuple(got.shape),
                              want=tuple(want.shape))
        if (diff := (got - want).abs().max().item()) > 1e-6:
            raise _off("model(X)", diff, "ex_batch_fix")
    _right("ex_batch_ok", shapes=", ".join(map(str, shapes)))


def check_train_step(train_step: Callable) -> None:
    """`train_step(model, optimizer, criterion, X, y)`: one correct SGD update."""
    torch.manual_seed(0)
    model = models.MLP()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    criterion, g = models.MyLoss(), torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        X, y = torch.randn(32, 10, generator=g), torch.randn(32, 10, generator=g)
        before = _flat(model.parameters())
        train_step(model, optimizer, criterion, X, y)
        ref_opt.zero_grad()
        criterion(reference(X), y).backward()
        ref_opt.step()
        if all(p.grad is None for p in model.parameters()):
            raise WrongAnswer("ex_no_backward")
        if torch.equal(before, _flat(model.parameters())):
            raise WrongAnswer("ex_no_step")
        if (diff := _gap(model, reference)) > 1e-6:
            if step > 1:
                raise WrongAnswer("ex_no_zero_grad", step=step)
            raise _off("model.parameters()", diff, "ex_order_step")
    _right("ex_train_ok", steps=3)


def check_chunk_sizes(predicted: dict[tuple[int, int], list[int] | None]) -> None:
    """`predicted[batch, n]`: the sizes of the chunks `scatter` makes on n devices."""
    for (batch, n), sizes in predicted.items():
        if sizes is None:
            raise WrongAnswer("ex_fill_in", name=f"predicted[{batch}, {n}]")
        chunks = dp.scatter(torch.zeros(batch, 1), list(range(n)))
        if list(sizes) != [len(c) for c in chunks]:
            raise WrongAnswer("ex_chunks", batch=batch, n=n, pred=list(sizes))
    _right("ex_chunks_ok", sizes=predicted)


def check_manual_data_parallel(fn: Callable) -> None:
    """`fn(module, X, device_ids)`: data_parallel written as its four steps."""
    torch.manual_seed(0)
    module = models.MLP()
    reference, criterion = copy.deepcopy(module), models.MyLoss()
    ran: list = []  # replicas share the original's hooks: this sees them all
    hook = module.register_forward_hook(lambda m, args, out: ran.append(m))
    cases = [(100, [0, 1]), (10, [0, 1, 2])]
    try:
        for batch, ids in cases:
            X, y = torch.randn(batch, 10), torch.randn(batch, 10)
            module.zero_grad()
            reference.zero_grad()
            ran.clear()
            out = fn(module, X, ids)
            if not isinstance(out, torch.Tensor):
                raise WrongAnswer("ex_dp_type", got=type(out).__name__)
            if out.shape != (batch, 10):
                raise WrongAnswer("ex_dp_shape", got=tuple(out.shape), want=(batch, 10))
            original = sum(m is module for m in ran)
            if original or len(ran) != len(ids):
                raise WrongAnswer("ex_dp_replicas", n=len(ids), original=original,
                                  replicas=len(ran) - original)
            want = reference(X)
            if (diff := (out - want).abs().max().item()) > 1e-6:
                raise _off("fn(module, X, device_ids)", diff, "ex_dp_hint")
            criterion(out, y).backward()
            criterion(want, y).backward()
            if (diff := (_grads(module) - _grads(reference)).abs().max().item()) > 1e-6:
                raise _off("module.parameters() .grad", diff, "ex_dp_hint")
    finally:
        hook.remove()
    _right("ex_dp_ok", cases=", ".join(f"{b} / {len(ids)}" for b, ids in cases))


def _epoch_trial(fn: Callable, n: int, num_epochs: int) -> list[list[int]]:
    """Runs on every rank: the learner's index lists, one per epoch."""
    orders = fn(datasets.MyDataset(n=n), dist.get_rank(), dist.get_world_size(),
                num_epochs)
    return [[int(i) for i in order] for order in orders]


def check_set_epoch(ranks: Ranks, fn: Callable, n: int = 16,
                    num_epochs: int = 3) -> None:
    """`fn(dataset, rank, world_size, num_epochs)`: a rank's indices in each epoch."""
    per_rank = ranks.run(_epoch_trial, fn, n, num_epochs)
    for epoch in range(num_epochs):
        seen = [i for orders in per_rank for i in orders[epoch]]
        if len(seen) != n or set(seen) != set(range(n)):
            raise WrongAnswer("ex_epochs", epoch=epoch)
    for b in range(1, num_epochs):
        for a in range(b):
            if all(orders[a] == orders[b] for orders in per_rank):
                raise WrongAnswer("ex_repeats", a=a, b=b)
    _right("ex_epochs_ok", n=n)


def _average_trial(fn: Callable) -> dict:
    """Runs on every rank: its share's gradient averaged by `fn`, vs the whole batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = models.MLP()
    local, criterion = copy.deepcopy(model), models.MyLoss()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 10, generator=g), torch.randn(64, 10, generator=g)
    criterion(model(ddp.shard(X, rank, world_size)),
              ddp.shard(y, rank, world_size)).backward()
    fn(model, world_size)
    criterion(local(X), y).backward()
    grad, want = _grads(model), _grads(local)
    return {"apart": _apart(grad), "diff": (grad - want).abs().max().item(),
            "ratio": (grad @ want / (want @ want)).item()}


def check_average_gradients(ranks: Ranks, fn: Callable) -> None:
    """`fn(model, world_size)`: every `.grad` becomes the mean over the ranks."""
    r = ranks.run(_average_trial, fn)[0]
    if r["apart"] > 0:
        raise WrongAnswer("ex_grads_apart", diff=r["apart"])
    if r["diff"] > 1e-6:
        if abs(r["ratio"] - ranks.world_size) < 1e-3:
            raise WrongAnswer("ex_grads_summed", ratio=r["ratio"])
        raise _off("p.grad", r["diff"], "ex_mean_hint")
    _right("ex_grads_ok")


def _accumulation_trial(fn: Callable, updates: int, accum_steps: int) -> list[dict]:
    """Runs on every rank: each update by `fn` vs one step on the K-times batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = nosync.NoSyncConfig(accum_steps=accum_steps, batch_per_rank=8)
    dataset, criterion = nosync.make_dataset(cfg), models.MyLoss()
    model, counter = nosync.wrap(cfg)
    reference = nosync.make_model(cfg)
    optimizer = nosync.make_optimizer(model, cfg)
    ref_opt = nosync.make_optimizer(reference, cfg)
    steps, step = [0], optimizer.step

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    optimizer.step = counted_step
    out = []
    for u in range(updates):
        (X, y), = nosync.micro_batches(dataset, cfg, u, rank, world_size, whole=True)
        before, ref_before = _flat(model.parameters()), _flat(reference.parameters())
        counter.reset()
        steps[0] = 0
        fn(model, optimizer, criterion,
           nosync.micro_batches(dataset, cfg, u, rank, world_size))
        ref_opt.zero_grad()
        criterion(reference(X), y).backward()
        ref_opt.step()
        moved = (_flat(model.parameters()) - before).norm()
        ref_moved = (_flat(reference.parameters()) - ref_before).norm()
        out.append({"calls": counter.calls, "steps": steps[0],
                    "apart": _apart(_flat(model.parameters())),
                    "diff": _gap(model.module, reference),
                    "ratio": (moved / ref_moved).item()})
    return out


def check_accumulation(ranks: Ranks, fn: Callable, updates: int = 3,
                       accum_steps: int = 4) -> None:
    """`fn(model, optimizer, criterion, batches)`: one update of K micro-batches."""
    results = ranks.run(_accumulation_trial, fn, updates, accum_steps)[0]
    for u, r in enumerate(results, start=1):
        if r["steps"] != 1:
            raise WrongAnswer("ex_steps", steps=r["steps"])
        if r["calls"] == 0:
            raise WrongAnswer("ex_no_sync_at_all")
        if r["calls"] > 1:
            raise WrongAnswer("ex_sync_every", calls=r["calls"])
        if r["apart"] > 0:
            raise WrongAnswer("ex_apart", step=u, diff=r["apart"])
        if r["diff"] > 1e-5:
            if u == 1 and abs(r["ratio"] - accum_steps) < 0.01 * accum_steps:
                raise WrongAnswer("ex_not_divided", ratio=r["ratio"])
            if u > 1:
                raise WrongAnswer("ex_no_zero_grad", step=u)
            raise _off("model.parameters()", r["diff"], "ex_order_accum")
    _right("ex_accum_ok", updates=updates)


def _schedule_trial(fn: Callable, updates: int) -> dict:
    """Runs on every rank: `fn` trains with a halving learning rate; one process too."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = nosync.NoSyncConfig(accum_steps=2, batch_per_rank=8, lr=0.1)
    dataset, criterion = nosync.make_dataset(cfg), models.MyLoss()
    model, _ = nosync.wrap(cfg)
    reference = nosync.make_model(cfg)
    optimizers = [nosync.make_optimizer(m, cfg) for m in (model, reference)]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in optimizers]
    batches = [nosync.micro_batches(dataset, cfg, u, rank, world_size)
               for u in range(updates)]
    fn(model, optimizers[0], schedulers[0], criterion, batches, rank)
    for u in range(updates):
        (X, y), = nosync.micro_batches(dataset, cfg, u, rank, world_size, whole=True)
        optimizers[1].zero_grad()
        criterion(reference(X), y).backward()
        optimizers[1].step()
        schedulers[1].step()
    return {"lr": optimizers[0].param_groups[0]["lr"],
            "apart": _apart(_flat(model.parameters())),
            "diff": _gap(model.module, reference)}


def check_replicas_agree(ranks: Ranks, fn: Callable, updates: int = 6) -> None:
    """`fn(model, optimizer, scheduler, criterion, updates, rank)`: equal replicas."""
    results = ranks.run(_schedule_trial, fn, updates)
    lrs = [r["lr"] for r in results]
    if len(set(lrs)) > 1:
        raise WrongAnswer("ex_lr_apart", lrs=", ".join(
            f"rank {rank}: {lr:g}" for rank, lr in enumerate(lrs)))
    if (r := results[0])["apart"] > 0:
        raise WrongAnswer("ex_train_apart", diff=r["apart"])
    if r["diff"] > 1e-5:
        raise _off("model.parameters()", r["diff"], "ex_only_line")
    _right("ex_diverge_ok", lr=lrs[0])


def _judge(name: str, got: float | None, right: float, wrong: list[tuple[str, float]],
           hint: str) -> None:
    """Raise WrongAnswer unless `got` is `right`, naming the mistake it matches."""
    if got is None:
        raise WrongAnswer("ex_fill_in", name=name)
    close = [key for key, value in [("", right), ("ex_units", right * 1e3), *wrong]
             if math.isclose(float(got), value, rel_tol=1e-3)]
    if close and close[0]:
        raise WrongAnswer(close[0], name=name)
    if not close:
        raise WrongAnswer("ex_value_off", hint, name=name, got=float(got))


def check_step_prediction(model: comm.StepModel, K: int, sync_s: float | None,
                          no_sync_s: float | None) -> None:
    """Seconds per update of K micro-batches: all synchronized, and with no_sync."""
    c, s, o = model.compute_s, model.sync_s, model.optimizer_s
    _judge("sync_s", sync_s, K * c + K * s + o,
           [("ex_sync_k", K * c + s + o), ("ex_forgot_o", K * c + K * s),
            ("ex_forgot_k", c + K * s + o)], "ex_step_hint")
    _judge("no_sync_s", no_sync_s, K * c + s + o,
           [("ex_nosync_once", K * c + K * s + o), ("ex_forgot_o", K * c + s),
            ("ex_forgot_k", c + s + o)], "ex_step_hint")
    _right("ex_step_ok", K=K, sync=sync_s * 1e3, nosync=no_sync_s * 1e3)


def check_allreduce_prediction(ab: comm.AlphaBeta, params: int, world_size: int,
                               allreduce_s: float | None) -> None:
    """Seconds of one ring all-reduce of `params` float32 values, by the model."""
    nbytes, factor = 4 * params, comm.ring_factor(world_size)
    latency = comm.ring_steps(world_size) * ab.alpha
    _judge("allreduce_s", allreduce_s, ab.time(nbytes, world_size),
           [("ex_bytes", latency + factor * params / ab.beta),
            ("ex_ring", latency + nbytes / ab.beta),
            ("ex_ring", latency + 2 * nbytes / ab.beta),
            ("ex_alpha_steps", ab.alpha + factor * nbytes / ab.beta)], "ex_ab_hint")
    _right("ex_ab_ok", n=world_size, ms=ab.time(nbytes, world_size) * 1e3,
           ms2=ab.time(nbytes, 2) * 1e3)
