"""Lesson 04 (no_sync): accumulation with no_sync, and replicas that agree.

Messages below; how a grader answers: labkit.exercises.feedback. `_..._trial`
functions run on the ranks.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
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
    "ex_steps_rank": (
        "ランク {rank} では、1 回の更新で `optimizer.step()` が {steps} 回呼ばれました "
        "(ランク 0 では {steps0} 回)。ヒント: どのランクも `step()` を 1 回呼びます。",
        "On rank {rank} `optimizer.step()` ran {steps} times in one update (on rank "
        "0: {steps0}). Hint: every rank calls `step()` once."),
    "ex_zero_grad_inside": (
        "更新に使われたのは、最後のマイクロバッチの勾配だけです。ヒント: ループの中の "
        "`zero_grad()` が、それまでに足し込んだ勾配を消しています。`zero_grad()` "
        "は最初のマイクロバッチの前に 1 回だけ呼びます。",
        "Only the last micro-batch's gradient made the update. Hint: `zero_grad()` "
        "inside the loop drops what the micro-batches before it accumulated; call it "
        "once, before the first micro-batch."),
    "ex_accum_k": (
        "K = {first} の更新は正しいのですが、K = {K} の更新が違います。ヒント: K "
        "を数で書かず `len(batches)` から求めます。同期するのは、K がいくつでも"
        "最後のマイクロバッチです。",
        "The updates with K = {first} are right, the one with K = {K} is not. "
        "Hint: take K from `len(batches)`, not a number; the micro-batch to "
        "synchronize is the last one, whatever K is."),
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
    "ex_scheduler_first": (
        "ランクはそろいましたが、`scheduler.step()` が `optimizer.step()` "
        "の前にあります。ヒント: 学習率を変えるのは、その更新のあとです。",
        "The ranks agree, but `scheduler.step()` comes before `optimizer.step()`. "
        "Hint: the learning rate changes after the update it was used for."),
    "ex_only_line": ("直すのは、レプリカをずらしていた行だけです。",
                     "change only the line that split the replicas."),
    "ex_diverge_ok": ("レプリカは一致し、学習率はどのランクも {lr:g} です。",
                      "The replicas agree; every rank ends at learning rate {lr:g}."),
})


def _accumulation_trial(fn: Callable, ks: Sequence[int]) -> list[dict]:
    """Runs on every rank: each update by `fn` vs one step on the K-times batch.

    One update per entry of `ks`, its K: a K written as a number shows.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = workload.Config(accum_steps=ks[0], batch_per_rank=8)
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
    for u, K in enumerate(ks):
        cfg.accum_steps = K
        (X, y), = workload.micro_batches(dataset, cfg, u, rank, world_size, whole=True)
        before = compare.flat(model.parameters())
        ref_before = compare.flat(reference.parameters())
        # zero_grad() inside the loop: only the last micro-batch's share remains.
        last = copy.deepcopy(reference)
        last_opt = workload.make_optimizer(last, cfg)
        counter.reset()
        steps[0] = 0
        fn(model, optimizer, criterion,
           workload.micro_batches(dataset, cfg, u, rank, world_size))
        ref_opt.zero_grad()
        criterion(reference(X), y).backward()
        ref_opt.step()
        tail = slice(len(X) - len(X) // K, len(X))  # every rank's last micro-batch
        (criterion(last(X[tail]), y[tail]) / K).backward()
        last_opt.step()
        moved = compare.flat(model.parameters()) - before
        ref_moved = compare.flat(reference.parameters()) - ref_before
        out.append({"K": K, "calls": counter.calls, "steps": steps[0],
                    "apart": compare.replica_max_diff(model),
                    "diff": compare.max_abs_diff(model.module.parameters(),
                                                 reference.parameters()),
                    "last_only": compare.max_abs_diff(model.module.parameters(),
                                                      last.parameters()),
                    "ratio": (moved.norm() / ref_moved.norm()).item(),
                    "cos": torch.nn.functional.cosine_similarity(
                        moved, ref_moved, dim=0).item()})
        reference.load_state_dict(model.module.state_dict())  # each update on its own
    return out


def _accumulation_verdict(results: list[list[dict]]) -> None:
    """Raise WrongAnswer at the first update some rank got wrong."""
    first_k = results[0][0]["K"]
    for u, per_rank in enumerate(zip(*results, strict=True), start=1):
        r = per_rank[0]
        try:
            if r["steps"] != 1:
                raise WrongAnswer("ex_steps", steps=r["steps"])
            for rank, x in enumerate(per_rank):  # right on rank 0 only
                if x["steps"] != 1:
                    raise WrongAnswer("ex_steps_rank", rank=rank, steps=x["steps"],
                                      steps0=r["steps"])
            if r["calls"] == 0:
                raise WrongAnswer("ex_no_sync_at_all")
            if r["calls"] > 1:
                raise WrongAnswer("ex_sync_every", calls=r["calls"])
            if r["apart"] > 0:
                raise WrongAnswer("ex_apart", step=u, diff=r["apart"])
            if r["diff"] > 1e-5:
                if r["last_only"] <= 1e-5:
                    raise WrongAnswer("ex_zero_grad_inside")
                if u == 1 and r["cos"] > 1 - 1e-6 and abs(r["ratio"] - 1) > 0.01:
                    raise WrongAnswer("ex_not_divided", ratio=r["ratio"])
                if u > 1 and r["K"] == first_k:
                    raise WrongAnswer("ex_no_zero_grad", step=u)
                raise off("model.parameters()", r["diff"], "ex_order_accum")
        except WrongAnswer as e:
            if r["K"] == first_k:
                raise
            # Right with K = first_k, wrong with another K: K is written as a number.
            raise WrongAnswer("ex_accum_k", K=r["K"], first=first_k) from e


def grade_accumulation(ranks: Ranks, fn: Callable,
                       accum_steps: Sequence[int] = (4, 4, 2)) -> None:
    """`fn(model, optimizer, criterion, batches)`: one update of K micro-batches.

    Called once per entry of `accum_steps`, with that many micro-batches.
    """
    _accumulation_verdict(ranks.run(_accumulation_trial, fn, tuple(accum_steps)))
    right("ex_accum_ok", updates=len(accum_steps))


def _schedule_trial(fn: Callable, updates: int) -> dict:
    """Runs on every rank: `fn` trains with a halving learning rate; one process too."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = workload.Config(accum_steps=2, batch_per_rank=8, lr=0.1)
    dataset, criterion = workload.make_dataset(cfg), models.MyLoss()
    model, _ = workload.wrap(cfg)
    reference = workload.make_model(cfg)
    early = workload.make_model(cfg)  # the scheduler stepped before the optimizer
    optimizers = [workload.make_optimizer(m, cfg) for m in (model, reference, early)]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in optimizers]
    batches = [workload.micro_batches(dataset, cfg, u, rank, world_size)
               for u in range(updates)]
    fn(model, optimizers[0], schedulers[0], criterion, batches, rank)
    with warnings.catch_warnings():  # torch warns of the order `early` uses
        warnings.simplefilter("ignore", UserWarning)
        for u in range(updates):
            (X, y), = workload.micro_batches(dataset, cfg, u, rank, world_size,
                                             whole=True)
            for m, opt, sched, first in ((reference, optimizers[1], schedulers[1],
                                          False),
                                         (early, optimizers[2], schedulers[2], True)):
                opt.zero_grad()
                criterion(m(X), y).backward()
                if first:
                    sched.step()
                opt.step()
                if not first:
                    sched.step()
    return {"lr": optimizers[0].param_groups[0]["lr"],
            "apart": compare.replica_max_diff(model),
            "diff": compare.max_abs_diff(model.module.parameters(),
                                         reference.parameters()),
            "early": compare.max_abs_diff(model.module.parameters(),
                                          early.parameters())}


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
        if r["early"] <= 1e-5:
            raise WrongAnswer("ex_scheduler_first")
        raise off("model.parameters()", r["diff"], "ex_only_line")
    right("ex_diverge_ok", lr=lrs[0])
