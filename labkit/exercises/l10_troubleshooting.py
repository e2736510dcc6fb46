"""Lessons 10 and 11: unused parameters (course/10_troubleshooting.py), an uneven
epoch and an exact metric (course/11_uneven_and_restarts.py).

Messages below; how a grader answers: labkit.exercises.feedback. `_..._trial`
functions run on the ranks. The truth is computed, not written down: which
parameters get no gradient from a real backward pass, the weights of a correct
run with `Join` on the same ranks, the mean of the whole data set.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..i18n import t
from .feedback import WrongAnswer, off, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ["grade_exact_mean", "grade_uneven_epoch", "grade_unused_parameters"]

register({  # key: (ja, en)
    "ex_unused_stale": (
        "前の学習の勾配が残っているモデルで、{got} と答えました (正しくは {want})。"
        "ヒント: 勾配が残っていると、使われないパラメータにも .grad があります。"
        "調べる前に `model.zero_grad(set_to_none=True)` で勾配を None にします。",
        "On a model still holding gradients from earlier training you answered {got} "
        "({want} is right). Hint: left-over gradients give unused parameters a .grad "
        "too; set them to None first with `model.zero_grad(set_to_none=True)`."),
    "ex_unused_wrong": (
        "{model} で {got} と答えましたが、正しくは {want} です。ヒント: 1 回順伝播と"
        "逆伝播をしてから、`model.named_parameters()` で勾配が None の名前を集め、"
        "並べ替えます。",
        "For {model} you answered {got}, but {want} is right. Hint: after one forward "
        "and backward pass, collect the names from `model.named_parameters()` whose "
        "gradient is None, sorted."),
    "ex_unused_zero": (
        "{model} で {got} と答えましたが、正しくは {want} です。勾配が 0 のパラメータも"
        "数えています。0 だけの勾配も、逆伝播が計算した勾配です (DDP はそれも待ち、"
        "送ります)。ヒント: 値ではなく、`.grad` が None かどうかで見分けます。",
        "For {model} you answered {got}, but {want} is right: you count parameters "
        "whose gradient is zero. A gradient of zeros is still one the backward pass "
        "computed (DDP waits for it and sends it). Hint: tell them by whether `.grad` "
        "is None, not by its values."),
    "ex_unused_ok": (
        "{n} 個のモデルで、勾配ができないパラメータを正しく列挙しました (前の勾配が"
        "残っていても)。",
        "You named the parameters that get no gradient in {n} models, left-over "
        "gradients or not."),
    "ex_join_hang": (
        "ランク 0 に 5 個、ランク 1 に 4 個のバッチを渡すと、エポックが最後まで"
        "終わりませんでした "
        "(ランク {ranks} が時間切れ)。ヒント: バッチを使い切ったランクが、まだ学習して"
        "いるランクの all-reduce に加わるようにします: `with Join([model]):` の中で"
        "ループを回します。",
        "With 5 batches on rank 0 and 4 on rank 1 the epoch did not end (rank {ranks} "
        "timed out). Hint: let a rank that is out of batches join the others' "
        "all-reduces: run the loop inside `with Join([model]):`."),
    "ex_join_apart": (
        "エポックは終わりましたが、ランクの重みが {diff:.1e} 違います。"
        "レプリカがずれました。ヒント: 全ランクが同じ回数だけ同期した更新をするには、"
        "`Join` を使います。",
        "It ended, but the ranks' weights differ by {diff:.1e}: the replicas drifted "
        "apart. Hint: `Join` keeps every rank's updates synchronized."),
    "ex_join_dropped": (
        "エポックは終わりましたが、ランク 0 の 5 個目のバッチで学習していません "
        "(重みは、各ランクが 4 個ずつで学習したものと同じです)。ヒント: バッチを"
        "捨てずに、`Join` で最後まで学習します。",
        "It ended, but rank 0's fifth batch was never trained on (the weights are "
        "those of 4 batches on each rank). Hint: keep every batch and train to the "
        "end inside `Join`."),
    "ex_join_divide": (
        "エポックは終わり、ランクの重みも一致しましたが、重みは "
        "`Join(..., divide_by_initial_world_size=False)` のものです。ランク 0 の "
        "5 ステップ目で、勾配を、まだ学習しているランクの数 (1) で割っています。"
        "ヒント: このレッスンの `Join` は既定の divide_by_initial_world_size=True "
        "で、最初の world size (2) で割ります。",
        "The epoch ended and the ranks agree, but the weights are those of "
        "`Join(..., divide_by_initial_world_size=False)`: rank 0's fifth step divides "
        "the gradient by the ranks still training (1). Hint: the lesson's `Join` keeps "
        "the default, divide_by_initial_world_size=True, which divides by the initial "
        "world size (2)."),
    "ex_join_weights": ("学習後の重み", "the weights after the epoch"),
    "ex_join_hint": (
        "ランク 0 の 5 ステップ目の勾配は、自分の勾配と 0 の平均です。",
        "rank 0's fifth step uses the mean of its own gradient and zeros."),
    "ex_join_ok": (
        "バッチの数が違っても (5 と 4)、両方のランクで最後まで学習し、重みは `Join` を"
        "使った学習と同じで、ランクどうしも一致しました。",
        "With 5 and 4 batches, both ranks trained to the end; the weights are those of "
        "a run with `Join`, the same on both ranks."),
    "ex_exact_local": (
        "サンプル数 {total} のデータセットで、ランクごとに違う値 ({got}) を"
        "返しました。"
        "このランクのサンプルだけの平均です。ヒント: 和と個数を `dist.all_reduce` で"
        "全ランクについて足します。",
        "For a data set of {total} the ranks returned different values ({got}): each "
        "rank's own mean. Hint: add up the sums and counts of all ranks with "
        "`dist.all_reduce`."),
    "ex_exact_padding": (
        "サンプル数 {total} のデータセットで {got:.4f} を返しました。水増しの"
        "サンプルも数えています (各ランクの平均の平均も同じ値になります。"
        "どのランクも同じ数のサンプルを持つからです)。ヒント: ランク r の k 番目は、"
        "`r + k * world_size >= total` なら水増しです。",
        "For a data set of {total} you returned {got:.4f}: the padding counts too "
        "(the mean of the ranks' means gives the same, since every rank holds as many "
        "samples). Hint: the k-th sample of rank r is padding when "
        "`r + k * world_size >= total`."),
    "ex_exact_dropped": (
        "サンプル数 {total} のデータセットで {got:.4f} を返しました。水増しでない"
        "サンプルを {n} 個落としています (drop_last=True と同じく、どのランクも "
        "total // world_size 個しか数えていません)。ヒント: ランク r の k 番目は、"
        "`r + k * world_size < total` なら水増しでない実データです。ランク 0 は"
        "ほかのランクより 1 個多く持つことがあります。",
        "For a data set of {total} you returned {got:.4f}: {n} real sample(s) left "
        "out (as with drop_last=True, every rank counts only total // world_size). "
        "Hint: the k-th sample of rank r is real when `r + k * world_size < total`; "
        "rank 0 may hold one more than the others."),
    "ex_exact_what": ("サンプル数 {total} のデータセットの平均",
                     "the mean of a data set of {total}"),
    "ex_exact_hint": (
        "水増しを除いた和と個数を all-reduce して割ります。",
        "all-reduce the sum and the count without the padding, then divide."),
    "ex_exact_ok": (
        "サンプル数 {totals} のデータセットで、どのランクも水増しを除いた正確な平均を"
        "得ました。",
        "For data sets of {totals} samples every rank got the exact mean, padding "
        "left out."),
})


# The models of grade_unused_parameters: (name, model, input).
class _Branches(nn.Module):
    """A shared trunk and two heads; `aux` only when asked for."""

    def __init__(self, use_aux: bool):
        super().__init__()
        self.use_aux = use_aux
        self.trunk = nn.Linear(6, 8)
        self.main = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.main(h) + (self.aux(h) if self.use_aux else 0)


class _Frozen(nn.Module):
    """A scale used only through .detach(): used, yet no gradient reaches it."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.layer(x) * self.scale.detach()


class _Dead(nn.Module):
    """A hidden layer no sample gets through (a ReLU behind a large negative bias):
    every parameter is used, yet three get gradients of zeros, not None."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)
        with torch.no_grad():
            self.hidden.bias.fill_(-1e3)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def _models() -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)
    return [("_Branches(use_aux=False)", _Branches(False)),
            ("_Branches(use_aux=True)", _Branches(True)),
            ("nn.Sequential(Linear, ReLU, Linear)",
             nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))),
            ("_Frozen()", _Frozen()), ("_Dead()", _Dead())]


def _no_grad_names(model: nn.Module, X: torch.Tensor) -> list[str]:
    model.zero_grad(set_to_none=True)
    model(X).sum().backward()
    return sorted(n for n, p in model.named_parameters() if p.grad is None)


def _zero_grad_names(model: nn.Module, X: torch.Tensor) -> list[str]:
    """A wrong reading: the parameters whose gradient is None or all zeros."""
    model.zero_grad(set_to_none=True)
    model(X).sum().backward()
    return sorted(n for n, p in model.named_parameters()
                  if p.grad is None or not p.grad.any())


def grade_unused_parameters(fn: Callable) -> None:
    """Lesson 10: `fn(model, X)`: the sorted names of the parameters that get no
    gradient."""
    X = torch.randn(4, 6)
    for stale in (False, True):
        for name, model in _models():
            want = _no_grad_names(copy.deepcopy(model), X)
            if stale:  # gradients left from earlier training, on every parameter
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
            got = fn(model, X)
            if got is None:
                raise WrongAnswer("ex_fill_in", name="unused_parameters(model, X)")
            got = sorted(got)
            if got == want:
                continue
            if stale and got == []:
                raise WrongAnswer("ex_unused_stale", got=got, want=want)
            if got == _zero_grad_names(copy.deepcopy(model), X):
                raise WrongAnswer("ex_unused_zero", model=name, got=got, want=want)
            raise WrongAnswer("ex_unused_wrong", model=name, got=got, want=want)
    right("ex_unused_ok", n=len(_models()))


def _uneven_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0: 5 batches, every other rank 4."""
    g = torch.Generator().manual_seed(300 + rank)
    return [(torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g))
            for _ in range(5 if rank == 0 else 4)]


def _uneven_trial(fn: Callable | None, only_common: bool = False,
                  divide: bool = True) -> list[float]:
    """Runs on every rank: an epoch of `fn` on this rank's uneven batches; the
    weights after it, flattened. Without `fn`, the reference (with Join), or
    with `only_common` every rank's first 4 batches (a wrong way to even out),
    or without `divide` Join's divide_by_initial_world_size=False."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _uneven_batches(rank)

    def train(some):
        for X, y in some:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(X), y).backward()
            optimizer.step()

    if fn is not None:
        fn(model, optimizer, batches)
    elif only_common:
        train(batches[:4])
    else:
        with Join([model], divide_by_initial_world_size=divide):
            train(batches)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


# What a rank's traceback shows when a collective timed out or broke.
_BROKEN = ("timed out", "Timed out", "Gloo", "gloo", "Connection closed",
           "Connection reset", "DistBackendError", "ProcessGroup")


def grade_uneven_epoch(ranks: Ranks, fn: Callable) -> None:
    """Lesson 11: `fn(model, optimizer, batches)` on every rank, 5 batches on rank 0,
    4 on 1."""
    from ..cluster import RankError

    try:
        got = [torch.tensor(w) for w in ranks.run(_uneven_trial, fn)]
    except RankError as err:
        # A collective that timed out or broke is the hang; any other error is
        # the learner's code failing, shown as it is.
        if not any(word in tb for tb in err.failures.values() for word in _BROKEN):
            raise
        failed = ", ".join(str(r) for r in sorted(err.failures))
        raise WrongAnswer("ex_join_hang", ranks=failed) from None
    want = torch.tensor(ranks.run(_uneven_trial, None)[0])
    apart = max((g - got[0]).abs().max().item() for g in got)
    if apart > 1e-6:
        raise WrongAnswer("ex_join_apart", diff=apart)
    dropped = torch.tensor(ranks.run(_uneven_trial, None, only_common=True)[0])
    if torch.allclose(got[0], dropped, atol=1e-7) and not torch.allclose(want, dropped):
        raise WrongAnswer("ex_join_dropped")
    if (diff := (got[0] - want).abs().max().item()) > 1e-6:
        live = torch.tensor(ranks.run(_uneven_trial, None, divide=False)[0])
        if torch.allclose(got[0], live, atol=1e-7):
            raise WrongAnswer("ex_join_divide")
        raise off(t("ex_join_weights"), diff, "ex_join_hint")
    right("ex_join_ok")


_TOTALS = (9, 10, 7)  # data set sizes: padded by 1, not padded, padded by 1


def _values(total: int) -> torch.Tensor:
    """Per-sample values whose first samples are far from the mean: padding shows."""
    return torch.arange(total, dtype=torch.float64).flip(0) ** 2


def _mean_trial(fn: Callable) -> list[float | None]:
    """Runs on every rank: `fn` on this rank's values in DistributedSampler's order."""
    from torch.utils.data import DistributedSampler

    out = []
    for total in _TOTALS:
        values = _values(total)
        mine = values[list(DistributedSampler(range(total), shuffle=False))]
        got = fn(mine, total)
        out.append(None if got is None else float(got))
    return out


def grade_exact_mean(ranks: Ranks, fn: Callable) -> None:
    """Lesson 11: `fn(values, total)` on every rank: the data set's mean, each
    sample once."""
    from torch.utils.data import DistributedSampler

    results = ranks.run(_mean_trial, fn)
    world = ranks.world_size
    for i, total in enumerate(_TOTALS):
        got = [r[i] for r in results]
        if any(g is None for g in got):
            raise WrongAnswer("ex_fill_in", name=f"exact_mean(values, {total})")
        values = _values(total)
        want = values.mean().item()
        if all(abs(g - want) < 1e-6 * max(1.0, abs(want)) for g in got):
            continue
        per_rank = [values[list(DistributedSampler(range(total), num_replicas=world,
                                                   rank=r, shuffle=False))]
                    for r in range(world)]
        if max(got) - min(got) > 1e-9:
            raise WrongAnswer("ex_exact_local", total=total,
                              got=", ".join(f"{g:.4f}" for g in got))
        if abs(got[0] - torch.cat(per_rank).mean().item()) < 1e-6:
            raise WrongAnswer("ex_exact_padding", total=total, got=got[0])
        kept = torch.cat([r[:total // world] for r in per_rank])
        if abs(got[0] - kept.mean().item()) < 1e-6:
            raise WrongAnswer("ex_exact_dropped", total=total, got=got[0],
                              n=total - len(kept))
        raise off(t("ex_exact_what", total=total), abs(got[0] - want), "ex_exact_hint")
    right("ex_exact_ok", totals=", ".join(str(n) for n in _TOTALS))
