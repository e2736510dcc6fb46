"""Lesson 05 (communication): predictions of the step-time and alpha-beta models.

Messages below; how a grader answers: labkit.exercises.feedback.
"""

from __future__ import annotations

import math

from .. import comm
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
    "ex_ab_hint": ("時間 = 2(n−1) × α + 2(n−1)/n × S / β、S はバイト数です。",
                   "time = 2(n−1) × alpha + 2(n−1)/n × S / beta, S in bytes."),
    "ex_ab_ok": ("{n} ランクで {ms:.2f} ms の予測です (2 ランクでは {ms2:.2f} ms)。",
                 "The model predicts {ms:.2f} ms on {n} ranks ({ms2:.2f} ms on 2)."),
})


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


def grade_step_prediction(model: comm.StepModel, K: int, sync_s: float | None,
                          no_sync_s: float | None) -> None:
    """Seconds per update of K micro-batches: all synchronized, and with no_sync."""
    c, s, o = model.compute_s, model.sync_s, model.optimizer_s
    _judge("sync_s", sync_s, K * c + K * s + o,
           [("ex_sync_k", K * c + s + o), ("ex_forgot_o", K * c + K * s),
            ("ex_forgot_k", c + K * s + o)], "ex_step_hint")
    _judge("no_sync_s", no_sync_s, K * c + s + o,
           [("ex_nosync_once", K * c + K * s + o), ("ex_forgot_o", K * c + s),
            ("ex_forgot_k", c + s + o)], "ex_step_hint")
    right("ex_step_ok", K=K, sync=sync_s * 1e3, nosync=no_sync_s * 1e3)


def grade_allreduce_prediction(ab: comm.AlphaBeta, params: int, world_size: int,
                               allreduce_s: float | None) -> None:
    """Seconds of one ring all-reduce of `params` float32 values, by the model."""
    nbytes, factor = 4 * params, comm.ring_factor(world_size)
    latency = comm.ring_steps(world_size) * ab.alpha
    _judge("allreduce_s", allreduce_s, ab.time(nbytes, world_size),
           [("ex_bytes", latency + factor * params / ab.beta),
            ("ex_ring", latency + nbytes / ab.beta),
            ("ex_ring", latency + 2 * nbytes / ab.beta),
            ("ex_alpha_steps", ab.alpha + factor * nbytes / ab.beta)], "ex_ab_hint")
    right("ex_ab_ok", n=world_size, ms=ab.time(nbytes, world_size) * 1e3,
           ms2=ab.time(nbytes, 2) * 1e3)
