"""Lesson 06 (beyond no_sync): DDP from scratch, PowerSGD's bytes, DDP's buckets.

Messages beside each grader; how a grader answers: labkit.exercises.feedback.
The truth is measured on the ranks, never written down: for the DDP written by
hand, torch's own DDP on the same model and data (labkit.from_scratch runs both),
and the mistakes are told apart by what the hand-made DDP did (which gradients
stayed local, which all-reduces it made, when it waited for them); for
PowerSGD's bytes and DDP's buckets, what they send while they run. The wrong
rules the last two check against serve only to name the mistake in a hint.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .. import from_scratch
from ..i18n import t
from .feedback import WrongAnswer, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ["grade_bucket_count", "grade_powersgd_bytes", "grade_scratch_ddp"]

register({  # key: (ja, en)
    "ex_scratch_unsent": (
        "{step}で、送られなかった勾配があります ({names} など。all-reduce は "
        "{calls} 回、torch の DDP は {ddp_calls} 回)。ヒント: パラメータの勾配が"
        "できるたびにそのバケットの残りを 1 つ減らし、0 になったらバケットを送ります。"
        "`finish_sync` の終わりで、次のステップのために残りの数を元に戻します。",
        "In {step} some gradients were never sent ({names}, for instance; "
        "{calls} all-reduce(s), torch's DDP made {ddp_calls}). Hint: each time a "
        "parameter's gradient is ready, count it off its bucket, and send the bucket "
        "when none is left; at the end of `finish_sync`, reset the counts for the "
        "next step."),
    "ex_scratch_early": (
        "{step}で、all-reduce の完了を逆伝播の途中で待っています ({n} 回)。"
        "待つあいだ逆伝播が止まるので、通信は計算と重なりません。ヒント: フックでは "
        "`dist.all_reduce(flat, async_op=True)` で始めるだけにし、`wait()` は "
        "`finish_sync` で呼びます。",
        "In {step} you wait for all-reduces during the backward pass ({n} of them): "
        "the backward pass stops while it waits, so nothing overlaps. Hint: in the "
        "hook only start it, `dist.all_reduce(flat, async_op=True)`, and call "
        "`wait()` in `finish_sync`."),
    "ex_scratch_late": (
        "{step}で、all-reduce を {n} 回、勾配の計算が終わってから始めています。"
        "それでは通信が計算と重なりません。ヒント: バケットがそろったら、その場で"
        "フックから送ります。",
        "In {step} you start {n} all-reduce(s) after the gradient computation has "
        "ended, so nothing overlaps. Hint: send each bucket from the hook, as soon as "
        "it is complete."),
    "ex_scratch_sum": (
        "{step}の勾配が、torch の DDP のちょうど {world_size} 倍です。all-reduce は"
        "和を返します。ヒント: `finish_sync` で world size で割って平均にします。",
        "In {step} the gradients are exactly {world_size} times torch DDP's: "
        "all-reduce returns the sum. Hint: divide by the world size in `finish_sync` "
        "to get the mean."),
    "ex_scratch_too_many": (
        "{step}では all-reduce が {calls} 回、torch の DDP は {ddp_calls} 回です。"
        "ヒント: パラメータごとではなく、バケットごとに 1 回送ります。",
        "In {step} you made {calls} all-reduces, torch's DDP {ddp_calls}. Hint: send "
        "once per bucket, not once per parameter."),
    "ex_scratch_no_sync": (
        "`no_sync()` の中で all-reduce を {n} 回しました。ヒント: `require_sync` が "
        "False のあいだ、フックは何もせずに戻ります (勾配は .grad にたまり、次の同期"
        "する逆伝播でまとめて送られます)。",
        "You made {n} all-reduce(s) inside `no_sync()`. Hint: while `require_sync` "
        "is False the hook returns at once (the gradients add up in .grad, and the "
        "next synchronized backward sends their sum)."),
    "ex_scratch_off": (
        "{step}の勾配が torch の DDP と最大 {diff:.1e} 違います。ヒント: バケットの"
        "勾配は、all-reduce が終わってから (`wait()` のあとで) `.grad` に"
        "書き戻します。world size で割るのは 1 回だけです。",
        "In {step} the gradients differ from torch DDP's by up to {diff:.1e}. Hint: "
        "copy a bucket's gradients back into `.grad` after its all-reduce has "
        "finished (after `wait()`), and divide by the world size once."),
    "ex_scratch_too_few": (
        "{step}では all-reduce が {calls} 回で、torch の DDP は {ddp_calls} 回です。"
        "いくつかのバケットをまとめて送っています。それでは、逆伝播が終わるまで"
        "送れない勾配が増え、通信が計算と重なりません。ヒント: バケットごとに、"
        "その最後の勾配ができたところで 1 回送ります。",
        "In {step} you made {calls} all-reduce(s), torch's DDP {ddp_calls}: you send "
        "several buckets together, so more gradients wait for the end of the "
        "backward pass and less communication overlaps it. Hint: send each bucket "
        "once, as soon as its last gradient is ready."),
    "ex_scratch_no_overlap": (
        "{step}では、{calls} 回の all-reduce がどれも、逆伝播が最後の勾配を計算し"
        "終えてから始まっています。すべてのバケットを最後にまとめて送っているので、"
        "通信が計算と重なりません。ヒント: バケットの残りが 0 になったら、ほかの"
        "バケットを待たずに、その場でそのバケットを送ります。",
        "In {step} all {calls} of your all-reduces start once the backward pass has "
        "computed its last gradient: every bucket goes at the end, so no "
        "communication overlaps the computation. Hint: send a bucket as soon as its "
        "own count reaches 0, without waiting for the other buckets."),
    "ex_scratch_unwaited": (
        "{step}で、all-reduce を {n} 回、一度も `wait()` せずに使っています。"
        "値がそろう前に読むと、ほかのランクの勾配が入っていないことがあります "
        "(ここで合っていたのは、たまたま先に終わっていたからです)。ヒント: "
        "`finish_sync` で、`flat` を読む前に `work.wait()` を呼びます。",
        "In {step} you used {n} all-reduce(s) without ever calling `wait()`: read "
        "before it completes, `flat` may lack the other ranks' gradients (where the "
        "values came out right, it had finished first by chance). Hint: in "
        "`finish_sync`, call `work.wait()` before reading `flat`."),
    "ex_scratch_not_copied": (
        "{step}で、勾配は all-reduce で送りました (all-reduce {calls} 回、torch の "
        "DDP は {ddp_calls} 回) が、`.grad` はこのランクの勾配のままです "
        "({names} など)。`torch.cat` が作る `flat` はコピーなので、all-reduce の結果は"
        "そこにしか入りません。ヒント: `wait()` のあと、`flat` を切り分けて各 "
        "`q.grad` に書き戻します (`q.grad.copy_(...)`)。",
        "In {step} the gradients were sent ({calls} all-reduce(s), torch's DDP "
        "{ddp_calls}), but `.grad` still holds this rank's own ({names}, for "
        "instance): `torch.cat` makes `flat` a copy, and the all-reduce's result is "
        "only there. Hint: after `wait()`, split `flat` and copy it back into each "
        "`q.grad` (`q.grad.copy_(...)`)."),
    "ex_scratch_counted_in_no_sync": (
        "`no_sync` を使った更新で、同期する逆伝播が all-reduce を 1 回もしません"
        "でした (torch の DDP は {ddp_calls} 回)。`no_sync()` の中でもバケットの"
        "残りを減らしているので、残りが 0 を過ぎてしまいます。ヒント: "
        "`require_sync` が False なら、数える前に戻ります。",
        "In the update with `no_sync`, the synchronized backward made no all-reduce "
        "(torch's DDP made {ddp_calls}): you count gradients off their buckets inside "
        "`no_sync()` too, so the counts go past 0. Hint: while `require_sync` is "
        "False, return before counting."),
    "ex_scratch_in_flight": (
        "`finish_sync()` のあとも、`self.in_flight` に {n} 個が残っています。次の"
        "ステップの `finish_sync` が、前のステップの勾配をもう一度書き戻します "
        "(この確認では毎ステップ同じバッチなので、値は偶然合います)。ヒント: "
        "`finish_sync` の終わりで `self.in_flight = []` とします。",
        "After `finish_sync()`, `self.in_flight` still holds {n} entries: the next "
        "step's `finish_sync` copies the previous steps' gradients back again (the "
        "check feeds the same batch every step, so the values agree by chance). "
        "Hint: end `finish_sync` with `self.in_flight = []`."),
    "ex_scratch_undefined": (
        "ランク {rank} に {name} がありません。先に、それを定義する %%px のセルを"
        "実行してください。",
        "Rank {rank} has no {name}: run the %%px cell that defines it first."),
    "ex_scratch_step": ("{n} ステップ目", "step {n}"),
    "ex_scratch_update": ("`no_sync` を使った更新", "the update with `no_sync`"),
    "ex_scratch_ok": (
        "勾配は torch の DDP と一致し (差 {diff:.1e})、all-reduce も 1 ステップ "
        "{calls} 回で同じです。完了を待つのは逆伝播のあとで、`no_sync()` の中では"
        "送っていません。",
        "The gradients equal torch DDP's (difference {diff:.1e}), {calls} all-reduces "
        "per step as torch's DDP makes, waited for after the backward pass, and none "
        "inside `no_sync()`."),
})

_TOLERANCE = 1e-6


def _judge(where: str, s: dict, world_size: int, check_count: bool,
           record: dict | None = None) -> None:
    """Raise WrongAnswer for the first mistake one step's summary shows; `record`,
    the step's buckets.Timeline record, tells an all-reduce never waited for."""
    if s["waited_before_grads"]:  # a blocking all-reduce counts as waited at once
        raise WrongAnswer("ex_scratch_early", step=where, n=s["waited_before_grads"])
    if s["started_after_grads"]:
        raise WrongAnswer("ex_scratch_late", step=where, n=s["started_after_grads"])
    # Read before it completes, an all-reduce's result is a race the values
    # alone cannot show: it often finishes first and the gradients come out right.
    if record and (n := sum(math.isnan(c["waited"]) for c in record["calls"])):
        raise WrongAnswer("ex_scratch_unwaited", step=where, n=n)
    never = s["unsynced"] + s["missing_grads"]
    if never:
        # Every byte went out, yet .grad holds the local gradient: the result was
        # left in the concatenated copy.
        sent = s["calls"] and s["bytes"] >= s["ddp_bytes"] and not s["missing_grads"]
        raise WrongAnswer("ex_scratch_not_copied" if sent else "ex_scratch_unsent",
                          step=where, names=", ".join(never[:3]), calls=s["calls"],
                          ddp_calls=s["ddp_calls"])
    if s["doubled"]:
        raise WrongAnswer("ex_scratch_sum", step=where, world_size=world_size)
    if check_count and s["calls"] != s["ddp_calls"]:
        raise WrongAnswer("ex_scratch_too_many" if s["calls"] > s["ddp_calls"]
                          else "ex_scratch_too_few", step=where, calls=s["calls"],
                          ddp_calls=s["ddp_calls"])
    if not s["max_diff"] <= _TOLERANCE:
        raise WrongAnswer("ex_scratch_off", step=where, diff=s["max_diff"])


def _compare_defined(name: str) -> dict:
    """Runs on every rank: the class `name` of this rank's %%px namespace, compared."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or name not in shell.user_ns:
        raise NameError(t("ex_scratch_undefined", name=name, rank=dist.get_rank()))
    made = []

    class Watched(shell.user_ns[name]):  # keeps the instance, to look at it after
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    out = from_scratch.compare_with_ddp(Watched)
    # The check feeds the same batch every step, so gradients left in in_flight
    # from a step before are copied back with the right values: only the list shows.
    out["in_flight_left"] = len(getattr(made[0], "in_flight", None) or [])
    return out


def grade_scratch_ddp(ranks: Ranks, name: str = "ScratchDDP") -> None:
    """The class `name`, defined on the ranks by a %%px cell, against torch's DDP.

    The class lives on the ranks, not in the notebook's kernel: a class sent
    from the kernel would have to be pickled by value, which ipyparallel's
    default serializer cannot do for a method that calls `super()`.
    """
    results = ranks.run(_compare_defined, name)
    world_size = ranks.world_size
    for summary in results:
        for i, (step, record) in enumerate(
                zip(summary["steps"], summary["records"], strict=True), start=1):
            # torch's DDP sends one bucket in its first step, then rebuilds them.
            _judge(t("ex_scratch_step", n=i), step, world_size, check_count=i > 1,
                   record=record)
        update = summary["update"]
        if update["calls_in_no_sync"]:
            raise WrongAnswer("ex_scratch_no_sync", n=update["calls_in_no_sync"])
        if update["calls"] == 0 and update["ddp_calls"]:
            raise WrongAnswer("ex_scratch_counted_in_no_sync",
                              ddp_calls=update["ddp_calls"])
        _judge(t("ex_scratch_update"), update, world_size, check_count=True)
        if summary["in_flight_left"]:
            raise WrongAnswer("ex_scratch_in_flight", n=summary["in_flight_left"])
    # Right values and counts, checked first, say more than a missing overlap:
    # one all-reduce for the whole model also overlaps nothing. What is checked
    # is that an all-reduce starts before the last gradient is computed (its
    # hook runs before that gradient's own stamp): the order of the hooks, the
    # same on every run. Whether one is still running when the next gradient is
    # written ("overlapped") depends on the machine's load and the other rank.
    for summary in results:
        for i, record in enumerate(summary["records"], start=1):
            times = record["grad_times"]
            if len(times) > 1 and not any(c["start"] < times[-2]
                                          for c in record["calls"]):
                raise WrongAnswer("ex_scratch_no_overlap",
                                  step=t("ex_scratch_step", n=i),
                                  calls=len(record["calls"]))
    last = results[0]["steps"][-1]
    right("ex_scratch_ok", calls=last["calls"],
          diff=max(s["max_diff"] for r in results for s in [*r["steps"], r["update"]]))


register({  # key: (ja, en)
    "ex_psgd_none": (
        "{case} で None を返しました。バイト数 (整数) を返してください。",
        "For {case} you returned None: return the bytes (an integer)."),
    "ex_psgd_wrong": (
        "{case}、近似ランク r={r} で {got:,} バイトと答えましたが、PowerSGD が"
        "送ったのは {want:,} バイトです。ヒント: {hint}",
        "For {case} at approximation rank r={r} you answered {got:,} bytes; PowerSGD "
        "sent {want:,}. "
        "Hint: {hint}"),
    "ex_psgd_hint_bytes": (
        "値の数ではなくバイト数です。float32 は 1 つ 4 バイトです。",
        "bytes, not values: a float32 takes 4 bytes."),
    "ex_psgd_hint_matrix": (
        "n × m の行列は、P (n × r) と Q (m × r) の 2 つを送ります。",
        "an n × m matrix is sent as P (n × r) and Q (m × r)."),
    "ex_psgd_hint_vector": (
        "1 次元のテンソル (バイアス) は圧縮されず、そのまま送られます。",
        "a 1-D tensor (a bias) is not compressed: it is sent as it is."),
    "ex_psgd_hint_rate": (
        "圧縮しても値が半分にならない行列 ((n + m) × r × 2 が n × m 以上) は、"
        "圧縮せずにそのまま送られます (min_compression_rate = 2)。",
        "a matrix that compression would not halve ((n + m) × r × 2 not below "
        "n × m) is sent uncompressed (min_compression_rate = 2)."),
    "ex_psgd_hint_view": (
        "2 次元より多いテンソルは、(shape[0], 残りの積) の行列として扱われます。",
        "a tensor of more than 2 dimensions is treated as the matrix "
        "(shape[0], product of the rest)."),
    "ex_psgd_hint_boundary": (
        "(n + m) × r × 2 が n × m にちょうど等しい行列は、圧縮しても値がちょうど半分に"
        "なるだけなので、圧縮されません。torch が圧縮するのは、半分より少なくなるとき"
        "だけです (`compressed_size * min_compression_rate < uncompressed_size`)。",
        "a matrix where (n + m) × r × 2 equals n × m exactly would only be halved, so "
        "it is not compressed: torch compresses only to less than half "
        "(`compressed_size * min_compression_rate < uncompressed_size`)."),
    "ex_psgd_ok": (
        "{n} 通りの層と近似ランクの組で、PowerSGD が 1 ステップに送るバイト数を"
        "当てました。",
        "You predicted the bytes PowerSGD sends per step for {n} pairs of layers "
        "and approximation ranks."),
})

_MLP = [(1024, 10), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,), (10, 1024),
        (10,)]  # lesson 06's large MLP (send_less.large_config)
# Each case adds one rule to the ones before it, so the first that fails names it.
_CASES = [
    ("ex_psgd_hint_matrix", "1024 × 1024", [(1024, 1024)], 1),
    # r = 3: an answer that leaves r out is then not off by 4, the bytes hint's factor.
    ("ex_psgd_hint_matrix", "1024 × 1024", [(1024, 1024)], 3),
    ("ex_psgd_hint_vector", "Linear(1024, 1024)", [(1024, 1024), (1024,)], 2),
    ("ex_psgd_hint_rate", "Linear(1024, 10)", [(10, 1024), (10,)], 8),
    # (8 + 8) × 2 × 2 == 8 × 8: exactly halved, so sent whole (`<`, not `<=`).
    ("ex_psgd_hint_boundary", "Linear(8, 8)", [(8, 8), (8,)], 2),
    ("ex_psgd_hint_view", "Conv2d(64, 32, 3)", [(32, 64, 3, 3), (32,)], 4),
    ("ex_psgd_hint_rate", "MLP 10-1024-1024-1024-10", _MLP, 1),
    ("ex_psgd_hint_rate", "MLP 10-1024-1024-1024-10", _MLP, 8),
]


class _Layers(nn.Module):
    """Parameters of the given shapes, each with a gradient from the forward pass."""

    def __init__(self, shapes):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, x):
        return sum((w * torch.randn_like(w)).sum() for w in self.weights) * x


def _powersgd_trial(shapes, r: int) -> int:
    """Runs on every rank: the bytes PowerSGD all-reduces in a step past its warm-up."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..comm_counting import CollectiveLog
    from ..send_less import ONE_BUCKET_MB

    torch.manual_seed(dist.get_rank())
    model = DDP(_Layers(shapes), bucket_cap_mb=ONE_BUCKET_MB)
    state = powersgd.PowerSGDState(None, matrix_approximation_rank=r,
                                   start_powerSGD_iter=2)
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    with CollectiveLog() as sent:
        for _ in range(4):
            sent.reset()
            model(torch.ones(())).backward()
    return sent.nbytes("all_reduce")


def grade_powersgd_bytes(ranks: Ranks, fn) -> None:
    """`fn(shapes, r)`: the bytes PowerSGD sends per step, measured on the ranks."""
    for hint, case, shapes, r in _CASES:
        got = fn(list(shapes), r)  # a copy: the cases serve the next call too
        if got is None:
            raise WrongAnswer("ex_psgd_none", case=case)
        want = ranks.run(_powersgd_trial, shapes, r)[0]
        if got != want:
            if got * 4 == want:
                hint = "ex_psgd_hint_bytes"
            raise WrongAnswer("ex_psgd_wrong", hint, case=case, r=r, got=got, want=want)
    right("ex_psgd_ok", n=len(_CASES))


register({  # key: (ja, en)
    "ex_buckets_none": (
        "{case} で None を返しました。all-reduce の回数 (整数) を返してください。",
        "For {case} you returned None: return the number of all-reduces."),
    "ex_buckets_wrong": (
        "{case} で {got} と答えましたが、DDP は 1 ステップに {want} 回 all-reduce "
        "しました。ヒント: {hint}",
        "For {case} you answered {got}, but DDP made {want} all-reduces per step. "
        "Hint: {hint}"),
    "ex_buckets_hint_order": (
        "バケットは勾配ができる順、つまりパラメータの逆順に詰めます。",
        "buckets fill in the order the gradients come: the parameters' reverse "
        "order."),
    "ex_buckets_hint_first": (
        "bucket_cap_mb=None (既定) では、最初のバケットだけ上限が 1 MiB です。",
        "with bucket_cap_mb=None (the default), the first bucket's cap is 1 MiB."),
    "ex_buckets_hint_first_given": (
        "bucket_cap_mb に数を渡すと、最初のバケットの上限もその数です。最初のバケットが"
        " 1 MiB になるのは、bucket_cap_mb=None (既定) のときだけです。",
        "with a number for bucket_cap_mb, the first bucket has that cap too; the "
        "1 MiB first bucket comes only with bucket_cap_mb=None (the default)."),
    "ex_buckets_hint_mib": (
        "ここでの MB は 1024 × 1024 バイト (MiB) です (torch の _MB_TO_BYTES)。",
        "a MB here is 1024 × 1024 bytes (torch's _MB_TO_BYTES)."),
    "ex_buckets_hint_close": (
        "バケットは、入れたパラメータで上限に達した (上限以上になった) 時点で"
        "閉じます。",
        "a bucket closes as soon as the parameter just added makes it reach the cap "
        "(at least the cap)."),
    "ex_buckets_hint_rule": (
        "逆順にパラメータを入れていき、上限以上になったらバケットを閉じて次を始めます。"
        "最後の閉じていないバケットも 1 回と数えます。",
        "add the parameters in reverse order and close the bucket once it holds at "
        "least the cap; the last, unclosed bucket counts too."),
    "ex_buckets_case": ("パラメータ {sizes} バイト、bucket_cap_mb={cap}",
                        "parameters of {sizes} bytes, bucket_cap_mb={cap}"),
    "ex_buckets_ok": (
        "{n} 通りのモデルと上限で、DDP の 1 ステップの all-reduce の回数を当てました。",
        "You predicted DDP's all-reduces per step for {n} models and caps."),
})

_MIB = 2**20
# (parameter bytes in model order, bucket_cap_mb): each wrong rule below gets at
# least one of them wrong.
_BUCKET_CASES = [
    ([40, 4 * _MIB, 40, 3 * _MIB, 400, 400], None),
    ([3 * _MIB, 1000, 2 * _MIB, 1000, 2 * _MIB], 4),
    ([_MIB, _MIB, _MIB, _MIB], 1),
    ([600_000, 600_000, 600_000, 600_000], 1),
    ([5 * _MIB, 100, 100, 100, 30 * _MIB, 100], None),
    ([2_000_000] * 6, 4),
    ([_MIB, 3 * _MIB // 2], 2),  # a given cap holds for the first bucket too
]


def _buckets_by_rule(param_bytes, cap_mb, *, reverse=True, first=True, mib=_MIB,
                     reach=True, first_always=False, close_before=False) -> int:
    """DDP's bucket count by its rule, or by one of the typical wrong rules."""
    cap = (25 if cap_mb is None else cap_mb) * mib
    limits = [_MIB if (cap_mb is None or first_always) and first else cap]
    count, size, holding = 0, 0, False
    for nbytes in (param_bytes[::-1] if reverse else param_bytes):
        # A rule often written: a parameter that would overflow starts a new bucket.
        if close_before and holding and size + nbytes > (
                limits[0] if count == 0 else cap):
            count, size = count + 1, 0
        size, holding = size + nbytes, True
        limit = limits[0] if count == 0 else cap
        if not close_before and (size >= limit if reach else size > limit):
            count, size, holding = count + 1, 0, False
    return count + holding


_WRONG_RULES = [("ex_buckets_hint_order", {"reverse": False}),
                ("ex_buckets_hint_first", {"first": False}),
                ("ex_buckets_hint_mib", {"mib": 10**6}),
                ("ex_buckets_hint_close", {"reach": False}),
                ("ex_buckets_hint_first_given", {"first_always": True}),
                ("ex_buckets_hint_close", {"close_before": True})]


class _Chain(nn.Module):
    """1-D parameters of the given bytes, used one after the other."""

    def __init__(self, param_bytes):
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(b // 4))
                                       for b in param_bytes)

    def forward(self, x):
        for p in self.params:
            x = x + p.sum()
        return x


def _bucket_trial(param_bytes, cap_mb) -> int:
    """Runs on every rank: DDP's all-reduces in step 3, after its rebuild."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..comm_counting import CommCounter

    model = DDP(_Chain(param_bytes), bucket_cap_mb=cap_mb)
    counter = CommCounter().attach(model)
    for _ in range(3):
        counter.reset()
        model(torch.ones(1)).sum().backward()
    return counter.calls


def grade_bucket_count(ranks: Ranks, fn) -> None:
    """`fn(param_bytes, bucket_cap_mb)`: DDP's all-reduces per step, on the ranks."""
    answers = []
    for param_bytes, cap_mb in _BUCKET_CASES:
        got = fn(list(param_bytes), cap_mb)
        if got is None:
            raise WrongAnswer("ex_buckets_none", case=t("ex_buckets_case",
                                                        sizes=param_bytes, cap=cap_mb))
        answers.append(got)
    for got, (param_bytes, cap_mb) in zip(answers, _BUCKET_CASES, strict=True):
        want = ranks.run(_bucket_trial, param_bytes, cap_mb)[0]
        if got != want:
            hint = next((key for key, wrong in _WRONG_RULES
                         if [_buckets_by_rule(b, c, **wrong) for b, c in _BUCKET_CASES]
                         == answers), "ex_buckets_hint_rule")
            raise WrongAnswer("ex_buckets_wrong", hint, got=got, want=want,
                              case=t("ex_buckets_case", sizes=param_bytes, cap=cap_mb))
    right("ex_buckets_ok", n=len(_BUCKET_CASES))
