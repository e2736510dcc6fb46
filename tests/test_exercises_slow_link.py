"""Lesson 14's crossover exercise: the check passes the reference, names each mistake.

The grader runs in the kernel, on plain numbers: no process is started. The
answers are in exercise_answers.py, the reference first, then each typical
mistake; every hint is checked in both languages.
"""

import exercise_answers as answers
import pytest

import labkit
from labkit import exercises

# A run's values as the lesson measures them: fp16 slower on loopback.
MEASURED = (13.4e-3, 14.9e-3, 8_482_856, 4_241_428, 2, 100e-6)
# fp16 already faster on loopback: it pays at every bandwidth.
FP16_FASTER = (15.0e-3, 14.2e-3, 8_482_856, 4_241_428, 2, 100e-6)


reference = answers.fp16_crossover

# answer, the key, what the English and the Japanese hint say
MISTAKES = {
    "whole_S": (answers.fp16_crossover_ddp_bytes, "ex_xover_hint_whole",
                "the difference, not a whole S", "S の全体ではなく、差を使います"),
    # Right wherever S_fp16 = S_ddp / 2, as in the lesson's measured case: the
    # case of a compression that sends 3 MB tells them.
    "fp16_bytes": (answers.fp16_crossover_fp16_bytes, "ex_xover_hint_whole",
                   "the difference, not a whole S", "S の全体ではなく、差を使います"),
    "half": (answers.fp16_crossover_half, "ex_xover_hint_half",
             "you take S_ddp − S_fp16 as S_ddp / 2",
             "S_ddp − S_fp16 を S_ddp / 2 と置いています"),
    "upside_down": (answers.fp16_crossover_upside_down, "ex_xover_hint_upside_down",
                    "the ratio is upside down", "比が逆さまです"),
    "bits": (answers.fp16_crossover_bits, "ex_xover_hint_bits",
             "not bits per second", "ビット/秒ではなく"),
    "megabytes": (answers.fp16_crossover_megabytes, "ex_xover_hint_mbps",
                  "not MB/s", "MB/s ではなく"),
    "alpha_kept": (answers.fp16_crossover_alpha_kept, "ex_xover_hint_alpha",
                   "calls × α is on both sides and cancels", "打ち消し合います"),
    "alpha_kept_other_side": (answers.fp16_crossover_alpha_other_side,
                              "ex_xover_hint_alpha", "α has no place",
                              "α は答えに入りません"),
    "no_branch": (answers.fp16_crossover_no_branch, "ex_xover_hint_pays",
                  "return `math.inf` there", "`math.inf` を返します"),
    "sign": (answers.fp16_crossover_sign, "ex_xover_hint_sign",
             "the answer is negative", "答えが負になっています"),
    "guess": (answers.fp16_crossover_guess, "ex_xover_hint_formula",
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
        exercises.grade_crossover_bandwidth(answers.fp16_crossover_todo, *MEASURED)
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


@pytest.mark.parametrize("name", ["fp16_bytes", "half"])
def test_a_formula_right_for_half_the_bytes_only_is_named_where_it_is_not_half(name):
    answer, key, _, japanese = MISTAKES[name]
    assert answer(*MEASURED) == reference(*MEASURED)  # right on the lesson's case
    with wrong(key) as caught:
        exercises.grade_crossover_bandwidth(answer, *MEASURED)
    assert "S_fp16 = 3,000,000, calls = 2, alpha_s = 0.0001 (here S_fp16 is not " \
           "half of S_ddp: the formula holds for any compression" in str(caught.value)
    labkit.set_lang("ja")
    with wrong(key) as caught:
        exercises.grade_crossover_bandwidth(answer, *MEASURED)
    assert "(ここでは S_fp16 が S_ddp の半分ではありません。" in str(caught.value)
    assert japanese in str(caught.value)
