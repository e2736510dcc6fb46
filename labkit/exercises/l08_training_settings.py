"""Lesson 08 (training settings): a large batch's warm-up, SyncBatchNorm's statistics.

Messages below; how a grader answers: labkit.exercises.feedback. `_..._trial`
functions run on the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import training
from .feedback import WrongAnswer, off, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ['grade_warmup_schedule', 'grade_global_statistics']

register({  # key: (ja, en)
    "ex_lr_not_scaled": (
        "ウォームアップのあと、バッチ {batch} の学習率が {got:g} で、バッチ 32 "
        "のときと同じです。ヒント: 学習率をバッチサイズに比例させます (0.2 の "
        "batch_size / 32 倍)。",
        "After the warm-up, batch {batch} trains at {got:g}, the rate of batch 32. "
        "Hint: scale the rate with the batch: batch_size / 32 times 0.2."),
    "ex_lr_sqrt": (
        "ウォームアップのあと、バッチ {batch} の学習率が {got:g} で、0.2 × "
        "√(batch_size / 32) (平方根に比例させる規則) になっています。ヒント: "
        "このレッスンでは、学習率をバッチサイズそのものに比例させます。",
        "After the warm-up, batch {batch} trains at {got:g}, "
        "0.2 × √(batch_size / 32): the square-root rule. Hint: this lesson scales the "
        "rate linearly with the batch."),
    "ex_lr_peak": (
        "ウォームアップのあと、バッチ {batch} の学習率が {got:g} で、"
        "比例させた値になっていません。ヒント: バッチが 16 倍なら学習率も 16 倍です "
        "(0.2 × batch_size / 32)。",
        "After the warm-up, batch {batch} trains at {got:g}, not the scaled rate. "
        "Hint: 16 times the batch, 16 times the rate (0.2 × batch_size / 32)."),
    "ex_lr_no_warmup": (
        "バッチ {batch} で、ステップ 0 から最大の学習率になっています。"
        "ウォームアップがありません。ヒント: LinearLR は start_factor × 最大値 = "
        "最大値 / 20 から始まります。",
        "Batch {batch} trains at the peak rate from step 0: there is no warm-up. "
        "Hint: LinearLR starts at start_factor × peak = peak / 20."),
    "ex_lr_from_zero": (
        "ステップ 0 の学習率が 0 です (バッチ {batch})。これでは最初の更新で"
        "何も変わりません。ヒント: LinearLR は 0 ではなく、start_factor × 最大値 = "
        "最大値 / 20 から始まります。",
        "At step 0 the rate is 0 (batch {batch}): the first update does nothing. "
        "Hint: LinearLR starts at start_factor × peak = peak / 20, not at 0."),
    "ex_lr_from_base": (
        "ステップ 0 で、バッチ {batch} の学習率が {got:g} (バッチ 32 の学習率) です。"
        "Goyal らの論文のウォームアップはここから始まります。ヒント: このレッスンの "
        "LinearLR(start_factor=1/20) は、最大値 / 20 から始まります。",
        "At step 0 batch {batch} gets {got:g}, the rate of batch 32, where Goyal et "
        "al.'s warm-up starts. Hint: the lesson's LinearLR(start_factor=1/20) starts "
        "at peak / 20."),
    "ex_lr_start": (
        "ステップ 0 で、バッチ {batch} の学習率が {got:g} です。ヒント: LinearLR は "
        "start_factor × 最大値 = 最大値 / 20 から始まります (上の実行では、バッチ 512 "
        "で 0.16)。",
        "At step 0 batch {batch} gets {got:g}. Hint: LinearLR starts at "
        "start_factor × peak = peak / 20 (0.16 at batch 512 in the run above)."),
    "ex_lr_warmup_end": (
        "バッチ {batch} の学習率が最大値に届くのがステップ {step} です。ヒント: "
        "LinearLR(total_iters=20) が最大値に届くのはステップ 20 です。"
        "それまでの倍率は 1/20 + (1 − 1/20) × step / 20 です。",
        "Batch {batch} reaches the peak at step {step}. Hint: "
        "LinearLR(total_iters=20) reaches it at step 20; until then the factor is "
        "1/20 + (1 − 1/20) × step / 20."),
    "ex_lr_floor": (
        "ウォームアップのあと、バッチ {batch} の学習率が {got:g} で、batch_size // 32 "
        "(切り捨ての割り算) に比例しています。ヒント: 32 で割り切れないバッチも"
        "あるので、`/` で割ります (0.2 × batch_size / 32)。",
        "After the warm-up, batch {batch} trains at {got:g}: batch_size // 32, which "
        "rounds down. Hint: not every batch is a multiple of 32; divide with `/` "
        "(0.2 × batch_size / 32)."),
    "ex_lr_after_warmup": (
        "バッチ {batch} の学習率は、ステップ 20 で最大値 {peak:g} に届きますが、"
        "ステップ {k} では {got:g} です。ヒント: ウォームアップが終わったあとは、"
        "倍率は 1 のままです (`min(step, 20)`)。",
        "Batch {batch} reaches the peak {peak:g} at step 20, but gets {got:g} at step "
        "{k}. Hint: after the warm-up the factor stays 1 (`min(step, 20)`)."),
    "ex_lr_hint": (
        "ステップ 0 から 20 まで、学習率は直線で上がります。",
        "from step 0 to step 20 the rate rises in a straight line."),
    "ex_lr_ok": (
        "バッチ 512 では、ステップ 0 で {first:.2f}、そこから直線で上がり、ステップ "
        "{steps} で {peak:g} になります。上の実行の LinearLR と同じです。",
        "Batch 512: {first:.2f} at step 0, then up in a straight line to {peak:g} at "
        "step {steps}, as LinearLR in the run above."),
    "ex_bn_shape": (
        "平均と分散の 2 つのテンソルを返します。どちらも特徴ごとに 1 つずつ、"
        "{features} 個の値です。",
        "Return two tensors, the mean and the variance, each with one value per "
        "feature ({features})."),
    "ex_bn_local": (
        "`{what}` が各ランクのバッチだけの統計で、ランクごとに違う値で正規化することに"
        "なります。ヒント: 必要な量 (サンプル数、和など) を all-reduce して、"
        "どのランクも全サンプルの統計を得るようにします。",
        "`{what}` is each rank's own statistic, so the ranks normalize differently. "
        "Hint: all-reduce what you need (the number of samples, the sum, ...) so that "
        "every rank gets the statistics of all samples."),
    "ex_bn_count": (
        "`{what}` で、all-reduce した和を自分のランクのサンプル数で割っています。"
        "ヒント: 全ランクのサンプル数で割ります。サンプル数も all-reduce します。",
        "`{what}` divides the all-reduced sum by this rank's number of samples. Hint: "
        "divide by the number of all ranks' samples; all-reduce that too."),
    "ex_bn_mean_of_means": (
        "`{what}` がランクごとの平均の平均です。バッチの大きさが違うと、"
        "小さいバッチのサンプルほど重く数えられます。ヒント: 和とサンプル数をそれぞれ "
        "all-reduce してから割ります。",
        "`{what}` is the average of the ranks' means. With batches of different sizes "
        "that gives the samples of a small batch more weight. Hint: all-reduce the "
        "sums and the numbers of samples, then divide."),
    "ex_bn_not_divided": (
        "`{what}` が全サンプルの和のままです。ヒント: 全ランクのサンプル数で割ります。",
        "`{what}` is a sum over all samples. Hint: divide by the number of all ranks' "
        "samples."),
    "ex_bn_var_of_vars": (
        "`{what}` がランクごとの分散の平均で、ランクの平均どうしの離れ具合が"
        "抜けています。ヒント: 各サンプルの、全体の平均からのずれで計算します "
        "(または二乗和を all-reduce します)。",
        "`{what}` averages the ranks' variances and misses how far apart the ranks' "
        "means lie. Hint: take every sample's distance from the global mean (or "
        "all-reduce the sums of squares)."),
    "ex_bn_unbiased": (
        "`{what}` が不偏分散 (サンプル数 − 1 で割ったもの) です。ヒント: BatchNorm "
        "が正規化に使うのは、サンプル数で割った分散です。",
        "`{what}` is the unbiased variance (divided by the number of samples − 1). "
        "Hint: BatchNorm normalizes with the variance divided by the number of "
        "samples."),
    "ex_bn_squares": (
        "`{what}` が二乗の平均です。ヒント: 分散は「二乗の平均 − 平均の二乗」です。",
        "`{what}` is the mean of the squares. Hint: the variance is the mean of the "
        "squares minus the square of the mean."),
    "ex_bn_equal_batches": (
        "`{what}` は、全体のサンプル数を world size × 自分のバッチの大きさとして"
        "います。ランクごとにバッチの大きさが違うと、ランクごとに違う値になります。"
        "ヒント: サンプル数も all-reduce します。",
        "`{what}` takes all ranks' samples to be world size × this rank's batch: "
        "with batches of different sizes, each rank gets another value. Hint: "
        "all-reduce the number of samples too."),
    "ex_bn_one_rank": (
        "`{what}` はランク 0 では合っていますが、ランク {rank} では違います。"
        "`dist.reduce` は結果を dst のランクにしか書きません。ヒント: どのランクも"
        "同じ値を得るように、`dist.all_reduce` を使います。",
        "`{what}` is right on rank 0 but not on rank {rank}: `dist.reduce` writes the "
        "result on its dst rank only. Hint: use `dist.all_reduce`, so that every "
        "rank gets the same values."),
    "ex_bn_again": (
        "サンプル数 {first} では合っていましたが、{counts} = {total} サンプル、特徴 "
        "{features} 個で呼ぶと、`{what}` が違います。ヒント: サンプル数や特徴の数を"
        "決め打ちせず、`x` と all-reduce から求めます。",
        "Right for {first} samples, but called with {counts} = {total} samples of "
        "{features} features, `{what}` is wrong. Hint: take the numbers of samples and "
        "features from `x` and all-reduces, not from the first call."),
    "ex_bn_hint": (
        "どのランクも、全ランクのサンプルを合わせた同じ平均と分散を得ます。",
        "every rank ends with the same mean and variance, those of all ranks' samples "
        "together."),
    "ex_bn_ok": (
        "サンプル数がランクごとに違っても ({counts} = {total})、どのランクも"
        "全サンプルの平均と分散を得ました。SyncBatchNorm が学習中の正規化に"
        "使う値です。",
        "With {counts} = {total} samples on the ranks, every rank got the mean and "
        "variance of all of them: what SyncBatchNorm normalizes with in training."),
})


# Lesson 08's warm-up run: lr 0.2 suits batch 32; LinearLR over 20 steps.
BASE_LR, BASE_BATCH, WARMUP_STEPS = 0.2, 32, 20


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-9)


def _warmup_lrs(peak: float, steps: int) -> list[float]:
    """The rate at each optimizer step under torch's LinearLR, as in training.fit."""
    cfg = training.TrainConfig(lr=peak, schedule="warmup", warmup_steps=WARMUP_STEPS,
                        steps=steps)
    optimizer = training.make_optimizer(torch.nn.Linear(1, 1), cfg)
    scheduler = training.make_scheduler(optimizer, cfg)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients: nothing moves, but the order is torch's
        scheduler.step()
    return lrs


# 80 is no multiple of 32: an answer that divides with // is right only for the others.
def grade_warmup_schedule(fn: Callable, batch_sizes=(128, 512, 2048, 80)) -> None:
    """`fn(step, batch_size)`: the linearly scaled rate with LinearLR's warm-up."""
    steps = 3 * WARMUP_STEPS
    for batch in batch_sizes:
        ratio = batch / BASE_BATCH
        want = _warmup_lrs(BASE_LR * ratio, steps)
        got = [fn(step, batch) for step in range(steps)]
        if any(lr is None for lr in got):
            raise WrongAnswer("ex_fill_in", name=f"lr_at(step, {batch})")
        got = [float(lr) for lr in got]
        peak, last = want[-1], got[-1]
        if _close(got[WARMUP_STEPS], peak) and not _close(last, peak):
            step = next(i for i in range(WARMUP_STEPS, steps)
                        if not _close(got[i], peak))
            raise WrongAnswer("ex_lr_after_warmup", batch=batch, peak=peak,
                              k=step, got=got[step])
        if not _close(last, peak):
            key = ("ex_lr_not_scaled" if _close(last, BASE_LR) else "ex_lr_sqrt"
                   if _close(last, BASE_LR * math.sqrt(ratio)) else "ex_lr_floor"
                   if _close(last, BASE_LR * (batch // BASE_BATCH)) else "ex_lr_peak")
            raise WrongAnswer(key, batch=batch, got=last)
        if _close(got[0], peak):
            raise WrongAnswer("ex_lr_no_warmup", batch=batch)
        if not _close(got[0], want[0]):
            key = ("ex_lr_from_zero" if got[0] == 0 else "ex_lr_from_base"
                   if _close(got[0], BASE_LR) else "ex_lr_start")
            raise WrongAnswer(key, batch=batch, got=got[0])
        reached = next(step for step, lr in enumerate(got) if _close(lr, peak))
        if reached != WARMUP_STEPS:
            raise WrongAnswer("ex_lr_warmup_end", batch=batch, step=reached)
        if (diff := max(abs(g - w) for g, w in zip(got, want, strict=True))) > 1e-6:
            raise off(f"lr_at(step, {batch})", diff, "ex_lr_hint")
    peak = BASE_LR * 512 / BASE_BATCH
    right("ex_lr_ok", first=_warmup_lrs(peak, 1)[0], peak=peak, steps=WARMUP_STEPS)


def _bn_batch(rank: int, again: bool = False) -> torch.Tensor:
    """Rank `rank`'s samples: 3 + 6 × rank of 4 features, further out on higher
    ranks; `again`, a second call's other sizes (5 on rank 0, rank + 1 elsewhere)
    and 3 features, which an answer fitted to the first call gets wrong."""
    g = torch.Generator().manual_seed((400 if again else 200) + rank)
    count = (5 if rank == 0 else rank + 1) if again else 3 + 6 * rank
    x = torch.randn(count, 3 if again else 4, generator=g)
    return x * (1 + rank) + 3.0 * rank


def _statistics_trial(fn: Callable) -> list[list[list[float]] | None]:
    """Runs on every rank: `fn` on this rank's batch, then on the second call's;
    the mean and variance of each."""
    out = []
    for again in (False, True):
        got = fn(_bn_batch(dist.get_rank(), again))
        out.append(None if got is None else [
            torch.as_tensor(v, dtype=torch.float64).reshape(-1).tolist() for v in got])
    return out


def _matches(got: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
    return all(torch.allclose(g, v, rtol=1e-4, atol=1e-5)
               for g, v in zip(got, values, strict=True))


def _diagnose(got: list[torch.Tensor], want: list[torch.Tensor],
              wrong: list[tuple[str, list[torch.Tensor]]], what: str,
              hint: str) -> None:
    """Raise WrongAnswer unless every rank's `got` is `want`, naming the mistake."""
    if _matches(got, want):
        return
    for key, values in wrong:
        if _matches(got, values):
            raise WrongAnswer(key, what=what)
    if _matches(got[:1], want[:1]):  # rank 0 only: a reduce, or a broadcast missed
        rank = next(r for r in range(1, len(got)) if not _matches(got[r:r + 1],
                                                                  want[r:r + 1]))
        raise WrongAnswer("ex_bn_one_rank", what=what, rank=rank)
    raise off(what, max((g - w).abs().max().item()
                        for g, w in zip(got, want, strict=True)), hint)


def _split(results: list, features: int) -> tuple[list, list] | None:
    """Each rank's mean and variance as tensors, or None if any is malformed."""
    if any(len(r) != 2 or any(len(v) != features for v in r) for r in results):
        return None
    return ([torch.tensor(r[0], dtype=torch.float64) for r in results],
            [torch.tensor(r[1], dtype=torch.float64) for r in results])


def grade_global_statistics(ranks: Ranks, fn: Callable) -> None:
    """`fn(x)` on every rank: each feature's mean and biased variance over all ranks,
    called twice with batches of other sizes."""
    results = ranks.run(_statistics_trial, fn)
    if any(r is None for rank in results for r in rank):
        raise WrongAnswer("ex_fill_in", name="global_mean_var(x)")
    world = ranks.world_size
    batches = [_bn_batch(rank).double() for rank in range(world)]
    whole = torch.cat(batches)
    features = whole.shape[1]
    if (split := _split([r[0] for r in results], features)) is None:
        raise WrongAnswer("ex_bn_shape", features=features)
    means, variances = split
    mean = whole.mean(0)

    def each(stat: Callable) -> list[torch.Tensor]:
        return [stat(b) for b in batches]

    def same(value: torch.Tensor) -> list[torch.Tensor]:
        return world * [value]

    _diagnose(means, same(mean), [
        ("ex_bn_local", each(lambda b: b.mean(0))),
        ("ex_bn_count", each(lambda b: whole.sum(0) / len(b))),
        ("ex_bn_mean_of_means", same(torch.stack(each(lambda b: b.mean(0))).mean(0))),
        ("ex_bn_not_divided", same(whole.sum(0))),
        ("ex_bn_equal_batches", each(lambda b: whole.sum(0) / (world * len(b)))),
    ], "mean", "ex_bn_hint")
    counts = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    local_vars = torch.stack(each(lambda b: b.var(0, unbiased=False)))
    _diagnose(variances, same(whole.var(0, unbiased=False)), [
        ("ex_bn_local", each(lambda b: b.var(0, unbiased=False))),
        ("ex_bn_local", each(lambda b: b.var(0))),
        ("ex_bn_var_of_vars", same(local_vars.mean(0))),
        ("ex_bn_var_of_vars", same(counts @ local_vars / counts.sum())),
        ("ex_bn_unbiased", same(whole.var(0))),
        ("ex_bn_squares", same(whole.pow(2).mean(0))),
        ("ex_bn_not_divided", same((whole - mean).pow(2).sum(0))),
    ], "var", "ex_bn_hint")
    # The second call: other sizes, other features. Right once, wrong now, is an
    # answer fitted to the first call (a count or shape written in, a cached value).
    again = torch.cat([_bn_batch(rank, again=True).double() for rank in range(world)])
    sizes = " + ".join(str(len(_bn_batch(rank, again=True))) for rank in range(world))
    split = _split([r[1] for r in results], again.shape[1])
    for what, i, value in (("mean", 0, again.mean(0)),
                           ("var", 1, again.var(0, unbiased=False))):
        if split is None or not _matches(split[i], same(value)):
            raise WrongAnswer("ex_bn_again", first=len(whole), counts=sizes,
                              total=len(again), features=again.shape[1], what=what)
    right("ex_bn_ok", counts=" + ".join(str(len(b)) for b in batches), total=len(whole))
