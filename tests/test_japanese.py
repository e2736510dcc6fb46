"""Every grader's Japanese messages, rendered as a learner reads them.

Each message of labkit.exercises is rendered with the values its graders pass
(read at each call site: code such as `p.grad`, numbers, and the Japanese
phrases some graders put in a field, such as 評価の損失 or 2 ステップ目), then
checked for what a Japanese reader sees as a typo: a half-width space between
two Japanese characters (評価の損失 が, パディング まで), Latin text or code with
no space before its particle (p.gradが), and Markdown, which a traceback prints
as it is (**達した**).

Backticks are allowed where the English message uses them too: in plain text
they mark code the way Python's own messages quote names, and `wait()` reads no
worse printed than rendered. The Japanese may quote code the English does not
(`dist.all_reduce` where the English says all-reduce), so only their presence
is compared.
"""

from __future__ import annotations

import re
import string

import pytest

import labkit
import labkit.exercises  # noqa: F401  (registers every grader's messages)
from labkit import i18n
from labkit.exercises import feedback
from labkit.i18n import t

JAPANESE = "[\u3000-\u30ff\u3400-\u9fff\uff00-\uffef]"
SPACE_IN_JAPANESE = re.compile(f"{JAPANESE}( +){JAPANESE}")
# Latin text, a number or code written against kana or kanji with no space.
KANA_KANJI = "[\u3040-\u30ff\u3400-\u9fff]"
UNSPACED = re.compile(f"[A-Za-z0-9_)\\]`]{KANA_KANJI}|{KANA_KANJI}[A-Za-z0-9_(\\[`]")
MARKDOWN = re.compile(r"\*\*|__|~~|^#+ |\[[^\]]*\]\([^)]*\)", re.MULTILINE)
# A half-width space after or before Japanese punctuation (です。 3 ステップ, 、 499).
PUNCTUATION_SPACED = re.compile("[、。「」] +[0-9A-Za-z`(]|[0-9A-Za-z)`] +[、。「」]")


def problems(ja: str, en: str) -> list[str]:
    """What a Japanese reader would take for a typo in `ja`, the twin of `en`."""
    found = [f"space between Japanese characters: {m.group(0)!r}"
             for m in SPACE_IN_JAPANESE.finditer(ja)]
    found += [f"no space between Latin text and Japanese: {m.group(0)!r}"
              for m in UNSPACED.finditer(ja)]
    found += [f"a space beside Japanese punctuation: {m.group(0)!r}"
              for m in PUNCTUATION_SPACED.finditer(ja)]
    found += [f"Markdown {m.group(0)!r}" for m in MARKDOWN.finditer(ja)]
    if ja.count("`") % 2:
        found.append("an unpaired backtick")
    if "`" in ja and "`" not in en:
        found.append("code in backticks, where the English has none")
    return found


def _values() -> tuple[dict[str, list], dict[tuple[str, str], list]]:
    """Field values as the graders pass them: by field name, and by (key, field)
    where one name holds different things in different messages."""
    by_name = {
        "K": [4], "a": [0], "b": [1], "batch": [512], "calls": [3], "ddp_calls": [2],
        "cap": [None, 1], "counts": ["3 + 5"], "diff": [1.2e-3], "epoch": [1],
        "err": ["mat1 and mat2 shapes cannot be multiplied (1x80 and 10x32)"],
        "features": [4], "first": [0.16], "ckpt": [12.6], "plain": [100.7],
        "hint": [t("ex_dp_hint"), t("ex_psgd_hint_matrix"), t("ex_buckets_hint_close")],
        "loss": [0.1234], "lr": [0.2], "lrs": ["0.2, 0.0125"],
        "model": ["_Branches(use_aux=False)", "nn.Sequential(Linear, ReLU, Linear)"],
        "ms": [1.23], "ms2": [0.61], "n": [2], "names": ["fc1.weight, fc1.bias"],
        "name": ["sync_s", "predicted[10, 3]", "torchrun_env(2, 2, 1)",
                 "evaluate(model, X, y)", "values_held(shape, rank, world_size)"],
        "nbytes": [81920], "node": [1],
        "nodes": ["node 0: RANK 0, 1; node 1: RANK 2, 3"],
        "nosync": [12.5], "sync": [31.0], "nproc": [2], "original": [1],
        "peak": [3.2], "pred": [[4, 4, 2]], "r": [4], "rank": [1],
        "count": [0, 7], "missing": ["(12, 4), (7, 3)"], "chunks": [3], "k": [2],
        "parts": ["o", "s, o"], "num_epochs": [3], "good": [0], "bad": [1],
        "steps0": [1],
        "ranks": ["0", "0, 1"], "passed": ["(100, 10)", "(100, 10), (1, 10)"],
        "ratio": [2.0], "replicas": [2],
        "real": [[{"RANK": 2, "LOCAL_RANK": 0, "WORLD_SIZE": 4},
                  {"RANK": 3, "LOCAL_RANK": 1, "WORLD_SIZE": 4}]],
        "shape": [(4, 2, 5), (10, 3)], "shapes": ["(100, 10), (1, 10), (4, 2, 5)"],
        "steps": [3], "total": [9], "totals": ["9, 10, 7"], "updates": [3],
        "world_size": [2],
        # Japanese phrases beside particles: the case the spacing must get right.
        "step": [t("ex_scratch_step", n=2), t("ex_scratch_update")],
        "what": [t("ex_eval_loss"), t("ex_join_weights"), t("ex_exact_what", total=9),
                 "model(X)", "p.grad", "lr_at(step, 512)", "fn(module, X, device_ids)",
                 "module.parameters() .grad", "saved_bytes(8, 16, 4, 2, True)"],
        "case": ["saved_bytes(8, 16, 4, 2, False)"],
        "got": [3],
        "want": [2],
    }
    buckets = [t("ex_buckets_case", sizes=[4000, 40], cap=None),
               t("ex_buckets_case", sizes=[2097152, 4], cap=1)]
    psgd = ["1024 × 1024", "Linear(1024, 10)", "MLP 10-1024-1024-1024-10"]
    shard_got = [6, 0]
    by_key = {
        ("ex_psgd_none", "case"): psgd, ("ex_psgd_wrong", "case"): psgd,
        ("ex_buckets_none", "case"): buckets, ("ex_buckets_wrong", "case"): buckets,
        ("ex_act_ok", "cases"): [8], ("ex_dp_ok", "cases"): ["10 / 2, 7 / 3"],
        ("ex_bn_ok", "total"): [8],
        **{(key, "what"): ["mean", "var"] for key in i18n.MESSAGES
           if key.startswith("ex_bn_")},
        **{(key, "step"): [2] for key in ("ex_apart", "ex_no_zero_grad")},
        ("ex_lr_warmup_end", "step"): [40],
        ("ex_lr_ok", "steps"): [20],
        ("ex_dl_ok", "rounds"): [3], ("ex_dl_round", "round"): [1],
        **{(key, "case"): [t("ex_dl_round", round=2, rank=0)] for key in i18n.MESSAGES
           if key.startswith("ex_dl_")},
        ("ex_accum_k", "first"): [4], ("ex_accum_k", "K"): [2],
        ("ex_chunks_ok", "sizes"): [{(10, 3): [4, 4, 2], (7, 3): [3, 3, 1]}],
        ("ex_buckets_case", "sizes"): [[4000, 40]],
        ("ex_psgd_wrong", "got"): [4_198_400], ("ex_psgd_wrong", "want"): [16_384],
        ("ex_buckets_wrong", "got"): [1], ("ex_buckets_wrong", "want"): [2],
        ("ex_act_values", "got"): [2048],
        ("ex_batch", "got"): [(1, 1)], ("ex_batch", "want"): [(4, 1)],
        ("ex_dp_type", "got"): ["list"],
        ("ex_dp_shape", "got"): [(5, 10)], ("ex_dp_shape", "want"): [(10, 10)],
        ("ex_env_count", "got"): [4],
        **{(key, "got"): [[0, 1]] for key in ("ex_env_rank", "ex_env_local",
                                              "ex_env_world")},
        ("ex_env_real", "got"): [[{"RANK": 1, "LOCAL_RANK": 1, "WORLD_SIZE": 4}]],
        ("ex_exact_local", "got"): [[0.52, 0.48]], ("ex_exact_padding", "got"): [0.5],
        ("ex_value_off", "got"): [0.0123], ("ex_lr_peak", "got"): [1.6],
        **{(key, "got"): shard_got for key in i18n.MESSAGES
           if key.startswith("ex_shard_")},
        ("ex_unused_stale", "got"): [[]], ("ex_unused_stale", "want"): [["aux.bias",
                                                                       "aux.weight"]],
        ("ex_unused_wrong", "got"): [["aux.weight"]],
        ("ex_unused_wrong", "want"): [["aux.bias", "aux.weight"]],
    }
    for key in ("ex_lr_not_scaled", "ex_lr_sqrt", "ex_lr_from_base", "ex_lr_start"):
        by_key[key, "got"] = [0.2]
    by_key.update(_lesson_11_values())
    by_key.update(_noise_scale_values())
    by_key.update(_crossover_values())
    return by_name, by_key


def _lesson_11_values() -> dict[tuple[str, str], list]:
    """The ZeRO lessons' graders: reduce-scatter cases, tables of bytes, ZeRO-3."""
    rs_case = [t("ex_rs_case", numel=1000, rank=0)]
    call = t("ex_bytes_call", fn="bytes_per_rank", params=7_500_000_000, n=64,
             stage="ZeRO-1")
    return {
        **{(key, "case"): rs_case for key in i18n.MESSAGES
           if key.startswith("ex_rs_")},
        **{(key, "numel"): [1000] for key in ("ex_rs_other_shard", "ex_rs_shifted",
                                              "ex_rs_whole", "ex_rs_whole_mean")},
        ("ex_rs_case", "numel"): [1000], ("ex_rs_size", "got"): [499],
        ("ex_rs_divisor", "d"): [1000.0], ("ex_rs_not_tensor", "kind"): ["list"],
        ("ex_rs_ok", "sizes"): ["1000, 6, 2, 8198"],
        ("ex_rs_other_shard", "other"): [0],
        ("ex_rs_other_shard", "values"): [t("ex_rs_span", first=500, last=999)],
        ("ex_rs_shifted", "shift"): [1, -1],
        ("ex_rs_shifted", "values"): [t("ex_rs_span", first=1, last=500)],
        ("ex_rs_shifted", "want"): [t("ex_rs_span", first=0, last=499)],
        ("ex_rs_span", "first"): [500], ("ex_rs_span", "last"): [999],
        ("ex_rs_unseen", "ops"): ["-", "all_gather"],
        ("ex_rs_extra", "ops"): ["all_gather"],
        ("ex_rs_all_reduce", "count"): [1], ("ex_rs_many", "count"): [2],
        ("ex_rs_view", "held"): [4000], ("ex_rs_view", "nbytes"): [2000],
        ("ex_rs_all_reduce", "nbytes"): [4000],
        ("ex_bytes_call", "fn"): ["bytes_per_rank", "bytes_sent_per_rank"],
        ("ex_bytes_call", "params"): [7_500_000_000, 1001],
        ("ex_bytes_call", "stage"): ["ZeRO-1", "DDP"],
        ("ex_bytes_ok", "table"): ["DDP 120.0 GB、ZeRO-1 60.9 GB、ZeRO-2 31.4 GB、"
                                   "ZeRO-3 1.9 GB"],
        ("ex_sent_ok", "table"): ["DDP 59.1 GB、ZeRO-1 59.1 GB、ZeRO-2 59.1 GB、"
                                  "ZeRO-3 88.6 GB"],
        ("ex_bytes_right_for", "stages"): ["DDP", "DDP、ZeRO-2、ZeRO-3"],
        ("ex_bytes_wrong", "call"): [call],
        ("ex_bytes_wrong", "right_for"): [t("ex_bytes_right_for", stages="DDP"), ""],
        ("ex_bytes_wrong", "got"): ["31,406,250,000", "31.4062"],
        ("ex_bytes_wrong", "want"): ["60,937,500,000"],
        ("ex_bytes_wrong", "hint"): [t("ex_bytes_hint_mixed"),
                                     t("ex_sent_hint_buffer")],
        **{(k, "when"): [t("ex_z3_forward"), t("ex_z3_backward")] for k in (
            "ex_z3_shard_freed", "ex_z3_deleted", "ex_z3_zeroed", "ex_z3_kept",
            "ex_z3_late")},
        ("ex_z3_kept", "fix"): [t("ex_z3_fix_forward"), t("ex_z3_fix_backward")],
        ("ex_z3_no_regather", "error"): [
            "setStorage: sizes [16, 16], strides [16, 1], storage offset 0, and "
            "itemsize 4 requiring a storage size of 1024 are out of bounds for "
            "storage of size 0"],
        ("ex_z3_error", "error"): ["boom"], ("ex_z3_error", "where"): [t("ex_z3_step")],
        ("ex_z3_error", "step"): [2], ("ex_z3_ok", "shard"): [1668],
    }



def _noise_scale_values() -> dict[tuple[str, str], list]:
    """Lesson 15's noise scale grader: the call it shows, the value it found."""
    call = t("ex_ns_call", fn="noise_scale_estimate", b=8, n=4, small=21.0,
             big=9.75)
    return {("ex_ns_call", "fn"): ["noise_scale_estimate"],
            ("ex_ns_call", "small"): [21.0, 25.289], ("ex_ns_call", "big"): [9.75],
            ("ex_ns_wrong", "call"): [call],
            ("ex_ns_wrong", "got"): ["ZeroDivisionError", "2.5"],
            ("ex_ns_wrong", "want"): ["20"],
            ("ex_ns_wrong", "hint"): [t("ex_ns_hint_swapped"), t("ex_ns_hint_formula")],
            ("ex_ns_ok", "value"): [17.4]}


def _crossover_values() -> dict[tuple[str, str], list]:
    """Lesson 14's crossover grader: the case it shows, its answers, the hints."""
    fields = {"t_ddp": 13.4, "t_fp16": 14.9, "S_ddp": 8_482_856, "S_fp16": 4_241_428,
              "calls": 2, "alpha_s": 1e-4}
    not_half = t("ex_xover_case", **fields | {"S_fp16": 3_000_000}) + " " + t(
        "ex_xover_not_half")
    return {**{("ex_xover_case", name): [value] for name, value in fields.items()},
            ("ex_xover_wrong", "case"): [t("ex_xover_case", **fields), not_half],
            ("ex_xover_wrong", "got"): ["22,620,949,333", "-2,827,618,667", "inf"],
            ("ex_xover_wrong", "want"): ["2,827,618,667", "inf"],
            ("ex_xover_wrong", "hint"): [t("ex_xover_hint_bits"),
                                         t("ex_xover_hint_pays")],
            ("ex_xover_ok", "measured"): ["2,828 MB/s"]}

def _fields(key: str) -> list[tuple[str, str]]:
    return [(name, spec) for _, name, spec, _ in
            string.Formatter().parse(i18n.MESSAGES[key]["ja"]) if name is not None]


def _renderings(key: str, by_name: dict, by_key: dict) -> list[tuple[str, str]]:
    """(ja, en) of `key` once for each value a field can hold, the others fixed."""
    choices = {name: by_key.get((key, name), by_name.get(name))
               for name, _ in _fields(key)}
    variants = [{name: values[0] for name, values in choices.items()}]
    for name, values in choices.items():
        variants += [{**variants[0], name: value} for value in values[1:]]
    out = []
    for fields in variants:
        labkit.set_lang("ja")
        ja = feedback.message(key, **fields)
        labkit.set_lang("en")
        out.append((ja, t(key, **fields)))
    return out


GRADER_KEYS = sorted(key for key in i18n.MESSAGES if key.startswith("ex_"))


def test_every_grader_message_reads_as_japanese():
    labkit.set_lang("ja")
    by_name, by_key = _values()
    missing = [f"{key}: {name}" for key in GRADER_KEYS for name, _ in _fields(key)
               if not by_key.get((key, name), by_name.get(name))]
    assert not missing, ("no values for these fields: read the call site of the "
                         "grader that raises each and add what it passes:\n"
                         + "\n".join(missing))
    found, rendered = [], 0
    for key in GRADER_KEYS:
        for ja, en in _renderings(key, by_name, by_key):
            rendered += 1
            if key != "ex_not_yet":  # a wrong answer's message follows this verdict
                labkit.set_lang("ja")
                ja = t("ex_not_yet") + ja
            found += [f"{key}: {p}\n    {ja}" for p in problems(ja, en)]
    assert not found, "\n".join(found)
    assert rendered > len(GRADER_KEYS)  # some fields were tried with several values


def test_a_latin_value_is_spaced_and_a_japanese_one_is_not():
    labkit.set_lang("ja")
    hint = t("ex_eval_hint")
    assert feedback.message("ex_off", what=t("ex_eval_loss"), diff=1e-3,
                            hint=hint).startswith("評価の損失が正解と")
    assert feedback.message("ex_off", what="p.grad", diff=1e-3,
                            hint=hint).startswith("p.grad が正解と")
    step = feedback.message("ex_scratch_sum", step=t("ex_scratch_step", n=2),
                            world_size=2)
    assert step.startswith("2 ステップ目の勾配が")
    # Beside 、 and 。 a number gets no space, beside kana it does.
    size = feedback.message("ex_rs_size", case="ランク 0", got=499, k=500)
    assert "、499 要素を返しています" in size and "ランク 0 で" in size
    assert "です。3 ステップ" in feedback.message("ex_z3_ok", shard=1668, steps=3)


@pytest.mark.parametrize("template, fields", [
    ("{what} が正解と最大 {diff:.1e} 違います。", {"what": "評価の損失", "diff": 1e-3}),
    ("{step} で、送られなかった勾配があります。", {"step": "2 ステップ目"}),
    ("{got} はパディング まで数えています。", {"got": 6}),
    ("バケットは、上限に**達した** (以上になった) ところで閉じます。", {}),
    ("`flat` を読む前に `work.wait()` を呼びます。", {}),
])
def test_the_old_forms_are_caught(monkeypatch, template, fields):
    # Rendered the way a grader renders its messages, the forms fixed before fail.
    monkeypatch.setitem(i18n.MESSAGES, "ex_old_form", {"ja": template,
                                                      "en": "call wait()"})
    labkit.set_lang("ja")
    assert problems(feedback.message("ex_old_form", **fields), "call wait()")


def test_a_latin_value_formatted_without_its_space_is_caught():
    # What the template {what}が gives when not rendered by feedback.message.
    labkit.set_lang("ja")
    assert problems(t("ex_off", what="p.grad", diff=1e-3, hint=""), "p.grad is off")


@pytest.mark.parametrize("ja", [
    "p.grad が正解と最大 1.0e-03 違います。",
    "2 ステップ目で、all-reduce を 3 回、`wait()` のあとで送ります。",
    "ランク 0 の 5 ステップ目 (MiB) です。",
])
def test_right_forms_pass(ja):
    assert problems(ja, "send after `wait()`") == []


def test_lesson_prose_has_no_space_between_japanese_characters():
    # The build joins the lines of a Japanese sentence, so a space left between
    # two Japanese characters (遅延は 呼び出し回数) is one the learner sees.
    import json
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "notebooks" / "ja"
    spaced = re.compile(f"{KANA_KANJI} +{KANA_KANJI}")
    found = []
    for path in sorted(folder.glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "markdown":
                text = re.sub(r"```.*?```", "", "".join(cell["source"]), flags=re.S)
                text = re.sub(r"`[^`\n]*`", "`x`", text)
                found += [f"{path.name} {cell['id']}: {m.group(0)!r}"
                          for m in spaced.finditer(text)]
    assert len(list(folder.glob("*.ipynb"))) >= 13 and found == []
