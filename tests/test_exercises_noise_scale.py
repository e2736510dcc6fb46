"""Lesson 15's exercise 2: the noise scale from two batch sizes.

The check passes the reference answer (the lesson's solution cell, read from
the built notebook, and a torch version) and names each typical mistake with
its own hint, in both languages.
"""

from pathlib import Path

import exercise_answers as answers
import nbformat
import pytest
import torch

import labkit
from labkit import exercises

LESSON = Path(__file__).resolve().parent.parent / "notebooks" / "en" / \
    "15_communicate_less.ipynb"
NUMBERS = (8, 2, 25.289, 16.629)  # the lesson's, as its check cell passes them


def _lesson_cell(tag: str) -> str:
    cells = [c.source for c in nbformat.read(LESSON, as_version=4).cells
             if c.cell_type == "code" and tag in c.metadata.get("tags", [])
             and "def noise_scale_estimate" in c.source]
    assert len(cells) == 1
    return cells[0]


def _answer(tag: str):
    namespace = {}
    exec(_lesson_cell(tag), namespace)
    return namespace["noise_scale_estimate"]


right = answers.noise_scale_estimate


def with_torch(b, n, small, big):
    small, big = torch.tensor(small, dtype=torch.float64), torch.tensor(big)
    norm_sq = (n * b * big - b * small) / (n * b - b)
    return ((small - big) / (1 / b - 1 / (n * b)) / norm_sq).item()


def wrong(key):
    return pytest.raises(exercises.WrongAnswer, check=lambda e: e.key == key)


@pytest.mark.parametrize("answer", [right, with_torch], ids=["floats", "torch"])
def test_the_reference_passes_in_both_languages(answer, capsys):
    exercises.grade_noise_scale(answer, NUMBERS)
    assert "B_simple = 17.4" in capsys.readouterr().out
    labkit.set_lang("ja")
    exercises.grade_noise_scale(answer, NUMBERS)
    assert "正解です" in capsys.readouterr().out


def test_the_lessons_solution_passes_and_its_exercise_is_not_yet_filled_in(capsys):
    exercises.grade_noise_scale(_answer("solution"), NUMBERS)
    assert "Correct" in capsys.readouterr().out
    with wrong("ex_fill_in") as caught:
        exercises.grade_noise_scale(_answer("exercise"), NUMBERS)
    assert "noise_scale_estimate(b=8, world_size=4" in str(caught.value)


# answer, diagnosis, what the English and the Japanese message say
MISTAKES = [
    (answers.noise_scale_estimate_swapped, "ex_ns_hint_swapped",
     "the two batch sizes are swapped", "2 つのバッチサイズが入れ替わっています"),
    (answers.noise_scale_estimate_big_alone, "ex_ns_hint_big_alone",
     "g2_big alone overestimates |G|²", "g2_big だけで見積もると"),
    (answers.noise_scale_estimate_no_inverse, "ex_ns_hint_no_inverse",
     "divide by the difference of the 1/B", "1/B の差で割ります"),
    (answers.noise_scale_estimate_inverted, "ex_ns_hint_inverted",
     "the ratio is upside down", "比が逆です"),
    (answers.noise_scale_estimate_per_rank, "ex_ns_hint_per_rank",
     "N·b samples, not b", "N·b サンプルです"),
    (answers.noise_scale_estimate_per_rank_torch, "ex_ns_hint_per_rank",
     "N·b samples, not b", "N·b サンプルです"),
    (answers.noise_scale_estimate_two_ranks, "ex_ns_hint_two_ranks",
     "right for world_size = 2 only", "world_size = 2 のときだけ"),
    (answers.noise_scale_estimate_todo, "ex_fill_in", "is still None",
     "がまだ None です"),
    *((getattr(answers, f"noise_scale_estimate_{name}"), "ex_ns_hint_formula",
       "with B_small = b and B_big = N·b", "B_small = b、B_big = N·b として")
      for name in ("b_plus_n", "trace_only", "off")),
]


@pytest.mark.parametrize(("answer", "key", "en", "ja"), MISTAKES,
                         ids=[m[0].__name__.removeprefix("noise_scale_estimate_")
                              for m in MISTAKES])
def test_each_mistake_gets_its_own_hint_in_both_languages(answer, key, en, ja):
    with wrong(key) as caught:
        exercises.grade_noise_scale(answer, NUMBERS)
    assert en in str(caught.value)
    labkit.set_lang("ja")
    with wrong(key) as caught:
        exercises.grade_noise_scale(answer, NUMBERS)
    assert ja in str(caught.value)
