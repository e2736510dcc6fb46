"""Lesson 13 (FSDP2, when to shard): the bytes a rank holds and sends, per ZeRO stage.

Both graders run in the kernel. The truth is computed, not written down: the
bytes held come from `sharding.memory_per_rank` with fp32 Adam's sizes, the
bytes sent from the ring's share of each stage's collectives. The wrong answers
the checks compare with serve only to name the mistake in a hint.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .. import comm, sharding
from ..i18n import get_lang, t
from .feedback import WrongAnswer, register, right

__all__ = ["grade_bytes_per_rank", "grade_bytes_sent"]


# --- exercise 2: the bytes per rank ---

register({  # key: (ja, en)
    "ex_bytes_call": ('{fn}({params:,}, {n}, "{stage}")',
                      '{fn}({params:,}, {n}, "{stage}")'),
    "ex_bytes_wrong": (
        "{call} = {got} ですが、式では {want} バイトです。{right_for}"
        "ヒント: {hint}",
        "{call} = {got}, but the formula gives {want} bytes. {right_for}"
        "Hint: {hint}"),
    "ex_bytes_right_for": ("合っているのは {stages} です。", "Right for {stages}. "),
    "ex_bytes_hint_mixed": (
        "16 バイト (2 + 2 + 12) は ZeRO の論文の混合精度の場合です。ここでは fp32 で"
        "学習するので、1 パラメータあたりパラメータ 4、勾配 4、Adam の状態 8 "
        "(exp_avg と exp_avg_sq、4 バイトずつ) です。",
        "16 bytes (2 + 2 + 12) is the ZeRO paper's mixed precision. This is fp32 "
        "training, so per parameter: parameter 4, gradient 4, Adam's state 8 "
        "(exp_avg and exp_avg_sq, 4 bytes each)."),
    "ex_bytes_hint_adam_one": (
        "Adam の状態は 1 パラメータあたり 2 つのテンソル (exp_avg と exp_avg_sq) で、"
        "fp32 なら 8 バイトです。",
        "Adam keeps two tensors per parameter (exp_avg and exp_avg_sq): 8 bytes in "
        "fp32."),
    "ex_bytes_hint_master": (
        "fp32 の学習では、パラメータの fp32 のコピー (マスターコピー) はありません。"
        "それは混合精度の場合です。Adam の状態は 8 バイトです。",
        "fp32 training keeps no fp32 copy of the parameters (a master copy belongs to "
        "mixed precision): Adam's state is 8 bytes."),
    "ex_bytes_hint_no_optimizer": (
        "Adam の状態 (1 パラメータあたり 8 バイト) を数え忘れています。",
        "Adam's state (8 bytes a parameter) is left out."),
    "ex_bytes_hint_stage1_grads": (
        "ステージ 1 で分けるのはオプティマイザの状態だけです。勾配は全ランクが"
        "全部を持ちます (分けるのはステージ 2 からです)。",
        "stage 1 shards the optimizer state only; every rank still holds all the "
        "gradients (stage 2 shards them)."),
    "ex_bytes_hint_nothing_divided": (
        "それは DDP の値です。ZeRO のどのステージも、少なくともオプティマイザの状態を "
        "world_size で分けます。",
        "that is DDP's figure: every ZeRO stage shards at least the optimizer state "
        "over world_size."),
    "ex_bytes_hint_stage2_params": (
        "ステージ 2 で分けるのは勾配とオプティマイザの状態です。パラメータは"
        "全ランクが全部を持ちます (分けるのはステージ 3 です)。",
        "stage 2 shards the gradients and the optimizer state; every rank still holds "
        "all the parameters (stage 3 shards them)."),
    "ex_bytes_hint_stage2_grads": (
        "ステージ 2 では、勾配もオプティマイザの状態と同じく world_size で分けます。",
        "stage 2 shards the gradients over world_size too, as the optimizer state."),
    "ex_bytes_hint_stage3_params": (
        "ステージ 3 (FSDP) では、パラメータも world_size で分けます。",
        "stage 3 (FSDP) shards the parameters over world_size too."),
    "ex_bytes_hint_ddp_divided": (
        "DDP では、どのランクもパラメータ、勾配、オプティマイザの状態を全部持ちます。"
        "world_size では割りません。",
        "under DDP every rank holds all the parameters, gradients and optimizer "
        "state: nothing is divided by world_size."),
    "ex_bytes_hint_gb": (
        "ギガバイトではなくバイトで返します。",
        "return bytes, not gigabytes."),
    "ex_bytes_hint_values": (
        "値の数ではなくバイト数です。fp32 は 1 つ 4 バイトです。",
        "bytes, not values: an fp32 value takes 4 bytes."),
    "ex_bytes_hint_rounded": (
        "Ψ ÷ N は、割り切れないときも小数のままにします (`//` ではなく `/` で割り、"
        "丸めません)。この式はパディングを"
        "数えません (実際の平坦化したバッファは、長さがランクの数の倍数になるまで"
        "パディングするので、測った値はその分だけ多くなります)。",
        "keep Ψ ÷ N a fraction when N does not divide Ψ (divide with `/`, not `//`, "
        "and round nothing): the formula counts no "
        "padding (a real flat buffer is padded to a multiple of the number of ranks, "
        "so the measured bytes are larger by that)."),
    "ex_bytes_hint_formula": (
        "1 パラメータあたり、パラメータ 4、勾配 4、Adam の状態 8 バイトです。DDP は"
        "何も world_size で割りません。ステージ 1 は状態を、ステージ 2 は勾配と状態を、"
        "ステージ 3 は全部を world_size で割ります。",
        "per parameter: parameter 4, gradient 4, Adam's state 8 bytes. DDP divides "
        "nothing by world_size; stage 1 the state; stage 2 the gradients and the "
        "state; stage 3 everything."),
    "ex_bytes_ok": (
        "Ψ = 10 から 75 億まで、N = 1〜64 のどの組み合わせでも、4 つのステージが"
        "式と一致しました。75 億パラメータ、64 ランクの fp32 Adam では、"
        "1 ランクあたり {table}です。",
        "All four stages agree with the formula for Ψ from 10 to 7.5 billion and N "
        "from 1 to 64. For 7.5 billion parameters on 64 ranks, fp32 Adam takes "
        "per rank {table}."),
})

# (Ψ, N): large and small, N = 1, and N that does not divide Ψ.
_BYTES_CASES = ((7_500_000_000, 64), (7_500_000_000, 1), (1_000_000, 8), (1001, 3),
                (10, 4), (2**20, 2))


def _bytes(params: float, n: int, stage: str, **sizes: int) -> float:
    return sharding.memory_per_rank(params, n, **(sharding.FP32_ADAM | sizes))[stage]


def _rounded(params: int, n: int, stage: str, rounding: Callable) -> float:
    """The formula with Ψ ÷ N rounded (to whole values, as padding would)."""
    p, g, o = (sharding.FP32_ADAM[k]
               for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
    share = rounding(params / n)
    return {"DDP": (p + g + o) * params, "ZeRO-1": (p + g) * params + o * share,
            "ZeRO-2": p * params + (g + o) * share,
            "ZeRO-3": (p + g + o) * share}[stage]


# The mistakes, as the value they give for (Ψ, N, stage). A mistake in the
# bytes of a parameter shows in every stage: it names the hint when all four
# stages match it (alone, one stage can match another mistake: mixed precision's
# ZeRO-1, 4 + 12 / N, is fp32's ZeRO-2). A stage taken for another shows in that
# stage; None where the mistake does not apply.
_FORMULA_MISTAKES: tuple[tuple[str, Callable], ...] = (
    ("ex_bytes_hint_mixed", lambda p, n, s: sharding.memory_per_rank(p, n)[s]),
    ("ex_bytes_hint_adam_one", lambda p, n, s: _bytes(p, n, s, optimizer_bytes=4)),
    ("ex_bytes_hint_master", lambda p, n, s: _bytes(p, n, s, optimizer_bytes=12)),
    ("ex_bytes_hint_no_optimizer",
     lambda p, n, s: _bytes(p, n, s, optimizer_bytes=0)),
    ("ex_bytes_hint_gb", lambda p, n, s: _bytes(p, n, s) / 1e9),
    ("ex_bytes_hint_gb", lambda p, n, s: _bytes(p, n, s) / 2**30),
    ("ex_bytes_hint_values", lambda p, n, s: _bytes(p, n, s) / 4),
    ("ex_bytes_hint_rounded", lambda p, n, s: _rounded(p, n, s, math.ceil)),
    ("ex_bytes_hint_rounded", lambda p, n, s: _rounded(p, n, s, math.floor)),
    # the bytes, not Ψ ÷ N, divided with // (8 * params // world_size)
    ("ex_bytes_hint_rounded", lambda p, n, s: math.floor(_bytes(p, n, s))),
)
_STAGE_MISTAKES: tuple[tuple[str, Callable], ...] = (
    ("ex_bytes_hint_stage1_grads",
     lambda p, n, s: _bytes(p, n, "ZeRO-2") if s == "ZeRO-1" else None),
    ("ex_bytes_hint_nothing_divided",
     lambda p, n, s: _bytes(p, n, "DDP") if s != "DDP" else None),
    ("ex_bytes_hint_stage2_params",
     lambda p, n, s: _bytes(p, n, "ZeRO-3") if s == "ZeRO-2" else None),
    ("ex_bytes_hint_stage2_grads",
     lambda p, n, s: _bytes(p, n, "ZeRO-1") if s == "ZeRO-2" else None),
    ("ex_bytes_hint_stage3_params",
     lambda p, n, s: _bytes(p, n, "ZeRO-2") if s == "ZeRO-3" else None),
    ("ex_bytes_hint_ddp_divided",
     lambda p, n, s: _bytes(p, n, "ZeRO-3") if s == "DDP" else None),
)


def _matches(rule: Callable, answers: dict, stages: tuple[str, ...]) -> bool:
    """Whether `rule` gives the answers of every case of `stages`."""
    return all((want := rule(p, n, s)) is not None and _agrees(answers[p, n, s], want)
               for s in stages for p, n in _BYTES_CASES)


def _shown(value: float) -> str:
    """Bytes as a reader compares them: with commas, and decimals unless whole
    (10,677.33, not 10,677), small ones as they are."""
    if abs(value) < 1e4 or not math.isfinite(value):
        return f"{value:.6g}"
    return f"{value:,.0f}" if value == round(value) else f"{value:,.2f}"


def _agrees(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)


def _per_stage(fn: Callable, name: str, truth: Callable, formula_mistakes: tuple,
               stage_mistakes: tuple, fallback: str) -> dict:
    """`fn(params, world_size, stage)` for every stage and case, as {(Ψ, N, stage):
    answer}, once all agree with `truth`; else WrongAnswer for the first stage that
    does not, with the hint of the first mistake all its answers match, or
    `fallback`."""
    answers = {}
    for stage in sharding.STAGES:
        for params, n in _BYTES_CASES:
            got = fn(params, n, stage)
            if got is None:
                raise WrongAnswer("ex_fill_in", name=t("ex_bytes_call", fn=name,
                                                       params=params, n=n, stage=stage))
            answers[params, n, stage] = float(got)
    right_stages = [s for s in sharding.STAGES if all(
        _agrees(answers[p, n, s], truth(p, n, s)) for p, n in _BYTES_CASES)]
    for stage in sharding.STAGES:
        if stage in right_stages:
            continue
        params, n = next((p, n) for p, n in _BYTES_CASES
                         if not _agrees(answers[p, n, stage], truth(p, n, stage)))
        hint = next((key for key, rule in formula_mistakes
                     if _matches(rule, answers, sharding.STAGES)), None) or next(
            (key for key, rule in stage_mistakes + formula_mistakes
             if _matches(rule, answers, (stage,))), fallback)
        separator = "、" if get_lang() == "ja" else ", "
        right_for = t("ex_bytes_right_for", stages=separator.join(right_stages)) \
            if right_stages else ""
        raise WrongAnswer("ex_bytes_wrong", hint, right_for=right_for,
                          call=t("ex_bytes_call", fn=name, params=params, n=n,
                                 stage=stage),
                          got=_shown(answers[params, n, stage]),
                          want=_shown(truth(params, n, stage)))
    return answers


def _gigabytes(answers: dict) -> str:
    """Each stage's answer for 7.5 billion parameters on 64 ranks, in GB."""
    separator = "、" if get_lang() == "ja" else ", "
    return separator.join(f"{stage} {answers[7_500_000_000, 64, stage] / 1e9:.1f} GB"
                          for stage in sharding.STAGES)


def grade_bytes_per_rank(fn: Callable) -> None:
    """`fn(params, world_size, stage)`: model-state bytes per rank for fp32 Adam,
    against `sharding.memory_per_rank` for Ψ from 10 to 7.5e9 and N from 1 to 64.

    Padding is not counted (Ψ ÷ N stays a fraction); the lesson compares the
    formula with the bytes measured on its ranks, padding included, itself.
    """
    answers = _per_stage(fn, "bytes_per_rank", _bytes, _FORMULA_MISTAKES,
                         _STAGE_MISTAKES, "ex_bytes_hint_formula")
    right("ex_bytes_ok", table=_gigabytes(answers))


# --- exercise 4: the bytes sent per step ---

register({  # key: (ja, en)
    "ex_sent_hint_whole": (
        "リングでは、reduce-scatter と all-gather のそれぞれで、各ランクはバッファの "
        "(N − 1)/N を送ります (自分の部分は送りません)。all-reduce はその 2 つ分です。",
        "in a ring each rank sends (N − 1)/N of the buffer in a reduce-scatter and "
        "again in an all-gather (never its own piece); an all-reduce is both."),
    "ex_sent_hint_buffer": (
        "それは集団通信のバッファの大きさ (`CollectiveLog` の \"bytes\") です。"
        "1 つのランクが送るのは、リングの reduce-scatter と all-gather でそれぞれ"
        "その (N − 1)/N です。",
        "that is the size of the collectives' buffers (`CollectiveLog`'s \"bytes\"); "
        "one rank sends (N − 1)/N of it in a ring reduce-scatter, and again in an "
        "all-gather."),
    "ex_sent_hint_received": (
        "送るバイトと受け取るバイトを両方数えています。リングでは、各ランクは送るのと"
        "同じだけ受け取ります。送るほうだけを数えます。",
        "you count the bytes received as well as those sent. In a ring each rank "
        "receives as much as it sends: count what it sends only."),
    "ex_sent_hint_all_reduce": (
        "all-reduce は reduce-scatter と all-gather を続けたものなので、各ランクは "
        "2(N − 1)/N × 4Ψ バイトを送ります。",
        "an all-reduce is a reduce-scatter followed by an all-gather: each rank sends "
        "2(N − 1)/N × 4Ψ bytes."),
    "ex_sent_hint_no_regather": (
        "ステージ 3 は、順伝播のあとで集めたパラメータを解放するので、逆伝播の前に"
        "もう一度 all-gather します。all-gather 2 回と reduce-scatter 1 回です。",
        "stage 3 frees the gathered parameters after the forward pass, so it "
        "all-gathers them again before the backward pass: two all-gathers and one "
        "reduce-scatter."),
    "ex_sent_hint_all_reduce_kept": (
        "ステージ 1 と 2 は、all-reduce の代わりに reduce-scatter で勾配を送ります。"
        "reduce-scatter と all-gather を合わせて、DDP の all-reduce と同じバイト数"
        "です。",
        "stages 1 and 2 send the gradients with a reduce-scatter instead of the "
        "all-reduce: the reduce-scatter and the all-gather together send what DDP's "
        "all-reduce sends."),
    "ex_sent_hint_no_gather": (
        "Adam のあと、各ランクは自分のシャードしか更新していません。ほかのランクが"
        "更新したパラメータは all-gather で受け取ります (それも送るバイトです)。",
        "after Adam each rank has updated only its own shard; an all-gather hands it "
        "the parameters the others updated (and sends bytes too)."),
    "ex_sent_hint_stage3_all_reduce": (
        "ステージ 3 でも勾配は reduce-scatter で送ります (all-reduce ではありません)。"
        "all-gather 2 回と reduce-scatter 1 回です。",
        "stage 3 sends the gradients with a reduce-scatter too, not an all-reduce: "
        "two all-gathers and one reduce-scatter."),
    "ex_sent_hint_divided": (
        "シャードで減るのはメモリで、通信は減りません。どのステップでも、勾配の全体と"
        "パラメータの全体がランクの間を行き来します。",
        "sharding saves memory, not traffic: every step still moves the whole "
        "gradient and the whole parameters between the ranks."),
    "ex_sent_hint_fp16": (
        "ここは fp32 の学習です。勾配もパラメータも 1 つ 4 バイトです。",
        "this is fp32 training: a gradient or parameter value takes 4 bytes."),
    "ex_sent_hint_bits": ("ビットではなくバイトで返します。",
                          "return bytes, not bits."),
    "ex_sent_hint_integer": (
        "(N − 1)/N は小数のままにします。`//` ではなく `/` で割り、丸めません "
        "(整数の割り算では、(N − 1) // N は 0 です)。",
        "keep (N − 1)/N a fraction: divide with `/`, not `//`, and round nothing "
        "(in integer division (N − 1) // N is 0)."),
    "ex_sent_hint_formula": (
        "S = 4Ψ とすると、リングの reduce-scatter と all-gather は、各ランクが "
        "(N − 1)/N × S を送ります。DDP は all-reduce (その 2 つ分)、ステージ 1 と 2 は "
        "reduce-scatter と all-gather、ステージ 3 は all-gather 2 回と reduce-scatter "
        "1 回です。",
        "with S = 4Ψ, each rank sends (N − 1)/N × S in a ring reduce-scatter or "
        "all-gather. DDP makes an all-reduce (both), stages 1 and 2 a reduce-scatter "
        "and an all-gather, stage 3 two all-gathers and a reduce-scatter."),
    "ex_sent_ok": (
        "Ψ = 10 から 75 億まで、N = 1〜64 のどの組み合わせでも、4 つのステージが"
        "リングの式と一致しました。75 億パラメータ、64 ランクでは、1 ステップに"
        "各ランクが {table} を送ります。ステージ 1 と 2 は DDP と同じで、"
        "ステージ 3 は 1.5 倍です。",
        "All four stages agree with the ring's bytes for Ψ from 10 to 7.5 billion and "
        "N from 1 to 64. For 7.5 billion parameters on 64 ranks, each rank sends per "
        "step {table}: stages 1 and 2 what DDP sends, stage 3 1.5 times as much."),
})

# The collectives of one step, each over the whole fp32 gradient or parameters.
_COLLECTIVES = {"DDP": {"all_reduce": 1},
                "ZeRO-1": {"reduce_scatter": 1, "all_gather": 1},
                "ZeRO-2": {"reduce_scatter": 1, "all_gather": 1},
                "ZeRO-3": {"reduce_scatter": 1, "all_gather": 2}}


def _sent(params: float, n: int, stage: str, value_bytes: int = 4,
          collectives: dict | None = None, share: float | None = None) -> float:
    """Bytes one rank sends in a step's ring collectives: an all-reduce sends
    ring_factor(n) of its buffer, a reduce-scatter or an all-gather half that."""
    half = comm.ring_factor(n) / 2 if share is None else share
    calls = _COLLECTIVES[stage] if collectives is None else collectives
    return sum(count * (2 if op == "all_reduce" else 1) * half * value_bytes * params
               for op, count in calls.items())


_SENT_FORMULA_MISTAKES: tuple[tuple[str, Callable], ...] = (
    ("ex_sent_hint_whole", lambda p, n, s: _sent(p, n, s, share=1)),
    ("ex_sent_hint_buffer", lambda p, n, s: _sent(p, n, s, share=1) if s != "DDP"
     else 4 * p),
    ("ex_sent_hint_received", lambda p, n, s: 2 * _sent(p, n, s)),
    ("ex_sent_hint_divided", lambda p, n, s: _sent(p, n, s) / n),
    ("ex_sent_hint_fp16", lambda p, n, s: _sent(p, n, s, value_bytes=2)),
    ("ex_sent_hint_bits", lambda p, n, s: _sent(p, n, s) * 8),
    ("ex_sent_hint_integer", lambda p, n, s: _sent(p, n, s, share=(n - 1) // n)),
    ("ex_sent_hint_integer", lambda p, n, s: math.floor(_sent(p, n, s))),
    ("ex_bytes_hint_gb", lambda p, n, s: _sent(p, n, s) / 1e9),
    ("ex_bytes_hint_values", lambda p, n, s: _sent(p, n, s) / 4),
)
_SENT_STAGE_MISTAKES: tuple[tuple[str, Callable], ...] = (
    ("ex_sent_hint_all_reduce", lambda p, n, s: _sent(p, n, s, collectives={
        "reduce_scatter": 1}) if s == "DDP" else None),
    ("ex_sent_hint_no_regather",
     lambda p, n, s: _sent(p, n, "ZeRO-2") if s == "ZeRO-3" else None),
    ("ex_sent_hint_stage3_all_reduce", lambda p, n, s: _sent(p, n, s, collectives={
        "all_reduce": 1, "all_gather": 2}) if s == "ZeRO-3" else None),
    ("ex_sent_hint_all_reduce_kept", lambda p, n, s: _sent(p, n, s, collectives={
        "all_reduce": 1, "all_gather": 1}) if s in ("ZeRO-1", "ZeRO-2") else None),
    ("ex_sent_hint_no_gather", lambda p, n, s: _sent(p, n, s, collectives={
        "reduce_scatter": 1}) if s in ("ZeRO-1", "ZeRO-2") else None),
    ("ex_sent_hint_divided",
     lambda p, n, s: _sent(p, n, s) / n if s != "DDP" else None),
)


def grade_bytes_sent(fn: Callable) -> None:
    """`fn(params, world_size, stage)`: bytes one rank sends in a training step's
    ring collectives, fp32, for Ψ from 10 to 7.5e9 and N from 1 to 64 (no padding)."""
    answers = _per_stage(fn, "bytes_sent_per_rank", _sent, _SENT_FORMULA_MISTAKES,
                         _SENT_STAGE_MISTAKES, "ex_sent_hint_formula")
    right("ex_sent_ok", table=_gigabytes(answers))
