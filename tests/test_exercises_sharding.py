"""The sharding exercises (lessons 12, 13): checks pass the reference, name mistakes.

Stage 2's reduce-scatter runs on two ranks: each answer is imported into the
ranks' namespace, where the lesson's %%px cell would define it. ZeRO-3's two
methods are mixed there into the lesson's own Zero3Base. Every hint is checked
in both languages.
"""

from pathlib import Path

import exercise_answers as answers
import nbformat
import pytest
from lesson_cells import finder

import labkit
from labkit import cluster, exercises


def wrong(key):
    """Expect a WrongAnswer whose diagnosis is `key`."""
    return pytest.raises(exercises.WrongAnswer, check=lambda e: e.key == key)


def _grade_on_ranks(ranks, answer):
    ranks.execute(f"from exercise_answers import {answer}")
    exercises.grade_gradient_shard(ranks, answer)


# Stage 2's gradient reduce-scatter


@pytest.mark.parametrize("answer", ["shard_of_mean_gradient",
                                    "shard_of_mean_gradient_avg",
                                    "shard_of_mean_gradient_async",
                                    "shard_of_mean_gradient_async_avg"])
def test_gradient_shard_passes_sum_then_divide_and_avg(ranks, capsys, answer):
    _grade_on_ranks(ranks, answer)
    assert "every rank got its shard of the mean, through one reduce-scatter" in \
        capsys.readouterr().out
    labkit.set_lang("ja")
    _grade_on_ranks(ranks, answer)
    assert "reduce-scatter 1 回だけです" in capsys.readouterr().out


# answer, diagnosis, what the English and the Japanese message say
GRADIENT_SHARD_MISTAKES = [
    ("all_reduce", "ex_rs_all_reduce",
     "you use 1 all-reduce(s): afterwards every rank receives and holds the whole "
     "averaged gradient (4,000 bytes)", "all-reduce を 1 回使っています"),
    ("whole", "ex_rs_whole_mean", "you return the whole averaged gradient (1000 "
     "values)", "平均した勾配の全体 (1000 要素) を返しています"),
    ("in_place", "ex_rs_nothing_returned", "you return nothing (None), though "
     "`flat_grad` was changed", "何も返していません (None)"),
    ("next_shard", "ex_rs_other_shard", "Rank 0 returns rank 1's shard (values 500 "
     "to 999 of the mean)", "ランク 0 が、ランク 1 のシャード (平均の 500〜999 番目"),
    ("one_off", "ex_rs_shifted", "Rank 0's shard is +1 value(s) off: values 1 to 500 "
     "of the mean, not 0 to 499", "ランク 0 のシャードが +1 要素ずれています"),
    ("sum", "ex_rs_sum", "the shard is exactly 2 times the mean: the ranks' sum",
     "平均のちょうど 2 倍"),
    ("by_numel", "ex_rs_divisor", "the ranks' sum divided by 1000",
     "ランクの和を 1000 で割った値"),
    ("own_slice", "ex_rs_local", "the shard holds this rank's own gradient only",
     "このランクの勾配しか入っていません"),
    ("view", "ex_rs_view", "a view of a buffer of 4,000 bytes: for a shard of "
     "2,000 bytes", "4,000 バイトのバッファの一部 (ビュー)"),
    ("list", "ex_rs_unseen", "no call of `dist.reduce_scatter_single` was seen "
     "(collectives recorded: -)",
     "`dist.reduce_scatter_single` の呼び出しが記録されませんでした"),
    ("halves", "ex_rs_many", "you make 2 reduce-scatters for one gradient",
     "reduce-scatter を 2 回使っています"),
    ("gathered", "ex_rs_extra", "you call other collectives (all_gather)",
     "ほかにも集団通信をしています (all_gather)"),
    ("as_list", "ex_rs_not_tensor", "you return a list", "返したのは list です"),
    ("todo", "ex_fill_in", "shard_of_mean_gradient_todo(...) is still None",
     "shard_of_mean_gradient_todo(...) がまだ None です"),
    ("async_not_waited", "ex_rs_not_waited", "you return the shard without waiting "
     "for the asynchronous reduce-scatter", "非同期の reduce-scatter (`async_op=True`) "
     "を待たずに"),
]


@pytest.mark.parametrize(("mistake", "key", "en", "ja"), GRADIENT_SHARD_MISTAKES)
def test_gradient_shard_names_each_mistake(ranks, mistake, key, en, ja):
    answer = f"shard_of_mean_gradient_{mistake}"
    with wrong(key) as caught:
        _grade_on_ranks(ranks, answer)
    assert en in str(caught.value)
    labkit.set_lang("ja")
    with wrong(key) as caught:
        _grade_on_ranks(ranks, answer)
    assert ja in str(caught.value)


def test_gradient_shard_names_a_function_the_ranks_lack(ranks):
    with pytest.raises(cluster.RankError) as err:
        exercises.grade_gradient_shard(ranks, "no_such_function")
    assert "has no no_such_function: run the %%px cell" in str(err.value)


# The bytes of model state per rank


def test_bytes_per_rank_passes_the_formula(capsys):
    exercises.grade_bytes_per_rank(answers.bytes_per_rank)
    assert "DDP 120.0 GB, ZeRO-1 60.9 GB, ZeRO-2 31.4 GB, ZeRO-3 1.9 GB" in \
        capsys.readouterr().out
    labkit.set_lang("ja")
    exercises.grade_bytes_per_rank(answers.bytes_per_rank)
    assert "DDP 120.0 GB、ZeRO-1 60.9 GB、ZeRO-2 31.4 GB、ZeRO-3 1.9 GB です" in \
        capsys.readouterr().out


BYTES_MISTAKES = [
    ("mixed", "ex_bytes_hint_mixed", "the ZeRO paper's mixed precision",
     "ZeRO の論文の混合精度"),
    ("adam_one", "ex_bytes_hint_adam_one", "Adam keeps two tensors per parameter",
     "2 つのテンソル"),
    ("master", "ex_bytes_hint_master", "keeps no fp32 copy of the parameters",
     "マスターコピー"),
    ("gb", "ex_bytes_hint_gb", "return bytes, not gigabytes", "ギガバイトではなく"),
    ("values", "ex_bytes_hint_values", "bytes, not values", "値の数ではなく"),
    ("integer", "ex_bytes_hint_rounded", "the formula counts no padding",
     "パディングを数えません"),
    # Shown with its decimals, the right value differs from the answer.
    ("integer_bytes", "ex_bytes_hint_rounded", '(1,001, 3, "ZeRO-1") = 10,677, but '
     "the formula gives 10,677.33 bytes",
     "= 10,677 ですが、式では 10,677.33 バイトです"),
    ("padded", "ex_bytes_hint_rounded", "keep Ψ ÷ N a fraction", "小数のままに"),
    ("stage1_grads", "ex_bytes_hint_stage1_grads",
     'bytes_per_rank(7,500,000,000, 64, "ZeRO-1") = 31,406,250,000, but the formula '
     "gives 60,937,500,000 bytes. Right for DDP, ZeRO-2, ZeRO-3.",
     "合っているのは DDP、ZeRO-2、ZeRO-3 です。"),
    ("stage2_params", "ex_bytes_hint_stage2_params",
     "every rank still holds all the parameters",
     "パラメータは全ランクが全部を持ちます"),
    ("stage3_params", "ex_bytes_hint_stage3_params",
     "stage 3 (FSDP) shards the parameters", "パラメータも world_size で分けます"),
    ("ddp_only", "ex_bytes_hint_nothing_divided",
     '"ZeRO-1") = 120,000,000,000, but the formula gives 60,937,500,000 bytes. Right '
     "for DDP. Hint: that is DDP's figure", "合っているのは DDP です。"),
    ("todo", "ex_fill_in", 'bytes_per_rank(7,500,000,000, 64, "DDP") is still None',
     'bytes_per_rank(7,500,000,000, 64, "DDP") がまだ None です'),
]


def _named_in_both_languages(grade, answer, key: str, en: str, ja: str) -> None:
    """`grade(answer)` names the mistake `key`, saying `en`, then in Japanese `ja`."""
    with wrong(key) as caught:
        grade(answer)
    assert en in str(caught.value)
    labkit.set_lang("ja")
    with wrong(key) as caught:
        grade(answer)
    assert ja in str(caught.value)


@pytest.mark.parametrize(("mistake", "key", "en", "ja"), BYTES_MISTAKES)
def test_bytes_per_rank_names_each_mistake(mistake, key, en, ja):
    _named_in_both_languages(exercises.grade_bytes_per_rank,
                             getattr(answers, f"bytes_per_rank_{mistake}"), key, en, ja)


def test_bytes_per_rank_right_for_divisible_sizes_only_is_named():
    """Floor division is right whenever N divides Ψ: only 1001 / 3 and 10 / 4 tell."""
    for params, n in [(1001, 3), (10, 4)]:
        assert params % n
    with wrong("ex_bytes_hint_rounded") as caught:
        exercises.grade_bytes_per_rank(answers.bytes_per_rank_integer)
    assert 'bytes_per_rank(1,001, 3, "ZeRO-1")' in str(caught.value)


# The lesson's own cells, read from the built notebook: its solutions pass the
# checks, and its exercise cells as handed out get "still None".

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "en" / "12_zero_by_hand.ipynb"
# The predictions (bytes per rank, bytes sent) are lesson 13's exercises.
LESSONS = (LESSON, ROOT / "notebooks" / "en" / "13_fsdp2.ipynb")


def _lesson_cell(tag, defines):
    """The source of the lessons' one cell tagged `tag` that defines `defines`."""
    cells = [c for path in LESSONS for c in nbformat.read(path, as_version=4).cells]
    (source,) = [c.source for c in cells if tag in c.metadata.get("tags", [])
                 and f"def {defines}(" in c.source]
    return source


@pytest.mark.parametrize(("name", "check"), [
    ("bytes_per_rank", exercises.grade_bytes_per_rank),
    ("bytes_sent_per_rank", exercises.grade_bytes_sent)])
def test_the_lessons_kernel_exercise_passes_and_is_still_none_as_handed_out(
        capsys, name, check):
    for tag, passes in [("solution", True), ("exercise", False)]:
        namespace = {}
        exec(_lesson_cell(tag, name), namespace)
        if passes:
            check(namespace[name])
            assert "Correct" in capsys.readouterr().out
        else:
            with wrong("ex_fill_in"):
                check(namespace[name])


@pytest.fixture
def lesson_on_ranks(ranks):
    """The shared ranks, with what the lesson's first %%px cell imports; the
    function the lesson defines there is removed after the test."""
    ranks.execute("import torch\nimport torch.distributed as dist")
    yield ranks
    ranks.execute("shard_of_mean_gradient = None\ndel shard_of_mean_gradient")


def test_the_lessons_gradient_shard_passes_and_its_exercise_is_still_none(
        lesson_on_ranks, capsys):
    ranks = lesson_on_ranks
    for tag, passes in [("solution", True), ("exercise", False)]:
        source = _lesson_cell(tag, "shard_of_mean_gradient")
        assert source.startswith("%%px\n")
        ranks.execute(source.removeprefix("%%px\n"))
        if passes:
            exercises.grade_gradient_shard(ranks)
            assert "Correct" in capsys.readouterr().out
        else:
            with wrong("ex_fill_in"):
                exercises.grade_gradient_shard(ranks)


# The bytes one rank sends per step


def test_bytes_sent_passes_the_ring(capsys):
    exercises.grade_bytes_sent(answers.bytes_sent_per_rank)
    assert "DDP 59.1 GB, ZeRO-1 59.1 GB, ZeRO-2 59.1 GB, ZeRO-3 88.6 GB: stages 1 " \
           "and 2 what DDP sends, stage 3 1.5 times as much" in capsys.readouterr().out
    labkit.set_lang("ja")
    exercises.grade_bytes_sent(answers.bytes_sent_per_rank)
    assert "ZeRO-3 88.6 GB を送ります。ステージ 1 と 2 は DDP と同じで、" \
           "ステージ 3 は 1.5 倍です。" in capsys.readouterr().out


SENT_MISTAKES = [
    ("whole", "ex_sent_hint_whole", "each rank sends (N − 1)/N of the buffer",
     "(N − 1)/N を送ります"),
    ("buffers", "ex_sent_hint_buffer", "the size of the collectives' buffers",
     "集団通信のバッファの大きさ"),
    ("received_too", "ex_sent_hint_received", "count what it sends only",
     "送るほうだけを数えます"),
    ("all_reduce_once", "ex_sent_hint_all_reduce",
     'bytes_sent_per_rank(7,500,000,000, 64, "DDP") = 29,531,250,000, but the formula '
     "gives 59,062,500,000 bytes. Right for ZeRO-1, ZeRO-2, ZeRO-3. Hint: an "
     "all-reduce is a reduce-scatter followed by an all-gather",
     "合っているのは ZeRO-1、ZeRO-2、ZeRO-3 です。ヒント: all-reduce は"),
    ("no_regather", "ex_sent_hint_no_regather", "all-gathers them again before the "
     "backward pass", "逆伝播の前にもう一度 all-gather します"),
    ("stage3_all_reduce", "ex_sent_hint_stage3_all_reduce",
     "stage 3 sends the gradients with a reduce-scatter too", "ステージ 3 でも勾配は "
     "reduce-scatter で送ります"),
    ("all_reduce_kept", "ex_sent_hint_all_reduce_kept",
     "with a reduce-scatter instead of the all-reduce", "all-reduce の代わりに"),
    ("no_gather", "ex_sent_hint_no_gather", "an all-gather hands it the parameters",
     "all-gather で受け取ります"),
    ("sharded", "ex_sent_hint_divided", "sharding saves memory, not traffic",
     "シャードで減るのはメモリで、通信は減りません"),
    ("fp16", "ex_sent_hint_fp16", "a gradient or parameter value takes 4 bytes",
     "1 つ 4 バイトです"),
    ("bits", "ex_sent_hint_bits", "return bytes, not bits", "ビットではなく"),
    ("integer_share", "ex_sent_hint_integer", "in integer division (N − 1) // N is 0",
     "(N − 1) // N は 0 です"),
    ("integer_bytes", "ex_sent_hint_integer", '(1,001, 3, "DDP") = 5338, but the '
     "formula gives 5338.67 bytes", "`//` ではなく `/` で割り"),
    ("constant", "ex_sent_hint_formula", "DDP makes an all-reduce (both)",
     "DDP は all-reduce (その 2 つ分)"),
]


@pytest.mark.parametrize(("mistake", "key", "en", "ja"), SENT_MISTAKES)
def test_bytes_sent_names_each_mistake(mistake, key, en, ja):
    _named_in_both_languages(exercises.grade_bytes_sent,
                             getattr(answers, f"bytes_sent_per_rank_{mistake}"),
                             key, en, ja)


# The lesson's solution, broken as the issue asks (the averaging dropped, the
# collective skipped, the shard taken one value off), fails the lesson's check.
BROKEN_SOLUTION = {
    "averaging dropped": ("return shard / world_size", "return shard", "ex_rs_sum"),
    "reduce-scatter skipped": (
        "dist.reduce_scatter_single(shard, flat_grad)",
        "shard.copy_(flat_grad[rank * k:(rank + 1) * k])", "ex_rs_local"),
    "offset off by one": (
        "dist.reduce_scatter_single(shard, flat_grad)",
        "dist.reduce_scatter_single(shard, flat_grad.roll(-1))", "ex_rs_shifted"),
}


@pytest.mark.parametrize("broken", BROKEN_SOLUTION)
def test_the_lessons_gradient_shard_broken_fails_its_check(lesson_on_ranks, broken):
    old, new, key = BROKEN_SOLUTION[broken]
    source = _lesson_cell("solution", "shard_of_mean_gradient")
    assert source.count(old) == 1
    ranks = lesson_on_ranks
    ranks.execute(source.replace(old, new).removeprefix("%%px\n"))
    with wrong(key):
        exercises.grade_gradient_shard(ranks)


def test_the_cell_after_the_check_asserts_avg_and_what_a_view_holds(lesson_on_ranks):
    cells = nbformat.read(LESSON, as_version=4).cells
    (at,) = [i for i, c in enumerate(cells) if c.cell_type == "code"
             and "op=dist.ReduceOp.AVG" in c.source and "def " not in c.source]
    # The run, then its folded checks.
    source = "\n".join(c.source.removeprefix("%%px\n") for c in cells[at:at + 2])
    ranks = lesson_on_ranks
    ranks.execute("from labkit import sharding")
    ranks.execute(source)
    # Were a view counted by its own values, or AVG a plain sum, it would fail.
    for old, new in [("view = flat.chunk(world_size)[rank]",
                      "view = flat.chunk(world_size)[rank].clone()"),
                     ("op=dist.ReduceOp.AVG", "op=dist.ReduceOp.SUM")]:
        assert source.count(old) == 1
        with pytest.raises(cluster.RankError, match="AssertionError"):
            ranks.execute(source.replace(old, new))


# ZeRO-3's two methods, mixed into the lesson's Zero3Base on the ranks

FIND = finder("12_zero_by_hand")


@pytest.fixture
def zero3_base(ranks):
    """The ranks with what the lesson's Zero3Base needs, and `define(mixin,
    shard)`: the class Zero3 of exercise_answers' `mixin` and the lesson's
    Zero3Base, using exercise_answers' `shard` as exercise 2's function."""
    ranks.execute("import torch.distributed as dist\n"
                  "rank, world_size = dist.get_rank(), dist.get_world_size()")
    ranks.execute(FIND("from labkit import comm_counting, models, sharding"))
    ranks.execute(FIND("class Zero3Base:"))

    def define(mixin, shard="shard_of_mean_gradient"):
        ranks.execute(f"from exercise_answers import {mixin}, {shard}\n"
                      f"shard_of_mean_gradient = {shard}\n"
                      f"class Zero3({mixin}, Zero3Base):\n    pass")
    yield define
    ranks.execute("Zero3 = shard_of_mean_gradient = None\n"
                  "del Zero3, shard_of_mean_gradient")


@pytest.mark.parametrize("shard", ["shard_of_mean_gradient",
                                   "shard_of_mean_gradient_async"])
def test_zero3_passes_each_layer_freed_after_its_own_use(zero3_base, ranks, capsys,
                                                         shard):
    zero3_base("Zero3Frees", shard)
    exercises.grade_zero3_frees(ranks)
    assert "Each layer's gathered parameters are freed right after its own " \
           "forward and backward pass" in capsys.readouterr().out
    labkit.set_lang("ja")
    exercises.grade_zero3_frees(ranks)
    assert "その層の順伝播と逆伝播の直後に解放されました" in capsys.readouterr().out


# Freed in the end, but later than the layer's own pass: after the whole forward
# and the whole backward nothing is held, so only a measure per layer tells.
ZERO3_LATE = [
    ("Zero3FreesAtTheRoot", "forward pass", "順伝播の直後も"),
    ("Zero3FreesOneLayerLate", "forward pass", "順伝播の直後も"),
    ("Zero3FreesAfterTheLastBackward", "backward pass", "逆伝播の直後も"),
]


@pytest.mark.parametrize(("mixin", "when", "ja"), ZERO3_LATE)
def test_zero3_freeing_a_layer_later_than_its_own_pass_is_named(zero3_base, ranks,
                                                                 mixin, when, ja):
    zero3_base(mixin)
    with wrong("ex_z3_late") as caught:
        exercises.grade_zero3_frees(ranks)
    assert f"Right after a layer's {when}, its gathered parameters still hold" in \
        str(caught.value) and "free the `flat` each call is given" in str(caught.value)
    labkit.set_lang("ja")
    with wrong("ex_z3_late") as caught:
        exercises.grade_zero3_frees(ranks)
    assert ja in str(caught.value) and "受け取った `flat` をその場で解放" in \
        str(caught.value)


# The lesson's own cells with an asynchronous answer to exercise 2: its checks,
# which record the collectives with CollectiveLog, pass, and so do the graders.
LESSON_DEFINITIONS = ("from labkit import comm_counting, models, sharding",
                      "class DDPAdam:", "def memory_run(", "class Zero1:",
                      "def train(make", "def alone(", "def compare(", "class Zero2(",
                      "class Zero3Base:")
LESSON_CHECKS = ("zero1 = train(Zero1)", "zero2 = train(Zero2)", "zero3 = train(Zero3)",
                 "memory_table = {}", "def traffic(", "def sent(calls)")


def test_the_lesson_passes_with_an_asynchronous_reduce_scatter(zero3_base, ranks,
                                                               capsys):
    for line in LESSON_DEFINITIONS:
        ranks.execute(FIND(line))
    ranks.execute(FIND("class Zero3(", "solution"))
    ranks.execute("from exercise_answers import shard_of_mean_gradient_async as "
                  "shard_of_mean_gradient")
    for line in LESSON_CHECKS:  # each asserts what its stage holds and sends
        ranks.execute(FIND(line))
    exercises.grade_gradient_shard(ranks, "shard_of_mean_gradient")
    exercises.grade_zero3_frees(ranks)
    assert capsys.readouterr().out.count("Correct") == 2
