"""Lesson 03 (ddp): set_epoch's shuffling, and averaging gradients by hand.

Messages below; how a grader answers: labkit.exercises.feedback. `_..._trial`
functions run on the ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import compare, models
from .. import data as datasets
from .feedback import WrongAnswer, off, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ['grade_set_epoch', 'grade_average_gradients']

register({  # key: (ja, en)
    "ex_epochs": ("エポック {epoch} で、ランクの添字が重なっているか、"
                  "欠けているサンプルがあります。ヒント: 全ランクが同じ `seed` "
                  "と同じエポック番号を使えば、1 つの並びを重ならずに分け合います。",
                  "In epoch {epoch} the ranks' indices overlap or miss samples. "
                  "Hint: with the same `seed` and the same epoch number on every "
                  "rank, the ranks share one order without overlap."),
    "ex_epoch_count": ("ランク {rank} の関数が、{num_epochs} エポックに {got} "
                       "個の並びを返しました。ヒント: エポックごとに "
                       "`list(sampler)` を 1 つ返します。",
                       "On rank {rank} the function returned {got} orders for "
                       "{num_epochs} epochs. Hint: return one `list(sampler)` per "
                       "epoch."),
    "ex_repeats": ("エポック {a} と {b} の並びが同じです。ヒント: 各エポックの初めに "
                   "`sampler.set_epoch(epoch)` を呼びます。",
                   "Epochs {a} and {b} have the same order. Hint: call "
                   "`sampler.set_epoch(epoch)` at the start of each epoch."),
    "ex_epochs_ok": ("どのエポックでも、ランクは全 {n} サンプルを重ならずに分け合い、"
                     "並びはエポックごとに変わりました。",
                     "In every epoch the ranks share all {n} samples without "
                     "overlap, and the order changes from epoch to epoch."),
    "ex_grads_apart": ("ランクの勾配が {diff:.1e} 違います。各ランクの `.grad` は、"
                       "まだ自分の分のデータの勾配です。ヒント: 各パラメータの "
                       "`p.grad` そのものを `dist.all_reduce` します (コピーを "
                       "all-reduce しても `p.grad` は変わりません)。",
                       "The ranks' gradients differ by {diff:.1e}: each `.grad` "
                       "still holds its own share's gradient. Hint: all-reduce each "
                       "parameter's `p.grad` itself (all-reducing a copy leaves "
                       "`p.grad` as it was)."),
    "ex_grads_one_rank": (
        "ランク {good} の勾配は全体バッチの勾配になりましたが、ランク {bad} "
        "はなっていません。ヒント: どのランクも同じ行を実行します。"
        "`if rank == 0:` の中に置いた処理は、ほかのランクでは起きません。",
        "Rank {good} got the whole batch's gradient, rank {bad} did not. Hint: "
        "every rank runs the same lines; what sits under `if rank == 0:` happens "
        "on no other rank."),
    "ex_grads_summed": (
        "勾配が全体バッチの勾配のちょうど {ratio:.0f} 倍です。ヒント: all-reduce "
        "は全ランクの値を足し合わせます。平均にするには world size で割ります。",
        "The gradients are exactly {ratio:.0f} times the whole batch's. Hint: "
        "all-reduce adds up the ranks' values; divide by the world size for their "
        "mean."),
    "ex_mean_hint": ("平均 = 全ランクの和 ÷ world size です。",
                     "the mean is the ranks' sum divided by the world size."),
    "ex_grads_ok": ("どのランクの勾配も、全体バッチの勾配と同じになりました。DDP "
                    "が逆伝播の中で行っていることです。",
                    "Every rank's gradient equals the whole batch's: what DDP does "
                    "during backward."),
})


def _epoch_trial(fn: Callable, n: int, num_epochs: int) -> list[list[int]]:
    """Runs on every rank: the learner's index lists, one per epoch."""
    orders = fn(datasets.MyDataset(n=n), dist.get_rank(), dist.get_world_size(),
                num_epochs)
    return [[int(i) for i in order] for order in orders]


def grade_set_epoch(ranks: Ranks, fn: Callable, n: int = 16,
                    num_epochs: int = 3) -> None:
    """`fn(dataset, rank, world_size, num_epochs)`: a rank's indices in each epoch."""
    per_rank = ranks.run(_epoch_trial, fn, n, num_epochs)
    for rank, orders in enumerate(per_rank):
        if len(orders) != num_epochs:
            raise WrongAnswer("ex_epoch_count", rank=rank, got=len(orders),
                              num_epochs=num_epochs)
    for epoch in range(num_epochs):
        seen = [i for orders in per_rank for i in orders[epoch]]
        if len(seen) != n or set(seen) != set(range(n)):
            raise WrongAnswer("ex_epochs", epoch=epoch)
    for b in range(1, num_epochs):
        for a in range(b):
            if all(orders[a] == orders[b] for orders in per_rank):
                raise WrongAnswer("ex_repeats", a=a, b=b)
    right("ex_epochs_ok", n=n)


def _average_trial(fn: Callable) -> dict:
    """Runs on every rank: its share's gradient averaged by `fn`, vs the whole batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = models.MLP()
    local, criterion = copy.deepcopy(model), models.MyLoss()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 10, generator=g), torch.randn(64, 10, generator=g)
    criterion(model(datasets.shard(X, rank, world_size)),
              datasets.shard(y, rank, world_size)).backward()
    fn(model, world_size)
    criterion(local(X), y).backward()
    grad, want = compare.flat(compare.grads(model)), compare.flat(compare.grads(local))
    return {"apart": compare.rank_max_diff(grad),
            "diff": compare.max_abs_diff(grad, want),
            "ratio": (grad @ want / (want @ want)).item()}


def grade_average_gradients(ranks: Ranks, fn: Callable) -> None:
    """`fn(model, world_size)`: every `.grad` becomes the mean over the ranks."""
    results = ranks.run(_average_trial, fn)
    r = results[0]
    if r["apart"] > 0:
        good = [rank for rank, x in enumerate(results) if x["diff"] <= 1e-6]
        if good:  # right on some ranks only: work done on one rank
            raise WrongAnswer("ex_grads_one_rank", good=good[0], bad=next(
                rank for rank, x in enumerate(results) if x["diff"] > 1e-6))
        raise WrongAnswer("ex_grads_apart", diff=r["apart"])
    if r["diff"] > 1e-6:
        if abs(r["ratio"] - ranks.world_size) < 1e-3:
            raise WrongAnswer("ex_grads_summed", ratio=r["ratio"])
        raise off("p.grad", r["diff"], "ex_mean_hint")
    right("ex_grads_ok")
