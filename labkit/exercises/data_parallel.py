"""Lesson 02 (data_parallel): scatter's chunks, and data_parallel by hand.

Messages below; how a grader answers: labkit.exercises.feedback.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from .. import compare, models
from .. import data_parallel as dp
from .feedback import WrongAnswer, off, register, right

__all__ = ['grade_chunk_sizes', 'grade_manual_data_parallel']

register({  # key: (ja, en)
    "ex_chunks": ("バッチ {batch} を {n} 台に分けた結果は {pred} ではありません。"
                  "ヒント: 1 つのチャンクの大きさは「バッチ ÷ 台数」の切り上げで、"
                  "小さくなるのは最後のチャンクだけです。"
                  "チャンクの数が台数より少なくなることもあります。",
                  "Batch {batch} on {n} devices is not split as {pred}. Hint: a "
                  "chunk holds batch / devices, rounded up; only the last is "
                  "smaller, and there can be fewer chunks than devices."),
    "ex_chunks_ok": ("どれも `scatter` の分け方と同じです: {sizes}",
                     "All as `scatter` splits them: {sizes}"),
    "ex_dp_type": ("戻り値が {got} で、テンソルではありません。ヒント: 最後に "
                   "`dp.gather(outputs, 0)` で出力を 1 つにつなぎます。",
                   "It returned {got}, not a tensor. Hint: end with "
                   "`dp.gather(outputs, 0)`, which joins the outputs into one."),
    "ex_dp_shape": ("出力の形が {got} です ({want} のはずです)。ヒント: "
                    "出力はバッチの次元 (dim=0) に沿ってつなぎます。",
                    "The output has shape {got}, not {want}. Hint: join the outputs "
                    "along the batch dimension (dim=0)."),
    "ex_dp_replicas": ("模擬デバイス {n} 台で、レプリカが {replicas} 回、"
                       "もとのモデルが {original} 回呼ばれました。ヒント: "
                       "`dp.replicate` で作ったレプリカを `dp.parallel_apply` で、"
                       "チャンクごとに 1 つずつ動かします。",
                       "On {n} simulated devices the replicas ran {replicas} times, "
                       "the original model {original} times. Hint: run the replicas "
                       "made by `dp.replicate` with `dp.parallel_apply`, one per "
                       "chunk."),
    "ex_dp_hint": ("レプリカは `dp.replicate` で作り、"
                   "チャンク i をレプリカ i に入れます。",
                   "make replicas with `dp.replicate`; chunk i goes to replica i."),
    "ex_dp_ok": ("バッチ / 台数 = {cases} で、出力も勾配も 1 デバイスと同じです。",
                 "Outputs and gradients equal one device's for {cases} (batch / "
                 "devices)."),
})


def grade_chunk_sizes(predicted: dict[tuple[int, int], list[int] | None]) -> None:
    """`predicted[batch, n]`: the sizes of the chunks `scatter` makes on n devices."""
    for (batch, n), sizes in predicted.items():
        if sizes is None:
            raise WrongAnswer("ex_fill_in", name=f"predicted[{batch}, {n}]")
        chunks = dp.scatter(torch.zeros(batch, 1), list(range(n)))
        if list(sizes) != [len(c) for c in chunks]:
            raise WrongAnswer("ex_chunks", batch=batch, n=n, pred=list(sizes))
    right("ex_chunks_ok", sizes=predicted)


def grade_manual_data_parallel(fn: Callable) -> None:
    """`fn(module, X, device_ids)`: data_parallel written as its four steps."""
    torch.manual_seed(0)
    module = models.MLP()
    reference, criterion = copy.deepcopy(module), models.MyLoss()
    ran: list = []  # replicas share the original's hooks: this sees them all
    hook = module.register_forward_hook(lambda m, args, out: ran.append(m))
    cases = [(100, [0, 1]), (10, [0, 1, 2])]
    try:
        for batch, ids in cases:
            X, y = torch.randn(batch, 10), torch.randn(batch, 10)
            module.zero_grad()
            reference.zero_grad()
            ran.clear()
            out = fn(module, X, ids)
            if not isinstance(out, torch.Tensor):
                raise WrongAnswer("ex_dp_type", got=type(out).__name__)
            if out.shape != (batch, 10):
                raise WrongAnswer("ex_dp_shape", got=tuple(out.shape), want=(batch, 10))
            original = sum(m is module for m in ran)
            if original or len(ran) != len(ids):
                raise WrongAnswer("ex_dp_replicas", n=len(ids), original=original,
                                  replicas=len(ran) - original)
            want = reference(X)
            if (diff := (out - want).abs().max().item()) > 1e-6:
                raise off("fn(module, X, device_ids)", diff, "ex_dp_hint")
            criterion(out, y).backward()
            criterion(want, y).backward()
            diff = compare.max_abs_diff(compare.grads(module), compare.grads(reference))
            if diff > 1e-6:
                raise off("module.parameters() .grad", diff, "ex_dp_hint")
    finally:
        hook.remove()
    right("ex_dp_ok", cases=", ".join(f"{b} / {len(ids)}" for b, ids in cases))
