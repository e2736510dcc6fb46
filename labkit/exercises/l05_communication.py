"""Lesson 05 (communication): predictions of the step-time and alpha-beta models.

Messages below; how a grader answers: labkit.exercises.feedback.
"""

from __future__ import annotations

import math

from .. import comm
from ..i18n import t
from .feedback import WrongAnswer, register, right

__all__ = ['grade_step_prediction', 'grade_allreduce_prediction']

register({  # key: (ja, en)
    "ex_value_off": ("{name} = {got:.4g} 秒はモデルの値と違います。ヒント: {hint}",
                     "{name} = {got:.4g} s is not the model's value. Hint: {hint}"),
    "ex_units": ("{name} はミリ秒の値のようです。答えは秒で書きます。",
                 "{name} looks like milliseconds: answer in seconds."),
    "ex_nosync_once": ("{name} の式では K 回同期しています。ヒント: no_sync では、"
                       "同期は 1 回の更新につき 1 回です。",
                       "{name} synchronizes K times. Hint: with no_sync an update "
                       "synchronizes once."),
    "ex_sync_k": ("{name} の式では同期が 1 回です。ヒント: no_sync を使わなければ、K "
                  "個のマイクロバッチのそれぞれで同期します。",
                  "{name} synchronizes once. Hint: without no_sync each of the K "
                  "micro-batches synchronizes."),
    "ex_forgot_o": ("{name} の式に o がありません。ヒント: 1 回の更新ごとに o が 1 "
                    "回加わります。",
                    "{name} lacks o. Hint: every update adds o once."),
    "ex_forgot_k": ("{name} の式では c が 1 回分です。ヒント: 順伝播と逆伝播は、K "
                    "個のマイクロバッチのそれぞれで行います。",
                    "{name} counts c once. Hint: each of the K micro-batches runs "
                    "forward and backward."),
    "ex_o_every": ("{name} の式では o を K 回数えています。ヒント: "
                   "`optimizer.step()` は 1 回の更新につき 1 回なので、o も 1 回です。",
                   "{name} counts o K times. Hint: `optimizer.step()` runs once per "
                   "update, so o counts once."),
    "ex_nosync_zero": ("{name} の式に s がありません。ヒント: no_sync でも、最後の"
                       "マイクロバッチで 1 回同期します。",
                       "{name} has no s. Hint: with no_sync the last micro-batch "
                       "still synchronizes, once per update."),
    "ex_part_unchecked": ("注意: この実行では {parts} が小さすぎて (0 "
                          "のこともあります)、式がそれを正しく数えているかは"
                          "確かめられませんでした。",
                          "Note: on this run {parts} is too small (it can be 0) "
                          "for this check to tell whether your formula counts it "
                          "right."),
    "ex_step_hint": ("c が K 回、s が K 回 (no_sync なら 1 回)、o が 1 回です。",
                     "c K times, s K times (once with no_sync), o once."),
    "ex_step_ok": ("K = {K}: 同期あり {sync:.1f} ms、no_sync {nosync:.1f} ms "
                   "の予測です。",
                   "Predicted for K = {K}: sync {sync:.1f} ms, no_sync {nosync:.1f} "
                   "ms."),
    "ex_bytes": ("{name} の式では、パラメータの数をバイト数として使っています。"
                 "ヒント: float32 は 1 つ 4 バイトです。",
                 "{name} takes the number of parameters for bytes. Hint: a float32 "
                 "takes 4 bytes."),
    "ex_ring": ("{name} の式の係数が違います。ヒント: n ランクのリング all-reduce "
                "では、各ランクが S の 2(n−1)/n 倍を送ります。",
                "{name} has a wrong factor. Hint: in a ring all-reduce over n ranks "
                "each rank sends 2(n−1)/n times S."),
    "ex_alpha_steps": ("{name} の式では α を 1 回しか払っていません。ヒント: "
                       "リング all-reduce は 2(n−1) ステップで、"
                       "ステップごとに α がかかります。",
                       "{name} pays alpha once. Hint: a ring all-reduce takes 2(n−1) "
                       "steps, and each step pays alpha."),
    "ex_part_alpha": ("α", "alpha"),
    "ex_part_beta": ("β", "beta"),
    "ex_alpha_count": ("{name} の式では α を {count} 回払っています。ヒント: "
                       "リング all-reduce は reduce-scatter と all-gather で "
                       "2(n−1) ステップあり、ステップごとに α がかかります。",
                       "{name} pays alpha {count} times. Hint: a ring all-reduce is a "
                       "reduce-scatter and an all-gather, 2(n−1) steps, and each "
                       "step pays alpha."),
    "ex_ab_ranks": ("{name} は {got} ランクでの時間です。ヒント: 問われているのは "
                    "{n} ランクです。式の n に {n} を入れます。",
                    "{name} is the time on {got} ranks. Hint: the question is for "
                    "{n} ranks; put n = {n} in the formula."),
    "ex_ab_hint": ("時間 = 2(n−1) × α + 2(n−1)/n × S / β、S はバイト数です。",
                   "time = 2(n−1) × alpha + 2(n−1)/n × S / beta, S in bytes."),
    "ex_ab_ok": ("{n} ランクで {ms:.2f} ms の予測です (2 ランクでは {ms2:.2f} ms)。",
                 "The model predicts {ms:.2f} ms on {n} ranks ({ms2:.2f} ms on 2)."),
})


def _judge(name: str, got: float | None, right: float, wrong: list[tuple],
           hint: str) -> set[str]:
    """Raise WrongAnswer unless `got` is `right`, naming the mistake it matches.

    `wrong` holds (key, value, part, fields): the value a mistake gives, the part of
    the model it gets wrong, and the message's fields beyond `name`. Returns the
    parts whose mistakes give the right value on this run too: not checked.
    """
    if got is None:
        raise WrongAnswer("ex_fill_in", name=name)
    if not math.isclose(float(got), right, rel_tol=1e-3):
        for key, value, _, fields in [("ex_units", right * 1e3, "", {}), *wrong]:
            if math.isclose(float(got), value, rel_tol=1e-3):
                raise WrongAnswer(key, name=name, **fields)
        raise WrongAnswer("ex_value_off", hint, name=name, got=float(got))
    # With alpha fitted as 0 (comm.fit_alpha_beta clamps it) or a part of the step
    # fitted as 0 (comm.fit_step_model), a formula without it gives the same number.
    return {part for _, value, part, _ in wrong
            if math.isclose(value, right, rel_tol=1e-3)}


def _unchecked(parts: set[str]) -> str:
    """The verdict's note naming the parts no answer could have been told by."""
    names = [t(f"ex_part_{p}") if p in ("alpha", "beta") else p for p in sorted(parts)]
    return t("ex_part_unchecked", parts=", ".join(names))


def grade_step_prediction(model: comm.StepModel, K: int, sync_s: float | None,
                          no_sync_s: float | None) -> None:
    """Seconds per update of K micro-batches: all synchronized, and with no_sync."""
    c, s, o = model.compute_s, model.sync_s, model.optimizer_s
    unchecked = _judge("sync_s", sync_s, K * c + K * s + o,
                       [("ex_sync_k", K * c + s + o, "s", {}),
                        ("ex_forgot_o", K * c + K * s, "o", {}),
                        ("ex_o_every", K * c + K * s + K * o, "o", {}),
                        ("ex_forgot_k", c + K * s + o, "c", {})], "ex_step_hint")
    unchecked |= _judge("no_sync_s", no_sync_s, K * c + s + o,
                        [("ex_nosync_once", K * c + K * s + o, "s", {}),
                         ("ex_nosync_zero", K * c + o, "s", {}),
                         ("ex_forgot_o", K * c + s, "o", {}),
                         ("ex_o_every", K * c + s + K * o, "o", {}),
                         ("ex_forgot_k", c + s + o, "c", {})], "ex_step_hint")
    right("ex_step_ok", K=K, sync=sync_s * 1e3, nosync=no_sync_s * 1e3)
    if unchecked:
        print(_unchecked(unchecked))


def grade_allreduce_prediction(ab: comm.AlphaBeta, params: int, world_size: int,
                               allreduce_s: float | None) -> None:
    """Seconds of one ring all-reduce of `params` float32 values, by the model."""
    n, nbytes, factor = world_size, 4 * params, comm.ring_factor(world_size)
    latency, send = comm.ring_steps(n) * ab.alpha, factor * nbytes / ab.beta
    wrong = [("ex_bytes", latency + factor * params / ab.beta, "beta", {}),
             *[("ex_ring", latency + f * nbytes / ab.beta, "beta", {})
               for f in (1, 2, (n - 1) / n, 2 * (n - 1))],  # not 2(n−1)/n
             ("ex_alpha_steps", ab.alpha + send, "alpha", {}),
             *[("ex_alpha_count", k * ab.alpha + send, "alpha", {"count": k})
               for k in (0, n - 1)]]
    if n != 2:  # the lesson's two ranks, 2 alpha + S / beta, for n ranks
        wrong.append(("ex_ab_ranks", ab.time(nbytes, 2), "", {"got": 2, "n": n}))
    unchecked = _judge("allreduce_s", allreduce_s, ab.time(nbytes, n), wrong,
                       "ex_ab_hint") - {""}
    right("ex_ab_ok", n=n, ms=ab.time(nbytes, n) * 1e3, ms2=ab.time(nbytes, 2) * 1e3)
    if unchecked:
        print(_unchecked(unchecked))
