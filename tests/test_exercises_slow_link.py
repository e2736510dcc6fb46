"""Lesson 12's crossover exercise: the check passes the reference, names each mistake.

The grader runs in the kernel, on plain numbers: no process is started. The
answers are written here, the reference first, then each typical mistake; every
hint is checked in both languages.
"""

import math

import pytest

import labkit
from labkit import exercises

# A run's values as the lesson measures them: fp16 slower on loopback.
MEASURED = (13.4e-3, 14.9e-3, 8_482_856, 4_241_428, 2, 100e-6)
# fp16 already faster on loopback: it pays at every bandwidth.
FP16_FASTER = (15.0e-3, 14.2e-3, 8_482_856, 4_241_428, 2, 100e-6)


def reference(t_ddp, t_fp16, S_ddp, S_fp16, calls, alpha_s):
    if t_fp16 <= t_ddp:
        return math.inf
    return (S_ddp - S_fp16) / (t_fp16 - t_ddp)


def branched(rule):
    """A mistake in the formula, with the right branch where fp16 already pays."""
    def answer(t_ddp, t_fp16, *rest):
        return math.inf if t_fp16 <= t_ddp else rule(t_ddp, t_fp16, *rest)
    return answer


MISTAKES = {
    "whole_S": (branched(lambda td, tf, Sd, Sf, c, a: Sd / (tf - td)),
                "ex_xover_hint_whole", "the difference, not a whole S",
                "S の全体ではなく、差を使います"),
    "upside_down": (branched(lambda td, tf, Sd, Sf, c, a: (tf - td) / (Sd - Sf)),
                    "ex_xover_hint_upside_down", "the ratio is upside down",
                    "比が逆さまです"),
    "bits": (branched(lambda *case: 8 * reference(*case)), "ex_xover_hint_bits",
             "not bits per second", "ビット/秒ではなく"),
    "megabytes": (branched(lambda *case: reference(*case) / 1e6),
                  "ex_xover_hint_mbps", "not MB/s", "MB/s ではなく"),
    "alpha_kept": (branched(lambda td, tf, Sd, Sf, c, a: (Sd - Sf) / (tf - td + c * a)),
                   "ex_xover_hint_alpha", "calls × α is on both sides and cancels",
                   "打ち消し合います"),
    "alpha_kept_other_side": (
        branched(lambda td, tf, Sd, Sf, c, a: (Sd - Sf) / (tf - td - c * a)),
        "ex_xover_hint_alpha", "α has no place", "α は答えに入りません"),
    "no_branch": (lambda td, tf, Sd, Sf, c, a: (Sd - Sf) / (tf - td),
                  "ex_xover_hint_pays", "return `math.inf` there",
                  "`math.inf` を返します"),
    "sign": (branched(lambda td, tf, Sd, Sf, c, a: (Sd - Sf) / (td - tf)),
             "ex_xover_hint_sign", "the answer is negative", "答えが負です"),
    "guess": (branched(lambda *case: 1e9), "ex_xover_hint_formula",
              "solve t_ddp + calls × α + S_ddp / β", "β について解きます"),
}


def wrong(key):
    """Expect a WrongAnswer whose diagnosis is `key`."""
    return pytest.raises(exercises.WrongAnswer, check=lambda e: e.key == key)


@pytest.fixture(autouse=True)
def _english():
    labkit.set_lang("en")
    yield
    labkit.set_lang("en")


@pytest.mark.parametrize("case", [MEASURED, FP16_FASTER])
def test_reference_passes_in_both_languages(capsys, case):
    exercises.grade_crossover_bandwidth(reference, *case)
    out = capsys.readouterr().out
    assert "The crossover is right in every case" in out
    if case is MEASURED:  # 4,241,428 B / 1.5 ms
        assert "slower than 2,828 MB/s" in out
    else:
        assert "at every bandwidth" in out
    labkit.set_lang("ja")
    exercises.grade_crossover_bandwidth(reference, *case)
    assert "どの場合も分かれ目が合っています" in capsys.readouterr().out


@pytest.mark.parametrize("name", MISTAKES)
def test_each_mistake_gets_its_hint(name):
    answer, key, english, japanese = MISTAKES[name]
    for case in (MEASURED, FP16_FASTER):
        with wrong(key) as caught:
            exercises.grade_crossover_bandwidth(answer, *case)
        assert english in str(caught.value)
    labkit.set_lang("ja")
    with wrong(key) as caught:
        exercises.grade_crossover_bandwidth(answer, *MEASURED)
    assert japanese in str(caught.value)


def test_none_asks_for_an_answer():
    with wrong("ex_fill_in") as caught:
        exercises.grade_crossover_bandwidth(lambda *case: None, *MEASURED)
    assert "fp16_crossover(...) is still None" in str(caught.value)


def test_dividing_by_zero_where_fp16_pays_gets_the_hint():
    # no branch, and t_fp16 == t_ddp in a fixed case: ZeroDivisionError there
    def no_branch(td, tf, Sd, Sf, c, a):
        return (Sd - Sf) / (tf - td) if tf > td else (Sd - Sf) / 0
    with wrong("ex_xover_hint_pays"):
        exercises.grade_crossover_bandwidth(no_branch, *MEASURED)


def test_a_wrong_answer_shows_the_case_and_both_values():
    with wrong("ex_xover_hint_bits") as caught:
        exercises.grade_crossover_bandwidth(MISTAKES["bits"][0], *MEASURED)
    text = str(caught.value)
    assert "t_ddp = 13.40 ms, t_fp16 = 14.90 ms, S_ddp = 8,482,856" in text
    assert "your answer is 22,620,949,333; the crossover is 2,827,618,667" in text
