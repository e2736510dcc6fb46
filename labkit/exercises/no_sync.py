"""Lesson 04 (no_sync): accumulation with no_sync, and replicas that agree.

Messages below; how a grader answers: labkit.exercises.feedback. `_..._trial`
functions run on the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import compare, models, workload
from .feedback import WrongAnswer, off, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ['grade_accumulation', 'grade_replicas_agree']

register({  # key: (ja, en)
    "ex_steps": (
        "1 回の更新で `optimizer.step()` が {steps} 回呼ばれました。ヒント: `step()` "
        "は、最後のマイクロバッチで同期したあとに 1 回だけ呼びます。`no_sync` の中で "
        "`step()` すると、レプリカがずれます。",
        "`optimizer.step()` ran {steps} times in one update. Hint: call `step()` "
        "once, after the last micro-batch has synchronized; a `step()` inside "
        "`no_sync` splits the replicas."),
    "ex_no_sync_at_all": ("all-reduce が 1 回もありません。ヒント: "
                          "最後のマイクロバッチは `no_sync` "
                          "の外で順伝播と逆伝播をします。",
                          "No all-reduce ran. Hint: the last micro-batch runs "
                          "forward and backward outside `no_sync`."),
    "ex_sync_every": ("1 回の更新で all-reduce が {calls} 回起きました (1 "
                      "回のはずです)。ヒント: 最初の K−1 個のマイクロバッチは、"
                      "順伝播も逆伝播も `with model.no_sync():` の中で行います。",
                      "An update ran {calls} all-reduces, not 1. Hint: the first K−1 "
                      "micro-batches run both forward and backward inside `with "
                      "model.no_sync():`."),
    "ex_apart": ("{step} 回目の更新で、ランクのパラメータが {diff:.1e} ずれました。"
                 "ヒント: `step()` の前に全ランクの勾配がそろっている必要があります。"
                 "同期させるのは最後のマイクロバッチです。",
                 "Update {step} left the ranks' parameters {diff:.1e} apart. Hint: "
                 "every rank needs the same gradient before `step()`; the last "
                 "micro-batch is the one to synchronize."),
    "ex_not_divided": ("更新の大きさが、K 倍のバッチでの更新の {ratio:.1f} 倍です。"
                       "ヒント: 各マイクロバッチの損失を K で割ります。",
                       "The update is {ratio:.1f} times the K-times batch's. Hint: "
                       "divide each micro-batch's loss by K."),
    "ex_order_accum": ("zero_grad()、K−1 個を no_sync の中、最後の 1 個を外、step()。",
                       "zero_grad(), K−1 inside no_sync, the last outside, step()."),
    "ex_accum_ok": ("{updates} 回の更新のどれでも、all-reduce は 1 回、"
                    "レプリカは一致し、K 倍のバッチで 1 回更新したのと同じ結果です。",
                    "In all {updates} updates: one all-reduce, identical replicas, "
                    "and the same result as one update on the K-times batch."),
    "ex_lr_apart": ("ランクの学習率が違います ({lrs})。ヒント: `scheduler.step()` "
                    "も全ランクで呼びます。`if rank == 0:` の中に置くのは、"
                    "記録や保存のようにパラメータを変えない処理だけです。",
                    "The ranks' learning rates differ ({lrs}). Hint: every rank "
                    "calls `scheduler.step()`; only work that changes no parameter, "
                    "such as logging and saving, goes under `if rank == 0:`."),
    "ex_train_apart": (
        "ランクのパラメータが {diff:.1e} 違います。ヒント: 全ランクが、"
        "同じ勾配と同じ学習率で、同じ回数だけ `step()` します。",
        "The ranks' parameters differ by {diff:.1e}. Hint: every rank calls `step()` "
        "as often, with the same gradient and learning rate."),
    "ex_only_line": ("直すのは、レプリカをずらしていた行だけです。",
                     "change only the line that split the replicas."),
    "ex_diverge_ok": ("レプリカは一致し、学習率はどのランクも {lr:g} です。",
                      "The replicas agree; every rank ends at learning rate {lr:g}."),
})


def _accumulation_trial(fn: Callable, updates: int, accum_steps: int) -> list[dict]:
    """Runs on every rank: each update by `fn` vs one step on the K-times batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = workload.Config(accum_steps=accum_steps, batch_per_rank=8)
    dataset, criterion = workload.make_dataset(cfg), models.MyLoss()
    model, counter = workload.wrap(cfg)
    reference = workload.make_model(cfg)
    optimizer = workload.make_optimizer(model, cfg)
    ref_opt = workload.make_optimizer(reference, cfg)
    steps, step = [0], optimizer.step

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    optimizer.step = counted_step
    out = []
    for u in range(updates):
        (X, y), = workload.micro_batches(dataset, cfg, u, rank, world_size, whole=True)
        before = compare.flat(model.parameters())
        ref_before = compare.flat(reference.parameters())
        counter.reset()
        steps[0] = 0
        fn(model, optimizer, criterion,
           workload.micro_batches(dataset, cfg, u, rank, world_size))
        ref_opt.zero_grad()
        criterion(reference(X), y).backward()
        ref_opt.step()
        moved = (compare.flat(model.parameters()) - before).norm()
        ref_moved = (compare.flat(reference.parameters()) - ref_before).norm()
        out.append({"calls": counter.calls, "steps": steps[0],
                    "apart": compare.replica_max_diff(model),
                    "diff": compare.max_abs_diff(model.module.parameters(),
                                                 reference.parameters()),
                    "ratio": (moved / ref_moved).item()})
    return out


def grade_accumulation(ranks: Ranks, fn: Callable, updates: int = 3,
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
            raise off("model.parameters()", r["diff"], "ex_order_accum")
    right("ex_accum_ok", updates=updates)


def _schedule_trial(fn: Callable, updates: int) -> dict:
    """Runs on every rank: `fn` trains with a halving learning rate; one process too."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = workload.Config(accum_steps=2, batch_per_rank=8, lr=0.1)
    dataset, criterion = workload.make_dataset(cfg), models.MyLoss()
    model, _ = workload.wrap(cfg)
    reference = workload.make_model(cfg)
    optimizers = [workload.make_optimizer(m, cfg) for m in (model, reference)]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in optimizers]
    batches = [workload.micro_batches(dataset, cfg, u, rank, world_size)
               for u in range(updates)]
    fn(model, optimizers[0], schedulers[0], criterion, batches, rank)
    for u in range(updates):
        (X, y), = workload.micro_batches(dataset, cfg, u, rank, world_size, whole=True)
        optimizers[1].zero_grad()
        criterion(reference(X), y).backward()
        optimizers[1].step()
        schedulers[1].step()
    return {"lr": optimizers[0].param_groups[0]["lr"],
            "apart": compare.replica_max_diff(model),
            "diff": compare.max_abs_diff(model.module.parameters(),
                                         reference.parameters())}


def grade_replicas_agree(ranks: Ranks, fn: Callable, updates: int = 6) -> None:
    """`fn(model, optimizer, scheduler, criterion, updates, rank)`: equal replicas."""
    results = ranks.run(_schedule_trial, fn, updates)
    lrs = [r["lr"] for r in results]
    if len(set(lrs)) > 1:
        raise WrongAnswer("ex_lr_apart", lrs=", ".join(
            f"rank {rank}: {lr:g}" for rank, lr in enumerate(lrs)))
    if (r := results[0])["apart"] > 0:
        raise WrongAnswer("ex_train_apart", diff=r["apart"])
    if r["diff"] > 1e-5:
        raise off("model.parameters()", r["diff"], "ex_only_line")
    right("ex_diverge_ok", lr=lrs[0])
