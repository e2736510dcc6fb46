"""Lesson 14 (when compressing pays), the slow link: predict fp16's crossover bandwidth.

The grader runs in the kernel. It calls the learner's function with the steps
and bytes the lesson measured and with fixed cases: one with a large α, where
an α term that should have cancelled shows; one where the compressed method
sends other than half of DDP's bytes, where a formula that holds only for
S_fp16 = S_ddp / 2 shows; and two where fp16 is already as fast on loopback
(the answer is math.inf there).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..i18n import t
from .feedback import WrongAnswer, register, right

__all__ = ["grade_crossover_bandwidth"]

register({  # key: (ja, en)
    "ex_xover_case": (
        "t_ddp = {t_ddp:.2f} ms、t_fp16 = {t_fp16:.2f} ms、S_ddp = {S_ddp:,}、"
        "S_fp16 = {S_fp16:,}、calls = {calls}、alpha_s = {alpha_s:g}",
        "t_ddp = {t_ddp:.2f} ms, t_fp16 = {t_fp16:.2f} ms, S_ddp = {S_ddp:,}, "
        "S_fp16 = {S_fp16:,}, calls = {calls}, alpha_s = {alpha_s:g}"),
    "ex_xover_not_half": (
        "(ここでは S_fp16 が S_ddp の半分ではありません。送るバイト数が半分とは"
        "限らない圧縮でも、式は同じです)",
        "(here S_fp16 is not half of S_ddp: the formula holds for any compression, "
        "whatever share it sends)"),
    "ex_xover_wrong": (
        "{case}のとき、答えは{got}ですが、正しくは{want}バイト/秒です。"
        "ヒント: {hint}",
        "With {case}, your answer is {got}; the crossover is {want} bytes/s. "
        "Hint: {hint}"),
    "ex_xover_hint_whole": (
        "リンクが 2 つの方法に足す時間の差は (S_ddp − S_fp16) / β で、送るバイト数"
        "の差で決まります。S の全体ではなく、差を使います。",
        "what the link adds to the two methods differs by the difference of their "
        "bytes, (S_ddp − S_fp16) / β: the difference, not a whole S."),
    "ex_xover_hint_half": (
        "S_ddp − S_fp16 を S_ddp / 2 と置いています。fp16 は半分を送るので等しく"
        "なりますが、送るバイト数が半分でない圧縮では違います。差 S_ddp − S_fp16 "
        "をそのまま使います。",
        "you take S_ddp − S_fp16 as S_ddp / 2: equal for fp16, which sends half, but "
        "not for a compression that sends another share. Use the difference "
        "S_ddp − S_fp16 itself."),
    "ex_xover_hint_upside_down": (
        "比が逆さまです。帯域はバイト/秒なので、バイト数の差を時間の差で割ります。",
        "the ratio is upside down: a bandwidth is bytes per second, so divide the "
        "bytes' difference by the time's."),
    "ex_xover_hint_sign": (
        "答えが負になっています。β* は、fp16 がループバックで遅いぶん "
        "(t_fp16 − t_ddp > 0) を、送るバイト数が少ないぶん (S_ddp − S_fp16 > 0) で"
        "取り返せる帯域なので、正の値になります。",
        "the answer is negative: it is the bandwidth at which the bytes fp16 saves "
        "(S_ddp − S_fp16 > 0) make up for its longer loopback step "
        "(t_fp16 − t_ddp > 0)."),
    "ex_xover_hint_bits": (
        "ビット/秒ではなくバイト/秒で返します (8 倍になっています)。",
        "return bytes per second, not bits per second (yours is 8 times too large)."),
    "ex_xover_hint_mbps": (
        "MB/s ではなくバイト/秒で返します。",
        "return bytes per second, not MB/s."),
    "ex_xover_hint_alpha": (
        "fp16 の all-reduce の回数は DDP と同じなので、両辺の calls × α は"
        "打ち消し合います。α は答えに入りません。",
        "fp16 makes as many all-reduces as DDP: calls × α is on both sides and "
        "cancels. α has no place in the answer."),
    "ex_xover_hint_pays": (
        "fp16 がループバックですでに DDP と同じか速いとき (t_fp16 <= t_ddp)、"
        "リンクが fp16 に足す時間のほうが DDP より少ないので、どの帯域でも得に"
        "なります。そのときは `math.inf` を返します。",
        "where fp16 is already as fast as DDP or faster on loopback "
        "(t_fp16 <= t_ddp), the link adds less to fp16's step at every bandwidth: "
        "return `math.inf` there."),
    "ex_xover_hint_formula": (
        "t_ddp + calls × α + S_ddp / β = t_fp16 + calls × α + S_fp16 / β を β に"
        "ついて解きます。",
        "solve t_ddp + calls × α + S_ddp / β = t_fp16 + calls × α + S_fp16 / β "
        "for β."),
    "ex_xover_ok": (
        "どの場合も分かれ目が合っています。この実行の値では、fp16 はリンクが"
        "{measured}より遅いときに DDP より速くなる、という予測です。",
        "The crossover is right in every case. With this run's values, fp16 is "
        "predicted to beat DDP on links slower than {measured}."),
    "ex_xover_ok_every": (
        "どの場合も分かれ目が合っています。この実行の値では、fp16 はループバックで"
        "すでに DDP より速いので、どの帯域でも得になる、という予測です。",
        "The crossover is right in every case. With this run's values, fp16 is "
        "already faster than DDP on loopback, so it is predicted to pay at every "
        "bandwidth."),
})

# (t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s): lesson 06's large MLP with
# fp16 slower on loopback, the same with a large α (1 ms), a compression that
# sends 3 MB, not half (with half, S_ddp − S_fp16 = S_fp16 = S_ddp / 2, and
# formulas right for fp16 alone pass), and fp16 faster or even on loopback,
# where it pays at every bandwidth.
_FIXED = ((15e-3, 16e-3, 8_482_856, 4_241_428, 2, 100e-6),
          (20e-3, 26e-3, 8_482_856, 4_241_428, 2, 1e-3),
          (15e-3, 16e-3, 8_482_856, 3_000_000, 2, 100e-6),
          (16e-3, 15e-3, 8_482_856, 4_241_428, 2, 100e-6),
          (15e-3, 15e-3, 8_482_856, 4_241_428, 2, 100e-6))


def _crossover(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s) -> float:
    if t_fp16 <= t_ddp:
        return math.inf
    return (S_ddp - S_fp16) / (t_fp16 - t_ddp)


def _branched(rule: Callable) -> Callable:
    """`rule` where fp16 is slower on loopback, math.inf where it is not."""
    return lambda t_ddp, t_fp16, *rest: (
        math.inf if t_fp16 <= t_ddp else rule(t_ddp, t_fp16, *rest))


# The mistakes, as the value each gives for a case (where fp16 is slower on
# loopback: the other cases have their own check).
_MISTAKES: tuple[tuple[str, Callable], ...] = (
    ("ex_xover_hint_whole", lambda td, tf, Sd, Sf, c, a: Sd / (tf - td)),
    ("ex_xover_hint_whole", lambda td, tf, Sd, Sf, c, a: Sf / (tf - td)),
    ("ex_xover_hint_half", lambda td, tf, Sd, Sf, c, a: Sd / 2 / (tf - td)),
    ("ex_xover_hint_upside_down", lambda td, tf, Sd, Sf, c, a: (tf - td) / (Sd - Sf)),
    ("ex_xover_hint_sign", lambda td, tf, Sd, Sf, c, a: (Sd - Sf) / (td - tf)),
    ("ex_xover_hint_bits", lambda *case: 8 * _crossover(*case)),
    ("ex_xover_hint_mbps", lambda *case: _crossover(*case) / 1e6),
    ("ex_xover_hint_mbps", lambda *case: _crossover(*case) / 2**20),
    # α kept on one side (calls × α or α alone), or twice, with either sign
    *(("ex_xover_hint_alpha", lambda td, tf, Sd, Sf, c, a, k=k: (Sd - Sf) / (
        tf - td + k(c) * a)) for k in (lambda c: c, lambda c: -c, lambda c: 1,
                                       lambda c: -1, lambda c: 2 * c,
                                       lambda c: -2 * c)),
)


def _agrees(got: float, want: float) -> bool:
    return got == want or math.isclose(got, want, rel_tol=1e-6)


def _shown(value: float) -> str:
    if not math.isfinite(value):
        return repr(value)
    return f"{value:,.0f}" if abs(value) >= 1e3 else f"{value:.4g}"


def grade_crossover_bandwidth(fn: Callable, t_ddp: float, t_fp16: float, S_ddp: int,
                              S_fp16: int, calls: int, alpha_s: float) -> None:
    """`fn(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s)`: the bandwidth in bytes/s
    below which fp16's step is shorter than DDP's, for the lesson's measured case
    and the fixed ones."""
    cases = ((t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s), *_FIXED)
    for case in sorted(cases, key=lambda case: case[1] <= case[0]):  # fp16 slower first
        want = _crossover(*case)
        try:
            got = fn(*case)
        except ZeroDivisionError:
            if math.isfinite(want):
                raise
            got = math.nan  # t_fp16 == t_ddp divided by: the case where it pays
        if got is None:
            raise WrongAnswer("ex_fill_in", name="fp16_crossover(...)")
        got = float(got)
        if _agrees(got, want):
            continue
        if math.isfinite(want):
            hint = next((key for key, rule in _MISTAKES
                         if _agrees(got, _branched(rule)(*case))),
                        "ex_xover_hint_formula")
            if hint == "ex_xover_hint_formula" and got < 0:
                hint = "ex_xover_hint_sign"
        else:
            hint = "ex_xover_hint_pays"
        raise WrongAnswer("ex_xover_wrong", hint, got=_shown(got), want=_shown(want),
                          case=_case(*case))
    measured = _crossover(*cases[0])
    if math.isfinite(measured):
        right("ex_xover_ok", measured=f"{measured / 1e6:,.0f} MB/s")
    else:
        right("ex_xover_ok_every")


def _case(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s) -> str:
    note = " " + t("ex_xover_not_half") if 2 * S_fp16 != S_ddp else ""
    return t("ex_xover_case", t_ddp=t_ddp * 1e3, t_fp16=t_fp16 * 1e3, S_ddp=S_ddp,
             S_fp16=S_fp16, calls=calls, alpha_s=alpha_s) + note
