"""Lesson 06 (beyond no_sync): a DDP written from scratch.

Messages below; how a grader answers: labkit.exercises.feedback. The truth is
torch's own DDP on the same model and data (labkit.from_scratch runs both on
every rank); the mistakes are told apart by what the hand-made DDP did: which
gradients stayed local, which all-reduces it made, when it waited for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from .. import from_scratch
from ..i18n import t
from .feedback import WrongAnswer, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ["grade_scratch_ddp"]

register({  # key: (ja, en)
    "ex_scratch_unsent": (
        "{step} で、送られなかった勾配があります ({names} など。all-reduce は "
        "{calls} 回、torch の DDP は {ddp_calls} 回)。ヒント: パラメータの勾配が"
        "できるたびにそのバケットの残りを 1 つ減らし、0 になったらバケットを送ります。"
        "`finish_sync` の終わりで、次のステップのために残りの数を元に戻します。",
        "In {step} some gradients were never sent ({names}, for instance; "
        "{calls} all-reduce(s), torch's DDP made {ddp_calls}). Hint: each time a "
        "parameter's gradient is ready, count it off its bucket, and send the bucket "
        "when none is left; at the end of `finish_sync`, reset the counts for the "
        "next step."),
    "ex_scratch_early": (
        "{step} で、all-reduce の完了を逆伝播の途中で待っています ({n} 回)。"
        "待つあいだ逆伝播が止まるので、通信は計算と重なりません。ヒント: フックでは "
        "`dist.all_reduce(flat, async_op=True)` で始めるだけにし、`wait()` は "
        "`finish_sync` で呼びます。",
        "In {step} you wait for all-reduces during the backward pass ({n} of them): "
        "the backward pass stops while it waits, so nothing overlaps. Hint: in the "
        "hook only start it, `dist.all_reduce(flat, async_op=True)`, and call "
        "`wait()` in `finish_sync`."),
    "ex_scratch_late": (
        "{step} で、all-reduce を {n} 回、勾配の計算が終わってから始めています。"
        "それでは通信が計算と重なりません。ヒント: バケットがそろったら、その場で"
        "フックから送ります。",
        "In {step} you start {n} all-reduce(s) after the gradient computation has "
        "ended, so nothing overlaps. Hint: send each bucket from the hook, as soon as "
        "it is complete."),
    "ex_scratch_sum": (
        "{step} の勾配が、torch の DDP のちょうど {world_size} 倍です。all-reduce は"
        "和を返します。ヒント: `finish_sync` で world size で割って平均にします。",
        "In {step} the gradients are exactly {world_size} times torch DDP's: "
        "all-reduce returns the sum. Hint: divide by the world size in `finish_sync` "
        "to get the mean."),
    "ex_scratch_too_many": (
        "{step} で all-reduce が {calls} 回、torch の DDP は {ddp_calls} 回です。"
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
        "{step} の勾配が torch の DDP と最大 {diff:.1e} 違います。ヒント: バケットの"
        "勾配は、all-reduce が終わってから (`wait()` のあとで) `.grad` に"
        "書き戻します。",
        "In {step} the gradients differ from torch DDP's by up to {diff:.1e}. Hint: "
        "copy a bucket's gradients back into `.grad` after its all-reduce has "
        "finished (after `wait()`)."),
    "ex_scratch_undefined": (
        "ランク {rank} に {name} がありません。先に、それを定義する %%px のセルを"
        "実行してください。",
        "Rank {rank} has no {name}: run the %%px cell that defines it first."),
    "ex_scratch_step": ("{n} ステップ目", "step {n}"),
    "ex_scratch_update": ("`no_sync` を使った更新", "the update with `no_sync`"),
    "ex_scratch_ok": (
        "勾配は torch の DDP と同じ (差 {diff:.1e})、all-reduce は 1 ステップに "
        "{calls} 回で torch の DDP と同じ、待つのは逆伝播のあと、`no_sync()` の中"
        "では送りません。",
        "The gradients equal torch DDP's (difference {diff:.1e}), {calls} all-reduces "
        "per step as torch's DDP makes, waited for after the backward pass, and none "
        "inside `no_sync()`."),
})

_TOLERANCE = 1e-6


def _judge(where: str, s: dict, world_size: int, check_count: bool) -> None:
    """Raise WrongAnswer for the first mistake one step's summary shows."""
    if s["waited_before_grads"]:  # a blocking all-reduce counts as waited at once
        raise WrongAnswer("ex_scratch_early", step=where, n=s["waited_before_grads"])
    if s["started_after_grads"]:
        raise WrongAnswer("ex_scratch_late", step=where, n=s["started_after_grads"])
    never = s["unsynced"] + s["missing_grads"]
    if never:
        raise WrongAnswer("ex_scratch_unsent", step=where, names=", ".join(never[:3]),
                          calls=s["calls"], ddp_calls=s["ddp_calls"])
    if s["doubled"]:
        raise WrongAnswer("ex_scratch_sum", step=where, world_size=world_size)
    if check_count and s["calls"] > s["ddp_calls"]:
        raise WrongAnswer("ex_scratch_too_many", step=where, calls=s["calls"],
                          ddp_calls=s["ddp_calls"])
    if not s["max_diff"] <= _TOLERANCE:
        raise WrongAnswer("ex_scratch_off", step=where, diff=s["max_diff"])


def _compare_defined(name: str) -> dict:
    """Runs on every rank: the class `name` of this rank's %%px namespace, compared."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or name not in shell.user_ns:
        raise NameError(t("ex_scratch_undefined", name=name, rank=dist.get_rank()))
    return from_scratch.compare_with_ddp(shell.user_ns[name])


def grade_scratch_ddp(ranks: Ranks, name: str = "ScratchDDP") -> None:
    """The class `name`, defined on the ranks by a %%px cell, against torch's DDP.

    The class lives on the ranks, not in the notebook's kernel: a class sent
    from the kernel would have to be pickled by value, which ipyparallel's
    default serializer cannot do for a method that calls `super()`.
    """
    results = ranks.run(_compare_defined, name)
    world_size = ranks.world_size
    for summary in results:
        for i, step in enumerate(summary["steps"], start=1):
            # torch's DDP sends one bucket in its first step, then rebuilds them.
            _judge(t("ex_scratch_step", n=i), step, world_size, check_count=i > 1)
        update = summary["update"]
        if update["calls_in_no_sync"]:
            raise WrongAnswer("ex_scratch_no_sync", n=update["calls_in_no_sync"])
        _judge(t("ex_scratch_update"), update, world_size, check_count=True)
    last = results[0]["steps"][-1]
    right("ex_scratch_ok", calls=last["calls"],
          diff=max(s["max_diff"] for r in results for s in [*r["steps"], r["update"]]))
