"""Lesson 15 (communicate less often): estimate the noise scale from two batch sizes.

The grader runs in the kernel. Its cases are exact: the squared norms are
those E|G_B|² = |G|² + tr(Σ) / B gives for a chosen tr(Σ) and |G|², so the
right answer is tr(Σ) / |G|² to rounding. The lesson's own numbers are one
case. The wrong answers serve only to name the mistake in a hint.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .. import noise_scale
from ..i18n import t
from .feedback import WrongAnswer, register, right

__all__ = ["grade_noise_scale"]

register({  # key: (ja, en)
    "ex_ns_call": ("{fn}(b={b}, world_size={n}, g2_small={small:.4g}, "
                   "g2_big={big:.4g})",
                   "{fn}(b={b}, world_size={n}, g2_small={small:.4g}, "
                   "g2_big={big:.4g})"),
    "ex_ns_wrong": ("{call} = {got} ですが、正しくは {want} です。ヒント: {hint}",
                    "{call} = {got}, but it is {want}. Hint: {hint}"),
    "ex_ns_hint_swapped": (
        "2 つのバッチサイズが入れ替わっています。g2_small は b サンプル (1 つのランク) "
        "の勾配、g2_big は N·b サンプル (平均したあと) の勾配のものです。",
        "the two batch sizes are swapped: g2_small belongs to b samples (one rank's "
        "gradient), g2_big to N·b samples (the average)."),
    "ex_ns_hint_big_alone": (
        "|G|² を g2_big だけで見積もると、大きいほうにも残るノイズ tr(Σ)/B_big の分"
        "だけ大きくなります (偏りがあります)。2 つのバッチサイズの式で見積もります。",
        "g2_big alone overestimates |G|² by the noise the big batch still has, "
        "tr(Σ)/B_big (it is biased); use both batch sizes' formula."),
    "ex_ns_hint_no_inverse": (
        "tr(Σ) は、g2_small − g2_big を (1/B_small − 1/B_big) で割って求めます。"
        "差はノイズの項 tr(Σ)/B の差なので、1/B の差で割ります。",
        "tr(Σ) is g2_small − g2_big divided by (1/B_small − 1/B_big): the difference "
        "is that of the noise terms tr(Σ)/B, so divide by the difference of the 1/B."),
    "ex_ns_hint_inverted": (
        "比が逆です。B_simple = tr(Σ) / |G|² (ノイズ ÷ 信号) です。",
        "the ratio is upside down: B_simple = tr(Σ) / |G|² (noise over signal)."),
    "ex_ns_hint_per_rank": (
        "大きいほうのバッチは、全ランクの平均なので N·b サンプルです "
        "(b ではありません)。",
        "the big batch is the average over all the ranks: N·b samples, not b."),
    "ex_ns_hint_two_ranks": (
        "world_size = 2 のときだけ合っています。B_big = world_size × b です。",
        "right for world_size = 2 only: B_big = world_size × b."),
    "ex_ns_hint_formula": (
        "B_small = b、B_big = N·b として、|G|² = (B_big·g2_big − B_small·g2_small) / "
        "(B_big − B_small)、tr(Σ) = (g2_small − g2_big) / (1/B_small − 1/B_big)、"
        "B_simple = tr(Σ) / |G|² です。",
        "with B_small = b and B_big = N·b: |G|² = (B_big·g2_big − B_small·g2_small) / "
        "(B_big − B_small), tr(Σ) = (g2_small − g2_big) / (1/B_small − 1/B_big), "
        "B_simple = tr(Σ) / |G|²."),
    "ex_ns_ok": (
        "どの場合も B_simple = tr(Σ) / |G|² と一致しました。このレッスンで測った値"
        "では B_simple = {value:.1f} です。",
        "Every case agrees with B_simple = tr(Σ) / |G|². With the values this lesson "
        "measured, B_simple = {value:.1f}."),
})

# (b, world_size, tr(Σ), |G|²): the squared norms follow from them exactly.
_CASES = ((8, 4, 120.0, 6.0), (32, 8, 5000.0, 2.5), (1, 16, 9.0, 3.0))


def _norms(b: int, n: int, trace: float, norm_sq: float) -> tuple[float, float]:
    return norm_sq + trace / b, norm_sq + trace / (n * b)


def _right(b, n, small, big):
    return noise_scale.simple_noise_scale(b, n * b, small, big)


# The mistakes, as the answer each gives for (b, N, g2_small, g2_big); None
# where it has no answer (a division by zero).
def _safe(rule: Callable) -> Callable:
    def value(*args):
        try:
            return rule(*args)
        except ZeroDivisionError:
            return None
    return value


_MISTAKES: tuple[tuple[str, Callable], ...] = (
    ("ex_ns_hint_swapped",
     lambda b, n, s, g: noise_scale.simple_noise_scale(n * b, b, s, g)),
    ("ex_ns_hint_big_alone",
     lambda b, n, s, g: noise_scale.estimated_trace(b, n * b, s, g) / g),
    ("ex_ns_hint_no_inverse",
     lambda b, n, s, g: (s - g) / noise_scale.estimated_norm_sq(b, n * b, s, g)),
    ("ex_ns_hint_no_inverse",
     lambda b, n, s, g: (s - g) / (n * b - b)
     / noise_scale.estimated_norm_sq(b, n * b, s, g)),
    ("ex_ns_hint_inverted", lambda b, n, s, g: 1 / _right(b, n, s, g)),
    ("ex_ns_hint_two_ranks", lambda b, n, s, g: _right(b, 2, s, g)),
)


def _call(b: int, n: int, small: float, big: float) -> str:
    return t("ex_ns_call", fn="noise_scale_estimate", b=b, n=n, small=small, big=big)


def _agrees(got: float | None, want: float | None) -> bool:
    return got is not None and want is not None and math.isfinite(got) \
        and math.isclose(got, want, rel_tol=1e-6)


def grade_noise_scale(fn: Callable, lesson: tuple[int, int, float, float]) -> None:
    """`fn(b, world_size, g2_small, g2_big)` -> B_simple, on exact cases and on
    `lesson`, the lesson's (b, world_size, g2_small, g2_big)."""
    cases = [(b, n, *_norms(b, n, tr, g2)) for b, n, tr, g2 in _CASES]
    cases.append(lesson)
    answers = []
    for b, n, small, big in cases:
        call = _call(b, n, small, big)
        try:
            got = fn(b, n, small, big)
        except ZeroDivisionError:
            raise WrongAnswer("ex_ns_wrong", "ex_ns_hint_per_rank",
                              call=call, got="ZeroDivisionError",
                              want=f"{_right(b, n, small, big):.4g}") from None
        if got is None:
            raise WrongAnswer("ex_fill_in", name=call)
        answers.append(float(got))
    for (b, n, small, big), got in zip(cases, answers, strict=True):
        want = _right(b, n, small, big)
        if _agrees(got, want):
            continue
        if not math.isfinite(got):
            hint = "ex_ns_hint_per_rank"
        else:
            hint = next((key for key, rule in _MISTAKES
                         if all(_agrees(a, _safe(rule)(*c))
                                for a, c in zip(answers, cases, strict=True))),
                        "ex_ns_hint_formula")
        raise WrongAnswer("ex_ns_wrong", hint, call=_call(b, n, small, big),
                          got=f"{got:.4g}", want=f"{want:.4g}")
    right("ex_ns_ok", value=answers[-1])
