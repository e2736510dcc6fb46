"""Lesson 12's exercise 3: the noise scale from two batch sizes.

The check passes the reference answer (the lesson's solution cell, read from
the built notebook, and a torch version) and names each typical mistake with
its own hint, in both languages.
"""

from pathlib import Path

import nbformat
import pytest
import torch

import labkit
from labkit import exercises

LESSON = Path(__file__).resolve().parent.parent / "notebooks" / "en" / \
    "12_communicate_less.ipynb"
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


def right(b, n, small, big):
    b_small, b_big = b, n * b
    norm_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    return trace / norm_sq


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


def swapped(b, n, small, big):  # the sizes of the two norms exchanged
    b_small, b_big = n * b, b
    norm_sq = (b_big * big - b_small * small) / (b_big - b_small)
    return (small - big) / (1 / b_small - 1 / b_big) / norm_sq


def big_alone(b, n, small, big):  # |G|² taken as the big batch's norm: biased
    return (small - big) / (1 / b - 1 / (n * b)) / big


def no_inverse(b, n, small, big):  # tr(Σ) without the 1/B terms
    return (small - big) / ((n * b * big - b * small) / (n * b - b))


def inverted(b, n, small, big):
    return 1 / right(b, n, small, big)


def per_rank(b, n, small, big):  # b for B_big, not N·b
    return right(b, 1, small, big)


def per_rank_torch(b, n, small, big):  # the same in torch: inf or nan, no error
    small, big = torch.tensor(small), torch.tensor(big)
    return ((small - big) / (1 / b - 1 / b) / ((b * big - b * small) / (b - b))).item()


def two_ranks(b, n, small, big):  # world_size written as 2
    return right(b, 2, small, big)


def todo(b, n, small, big):
    return None


def off(b, n, small, big):
    return 1.1 * right(b, n, small, big)


# answer, diagnosis, what the English and the Japanese message say
MISTAKES = [
    (swapped, "ex_ns_hint_swapped", "the two batch sizes are swapped",
     "2 つのバッチサイズが入れ替わっています"),
    (big_alone, "ex_ns_hint_big_alone", "g2_big alone overestimates |G|²",
     "g2_big だけで見積もると"),
    (no_inverse, "ex_ns_hint_no_inverse", "divide by the difference of the 1/B",
     "1/B の差で割ります"),
    (inverted, "ex_ns_hint_inverted", "the ratio is upside down", "比が逆です"),
    (per_rank, "ex_ns_hint_per_rank", "N·b samples, not b", "N·b サンプルです"),
    (per_rank_torch, "ex_ns_hint_per_rank", "N·b samples, not b", "N·b サンプルです"),
    (two_ranks, "ex_ns_hint_two_ranks", "right for world_size = 2 only",
     "world_size = 2 のときだけ"),
    (todo, "ex_fill_in", "is still None", "がまだ None です"),
    (off, "ex_ns_hint_formula", "with B_small = b and B_big = N·b",
     "B_small = b、B_big = N·b として"),
]


@pytest.mark.parametrize(("answer", "key", "en", "ja"), MISTAKES,
                         ids=[m[0].__name__ for m in MISTAKES])
def test_each_mistake_gets_its_own_hint_in_both_languages(answer, key, en, ja):
    with wrong(key) as caught:
        exercises.grade_noise_scale(answer, NUMBERS)
    assert en in str(caught.value)
    labkit.set_lang("ja")
    with wrong(key) as caught:
        exercises.grade_noise_scale(answer, NUMBERS)
    assert ja in str(caught.value)
