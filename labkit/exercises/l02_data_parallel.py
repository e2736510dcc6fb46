"""Lesson 02 (data_parallel): scatter's chunks, and data_parallel by hand.

Messages below; how a grader answers: labkit.exercises.feedback.
"""

from __future__ import annotations

import copy
import threading
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
    "ex_chunks_list": ("predicted[{batch}, {n}] = {pred!r} はリストではありません。"
                       "ヒント: チャンクごとの大きさを並べたリストで書きます。"
                       "たとえばバッチ 5 を 4 台なら [2, 2, 1] です。",
                       "predicted[{batch}, {n}] = {pred!r} is not a list. Hint: "
                       "write the size of every chunk, in a list: batch 5 on 4 "
                       "devices is [2, 2, 1]."),
    "ex_chunks_missing": ("予想が {missing} にありません。ヒント: 演習のセルにある"
                          "組をすべて残して、それぞれに答えます。",
                          "There is no prediction for {missing}. Hint: keep every "
                          "pair of the exercise cell and answer each."),
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
    "ex_dp_threads": ("模擬デバイス {n} 台のレプリカが、すべてこのスレッドで順に"
                      "動きました。ヒント: `dp.parallel_apply` は、PyTorch が GPU "
                      "でするように、レプリカごとにスレッドを 1 本立てて動かします。",
                      "On {n} simulated devices every replica ran in this thread, "
                      "one after another. Hint: `dp.parallel_apply` runs each "
                      "replica in a thread of its own, as PyTorch does on GPUs."),
    "ex_dp_whole_batch": ("出力が {got} 行で、バッチの {batch} 行の {k} 倍です。"
                          "ヒント: どのレプリカにもバッチ全体を入れています。"
                          "レプリカ i に入れるのはチャンク i だけです。",
                          "The output has {got} rows, {k} times the batch's {batch}. "
                          "Hint: every replica got the whole batch; replica i gets "
                          "chunk i only."),
    "ex_dp_fewer": ("バッチ {batch} を {n} 台に分けるとチャンクは {chunks} 個で、"
                    "エラーになりました ({err})。ヒント: チャンクの数が台数より少ない"
                    "こともあります。レプリカは `device_ids[:len(chunks)]` の台数分だけ"
                    "作って動かします。",
                    "Batch {batch} on {n} devices makes {chunks} chunks, and it "
                    "failed ({err}). Hint: there can be fewer chunks than devices; "
                    "make and run replicas on `device_ids[:len(chunks)]` only."),
    "ex_dp_hint": ("レプリカは `dp.replicate` で作り、"
                   "チャンク i をレプリカ i に入れます。",
                   "make replicas with `dp.replicate`; chunk i goes to replica i."),
    "ex_dp_ok": ("バッチ / 台数 = {cases} で、出力も勾配も 1 デバイスと同じです。",
                 "Outputs and gradients equal one device's for {cases} (batch / "
                 "devices)."),
})


# Lesson 02's pairs (batch, devices): an even split, a spare device, fewer samples.
CHUNK_CASES = ((7, 3), (6, 4), (2, 4))


def grade_chunk_sizes(predicted: dict[tuple[int, int], list[int] | None]) -> None:
    """`predicted[batch, n]`: the sizes of the chunks `scatter` makes on n devices."""
    for (batch, n), sizes in predicted.items():
        if sizes is None:
            raise WrongAnswer("ex_fill_in", name=f"predicted[{batch}, {n}]")
        if not isinstance(sizes, (list, tuple)):  # e.g. only the size of a chunk
            raise WrongAnswer("ex_chunks_list", batch=batch, n=n, pred=sizes)
        chunks = dp.scatter(torch.zeros(batch, 1), list(range(n)))
        if list(sizes) != [len(c) for c in chunks]:
            raise WrongAnswer("ex_chunks", batch=batch, n=n, pred=list(sizes))
    # A dict without the exercise's pairs would otherwise be "correct" about nothing.
    if missing := [pair for pair in CHUNK_CASES if pair not in predicted]:
        raise WrongAnswer("ex_chunks_missing", missing=", ".join(map(str, missing)))
    right("ex_chunks_ok", sizes=predicted)


def grade_manual_data_parallel(fn: Callable) -> None:
    """`fn(module, X, device_ids)`: data_parallel written as its four steps."""
    torch.manual_seed(0)
    module = models.MLP()
    reference, criterion = copy.deepcopy(module), models.MyLoss()
    ran: list = []  # replicas share the original's hooks: this sees them all
    hook = module.register_forward_hook(
        lambda m, args, out: ran.append((m, threading.current_thread())))
    # 6 on 4 devices makes 3 chunks: a fourth replica has no input.
    cases = [(100, [0, 1]), (10, [0, 1, 2]), (6, [0, 1, 2, 3])]
    try:
        for batch, ids in cases:
            X, y = torch.randn(batch, 10), torch.randn(batch, 10)
            n_chunks = len(X.chunk(len(ids)))
            module.zero_grad()
            reference.zero_grad()
            ran.clear()
            try:
                out = fn(module, X, ids)
            except ValueError as e:
                if n_chunks == len(ids):
                    raise
                raise WrongAnswer("ex_dp_fewer", batch=batch, n=len(ids),
                                  chunks=n_chunks,
                                  err=str(e).splitlines()[0]) from None
            if not isinstance(out, torch.Tensor):
                raise WrongAnswer("ex_dp_type", got=type(out).__name__)
            if (out.dim() == 2 and out.shape[1] == 10 and out.shape[0] > batch
                    and out.shape[0] % batch == 0):
                raise WrongAnswer("ex_dp_whole_batch", got=out.shape[0], batch=batch,
                                  k=out.shape[0] // batch)
            if out.shape != (batch, 10):
                raise WrongAnswer("ex_dp_shape", got=tuple(out.shape), want=(batch, 10))
            original = sum(m is module for m, _ in ran)
            if original or len(ran) != n_chunks:
                raise WrongAnswer("ex_dp_replicas", n=len(ids), original=original,
                                  replicas=len(ran) - original)
            if n_chunks > 1 and all(t is threading.current_thread() for _, t in ran):
                raise WrongAnswer("ex_dp_threads", n=len(ids))
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
