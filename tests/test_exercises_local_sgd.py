"""Lesson 15's DiLoCo exercise: the check passes the lesson's solution and names each
typical mistake, in both languages. Each mistake is the solution cell, read from the
built notebook, with one edit; it runs on the ranks, where the %%px cell would."""

from pathlib import Path

import nbformat
import pytest

import labkit
from labkit import exercises

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "en" / "15_communicate_less.ipynb"


def _cell(text: str, tag: str) -> str:
    found = [c.source for c in nbformat.read(LESSON, as_version=4).cells
             if c.cell_type == "code" and text in c.source
             and tag in c.metadata.get("tags", [])]
    assert len(found) == 1, (text, tag, len(found))
    return found[0].removeprefix("%%px\n") + "\n"


SOLUTION = _cell("def diloco_outer_step(", "solution")
PREAMBLE = ("import torch\nimport torch.distributed as dist\n"
            "rank, world_size = dist.get_rank(), dist.get_world_size()\n")


def _define(ranks, source: str) -> None:
    ranks.execute(PREAMBLE + source)


def _with(old: str, new: str) -> str:
    assert SOLUTION.count(old) == 1, old
    return SOLUTION.replace(old, new)


# mistake: (the edit of the solution, the key, what the English hint says)
MISTAKES = {
    "sign flipped": (("delta = g - p", "delta = p - g"), "ex_dl_sign",
                     "the pseudo-gradient's sign is flipped"),
    "averaging forgotten": (("            dist.all_reduce(delta)\n"
                             "            delta /= world_size  # the ranks' mean\n",
                             ""), "ex_dl_no_average", "the average over the ranks"),
    "summed, not averaged": (("            delta /= world_size  # the ranks' mean\n",
                              ""), "ex_dl_sum", "the ranks' sum, not their mean"),
    "momentum rebound, never accumulates": (
        ("m.mul_(mu).add_(delta)", "m = mu * m + delta"), "ex_dl_no_accumulation",
        "never accumulates"),
    "a fresh buffer every round": (
        ("m.mul_(mu).add_(delta)", "m = torch.zeros_like(m).add_(delta)"),
        "ex_dl_no_accumulation", "make a new optimizer every round"),
    "momentum on the local parameters": (
        ("g.sub_(outer_lr * (delta + mu * m))  # Nesterov's step\n"
         "            p.copy_(g)",
         "p.sub_(outer_lr * (delta + mu * m))"), "ex_dl_local",
        "the outer update went to θ_local"),
    "Nesterov off": (("g.sub_(outer_lr * (delta + mu * m))", "g.sub_(outer_lr * m)"),
                     "ex_dl_old_momentum", "For round 2 on rank 0, θ_global moved by "
                     "lr × (Δ + μ × m) with m the momentum from before"),
    "the momentum not in the step": (
        ("g.sub_(outer_lr * (delta + mu * m))", "g.sub_(outer_lr * delta)"),
        "ex_dl_no_momentum", "For round 2 on rank 0, θ_global moved by lr × Δ alone"),
    "not restarted": (("            p.copy_(g)  # every rank restarts from θ_global\n",
                       ""), "ex_dl_no_restart", "restarts from θ_global"),
    "nothing done": (("            delta = g - p", "            continue\n"
                      "            delta = g - p"), "ex_fill_in", "is still None"),
}


def test_the_solution_passes_in_both_languages(ranks, capsys):
    _define(ranks, SOLUTION)
    exercises.grade_diloco_outer_step(ranks)
    assert "In all 3 rounds θ_global and the momentum equal" in capsys.readouterr().out
    labkit.set_lang("ja")
    exercises.grade_diloco_outer_step(ranks)
    assert "3 ラウンドのどれでも" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_is_named(ranks, mistake):
    (old, new), key, en = MISTAKES[mistake]
    _define(ranks, _with(old, new))
    with pytest.raises(exercises.WrongAnswer) as wrong:
        exercises.grade_diloco_outer_step(ranks)
    assert wrong.value.key == key and en in str(wrong.value)


@pytest.mark.parametrize("mistake", ["sign flipped", "Nesterov off", "not restarted"])
def test_the_hints_speak_japanese(ranks, mistake):
    (old, new), key, _ = MISTAKES[mistake]
    _define(ranks, _with(old, new))
    labkit.set_lang("ja")
    with pytest.raises(exercises.WrongAnswer, match="ヒント") as wrong:
        exercises.grade_diloco_outer_step(ranks)
    assert wrong.value.key == key


def test_the_exercise_as_given_is_not_right_yet(ranks):
    _define(ranks, _cell("def diloco_outer_step(", "exercise"))
    with pytest.raises(exercises.WrongAnswer, match="still None"):
        exercises.grade_diloco_outer_step(ranks)


def _grade_answer(ranks, answer):
    ranks.execute(f"from exercise_answers import {answer}")
    exercises.grade_diloco_outer_step(ranks, answer)


@pytest.mark.parametrize("answer", ["diloco_outer_step", "diloco_outer_step_torch_sgd"])
def test_a_written_step_and_torch_s_nesterov_sgd_pass(ranks, capsys, answer):
    _grade_answer(ranks, answer)
    assert "In all 3 rounds θ_global and the momentum equal" in capsys.readouterr().out


# In round 1 the momentum is still 0, where these steps all move θ_global by lr × Δ:
# round 2 tells which it is. (answer, key, the round named, English, Japanese)
MOMENTUM_MISTAKES = [
    ("momentum_before_update", "ex_dl_old_momentum", 2,
     "Nesterov's step taken before m is updated",
     "このラウンドで更新する前のモーメンタム"),
    ("heavy_ball", "ex_dl_old_momentum", 2, "plain (heavy-ball) momentum",
     "ふつうの (heavy-ball) モーメンタム"),
    ("momentum_unused", "ex_dl_no_momentum", 2, "the step has no momentum in it",
     "更新にモーメンタムが入っていません"),
    ("no_momentum", "ex_dl_no_momentum", 1, "the step has no momentum in it",
     "更新にモーメンタムが入っていません"),
]


@pytest.mark.parametrize(("answer", "key", "round_", "en", "ja"), MOMENTUM_MISTAKES)
def test_each_momentum_mistake_is_named_in_the_round_that_tells(ranks, answer, key,
                                                                round_, en, ja):
    with pytest.raises(exercises.WrongAnswer) as wrong:
        _grade_answer(ranks, f"diloco_outer_step_{answer}")
    assert wrong.value.key == key and en in str(wrong.value)
    assert f"For round {round_} on rank 0," in str(wrong.value)
    labkit.set_lang("ja")
    with pytest.raises(exercises.WrongAnswer) as wrong:
        _grade_answer(ranks, f"diloco_outer_step_{answer}")
    assert wrong.value.key == key and ja in str(wrong.value)
    assert f"{round_} ラウンド目、ランク 0 で、" in str(wrong.value)
