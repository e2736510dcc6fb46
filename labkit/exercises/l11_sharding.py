"""Lesson 12 (ZeRO by hand): stage 2's gradient reduce-scatter, a ZeRO-3 layer freeing.

Messages beside each grader; how a grader answers: labkit.exercises.feedback.
`_..._trial` functions run on the ranks. The truth is computed, not written
down: the shard of the mean is averaged here, in the kernel, from the same
seeded gradients the ranks get; a ZeRO-3 layer's memory is measured on the
ranks. The wrong answers the checks compare with serve only to name the
mistake in a hint. The byte predictions (lesson 13's exercises):
l11_predicted_bytes.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import models, sharding
from ..i18n import t
from .feedback import WrongAnswer, register, right

if TYPE_CHECKING:
    from ..cluster import Ranks

__all__ = ["grade_gradient_shard", "grade_zero3_frees"]

register({  # key: (ja, en)
    "ex_rs_undefined": (
        "ランク {rank} に {name} がありません。先に、それを定義する %%px のセルを"
        "実行してください。",
        "Rank {rank} has no {name}: run the %%px cell that defines it first."),
    "ex_rs_span": ("{first}〜{last}", "{first} to {last}"),
    "ex_rs_case": ("ランク {rank} の {numel} 要素の勾配",
                   "a gradient of {numel} values on rank {rank}"),
    "ex_rs_nothing_returned": (
        "{case}で、何も返していません (None)。`flat_grad` は書き換わっています。"
        "ヒント: 勾配をその場で平均しても、呼び出し側が受け取るのは返した値だけです。"
        "このランクのシャードを新しいテンソルとして `return` します。",
        "For {case} you return nothing (None), though `flat_grad` was changed. "
        "Hint: averaging the gradient in place does not hand it back: the caller "
        "gets what you return. Return this rank's shard as a new tensor."),
    "ex_rs_not_tensor": (
        "{case}で返したのは {kind} です。ヒント: シャードはテンソルで返します。",
        "For {case} you return a {kind}. Hint: return the shard as a tensor."),
    "ex_rs_whole_mean": (
        "{case}で、平均した勾配の全体 ({numel} 要素) を返しています。ヒント: "
        "ステージ 2 で各ランクが持つのは自分のシャード ({k} 要素) だけです。"
        "reduce-scatter はちょうどそれを各ランクに渡します。",
        "For {case} you return the whole averaged gradient ({numel} values). Hint: "
        "under stage 2 a rank keeps only its shard ({k} values), which is exactly "
        "what a reduce-scatter hands each rank."),
    "ex_rs_whole": (
        "{case}で、勾配と同じ {numel} 要素を返しています。ヒント: シャードは "
        "numel ÷ world_size = {k} 要素です。",
        "For {case} you return {numel} values, the whole gradient's length. Hint: a "
        "shard holds numel ÷ world_size = {k} values."),
    "ex_rs_size": (
        "{case}で、{got} 要素を返しています。ヒント: シャードは "
        "numel ÷ world_size = {k} 要素です。",
        "For {case} you return {got} values. Hint: a shard holds "
        "numel ÷ world_size = {k} values."),
    "ex_rs_sum": (
        "{case}で、シャードが平均のちょうど {n} 倍、つまりランクの和です。ヒント: "
        "reduce-scatter は既定で足し合わせます (ReduceOp.SUM)。world_size で割るか、"
        "`op=dist.ReduceOp.AVG` を渡します (gloo でも使えます)。",
        "For {case} the shard is exactly {n} times the mean: the ranks' sum. Hint: "
        "a reduce-scatter adds up by default (ReduceOp.SUM); divide by world_size, "
        "or pass `op=dist.ReduceOp.AVG` (gloo has it too)."),
    "ex_rs_divisor": (
        "{case}で、シャードがランクの和を {d:.4g} で割った値です。ヒント: ランク間の"
        "平均は、和をランクの数 world_size = {n} で割って求めます。",
        "For {case} the shard is the ranks' sum divided by {d:.4g}. Hint: the mean "
        "over the ranks divides the sum by the number of ranks, world_size = {n}."),
    "ex_rs_other_shard": (
        "ランク {rank} が、ランク {other} のシャード (平均の {values} 番目の値) "
        "を返しています ({numel} 要素の勾配)。ヒント: ランク r のシャードは、平坦化"
        "した勾配の r × k 番目から (r + 1) × k − 1 番目までです (k = numel ÷ "
        "world_size)。平坦化した勾配全体を reduce-scatter すれば、各ランクに自分の"
        "シャードが届きます。",
        "Rank {rank} returns rank {other}'s shard (values {values} of the "
        "mean) of a gradient of {numel} values. Hint: rank r's shard is values "
        "r × k to (r + 1) × k − 1 of the flat gradient (k = numel ÷ world_size); a "
        "reduce-scatter of the whole flat gradient hands each rank its own."),
    "ex_rs_shifted": (
        "ランク {rank} のシャードが {shift:+d} 要素ずれています。平均の {values} "
        "番目の値で、正しくは {want} 番目です ({numel} 要素の勾配)。"
        "ヒント: ランク r のシャードは r × k 番目から始まり、k 要素です "
        "(k = numel ÷ world_size、Python のスライスでは `[r * k:(r + 1) * k]`)。",
        "Rank {rank}'s shard is {shift:+d} value(s) off: values {values} of the "
        "mean, not {want} (a gradient of {numel} values). "
        "Hint: rank r's shard starts at value r × k and holds k values "
        "(k = numel ÷ world_size; as a slice, `[r * k:(r + 1) * k]`)."),
    "ex_rs_local": (
        "{case}で、シャードにこのランクの勾配しか入っていません。ほかのランクの勾配が"
        "足されていません。ヒント: reduce-scatter の出力 (第 1 引数) に全ランクの和が"
        "入ります。`flat_grad` を切り出すのではなく、それを (平均にして) 返します。",
        "For {case} the shard holds this rank's own gradient only: the other ranks' "
        "are not added in. Hint: the reduce-scatter writes the ranks' sum into its "
        "output (its first argument); return that (averaged), not a slice of "
        "`flat_grad`."),
    "ex_rs_not_waited": (
        "{case}で、非同期の reduce-scatter (`async_op=True`) を待たずにシャードを"
        "返しています。ヒント: 返された work の `wait()` を呼んでから出力を読みます。"
        "gloo の reduce-scatter は、`wait()` の中で出力に結果を書きます。",
        "For {case} you return the shard without waiting for the asynchronous "
        "reduce-scatter (`async_op=True`). Hint: call `wait()` on the work it "
        "returns before reading the output: gloo's reduce-scatter writes the result "
        "into it in `wait()`."),
    "ex_rs_off": (
        "{case}で、シャードが正解と最大 {diff:.1e} 違います。ヒント: ランク r の"
        "シャードは、全ランクの平坦化した勾配の r × k 番目から (r + 1) × k − 1 "
        "番目までの平均です (k = numel ÷ world_size)。",
        "For {case} the shard is off by up to {diff:.1e}. Hint: rank r's shard is "
        "the mean over the ranks of values r × k to (r + 1) × k − 1 of their flat "
        "gradients (k = numel ÷ world_size)."),
    "ex_rs_all_reduce": (
        "値は合っていますが、all-reduce を {count} 回使っています。all-reduce "
        "のあと、各ランクは平均した勾配の全体 ({nbytes:,} バイト) を受け取って"
        "持つので、勾配のメモリは DDP と同じです。ヒント: all-reduce は "
        "reduce-scatter と all-gather を続けたものです。ステージ 2 に要るのは前半だけ"
        "です: `dist.reduce_scatter_single(shard, flat_grad)`。",
        "The values are right, but you use {count} all-reduce(s): afterwards every "
        "rank receives and holds the whole averaged gradient ({nbytes:,} bytes), "
        "DDP's memory for gradients. Hint: an all-reduce is a reduce-scatter "
        "followed by an all-gather, and stage 2 needs only the first half: "
        "`dist.reduce_scatter_single(shard, flat_grad)`."),
    "ex_rs_unseen": (
        "値は合っていますが、`dist.reduce_scatter_single` の呼び出しが記録されません"
        "でした (記録した集団通信: {ops})。この確認が数えるのは "
        "`dist.all_reduce`、`dist.broadcast`、`dist.reduce_scatter_single`、"
        "`dist.all_gather_single` です。ヒント: 平坦化した勾配全体を 1 回の "
        "`dist.reduce_scatter_single(shard, flat_grad)` で送ります "
        "(以前の torch の名前は `reduce_scatter_tensor` です)。",
        "The values are right, but no call of `dist.reduce_scatter_single` was seen "
        "(collectives recorded: {ops}); the check counts `dist.all_reduce`, "
        "`dist.broadcast`, `dist.reduce_scatter_single` and "
        "`dist.all_gather_single`. Hint: send the whole flat gradient in one "
        "`dist.reduce_scatter_single(shard, flat_grad)` (older torch names it "
        "`reduce_scatter_tensor`)."),
    "ex_rs_many": (
        "値は合っていますが、1 つの勾配に reduce-scatter を {count} 回使っています。"
        "ヒント: 平坦化した勾配全体を 1 回で送ります。1 回ごとに、固定の遅延 "
        "(レッスン 05 の α) がかかります。",
        "The values are right, but you make {count} reduce-scatters for one "
        "gradient. Hint: send the whole flat gradient in one; every call pays the "
        "fixed latency again (lesson 05's α)."),
    "ex_rs_extra": (
        "値は合っていますが、reduce-scatter のほかにも集団通信をしています ({ops})。"
        "ヒント: シャードの平均は reduce-scatter 1 回で手に入ります。",
        "The values are right, but besides the reduce-scatter you call other "
        "collectives ({ops}). Hint: one reduce-scatter alone gives the shard's "
        "mean."),
    "ex_rs_view": (
        "値は合っていますが、返したシャードは {held:,} バイトのバッファの一部 "
        "(ビュー) です。シャード自体は {nbytes:,} バイトなのに、勾配全体のメモリが"
        "残り続けるので、何も節約できません。ヒント: 新しいテンソルを返します: "
        "`torch.empty(k)` に reduce-scatter するか、切り出したものを "
        "`.clone()` します。",
        "The values are right, but the shard you return is a view of a buffer of "
        "{held:,} bytes: for a shard of {nbytes:,} bytes, the whole gradient's "
        "memory stays alive, and nothing is saved. Hint: return a new tensor: "
        "reduce-scatter into `torch.empty(k)`, or `.clone()` the slice."),
    "ex_rs_ok": (
        "ランクごとに別の乱数の勾配 ({sizes} 要素) で、どのランクも平均の自分の"
        "シャードを受け取りました。使った集団通信は、平坦化した勾配全体の "
        "reduce-scatter 1 回だけです。",
        "With gradients seeded differently on each rank ({sizes} values), every rank "
        "got its shard of the mean, through one reduce-scatter of the whole flat "
        "gradient and nothing else."),
})

# Shard lengths k the check tries, per rank: the first, large one tells an
# offset of one value from another rank's shard (with k = 1 both are one step).
_SHARD_LENGTHS = (500, 3, 1, 4099)
_TOLERANCE = 1e-6


def _gradient(numel: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s flat gradient of `numel` values: the same in kernel and rank."""
    generator = torch.Generator().manual_seed(1000 * numel + rank)
    return torch.randn(numel, generator=generator)


def _shard_trial(name: str, numels: tuple[int, ...]) -> list[dict]:
    """Runs on every rank: the function `name` of the %%px namespace, called once
    per gradient length, with what it returned, changed and sent."""
    from IPython import get_ipython

    from ..comm_counting import CollectiveLog

    shell = get_ipython()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if shell is None or name not in shell.user_ns:
        raise NameError(t("ex_rs_undefined", name=name, rank=rank))
    fn, out = shell.user_ns[name], []
    for numel in numels:
        flat_grad = _gradient(numel, rank)
        before = flat_grad.clone()
        with CollectiveLog() as log:
            got = fn(flat_grad, rank, world_size)
        tensor = isinstance(got, torch.Tensor)
        out.append({
            "got": got.detach().clone() if tensor else None,
            "kind": type(got).__name__, "changed": not torch.equal(flat_grad, before),
            "ops": [c["op"] for c in log.calls], "bytes": log.nbytes(),
            "unwaited": any(c["async"] and math.isnan(c["waited"]) for c in log.calls),
            "held": sharding.held_bytes([got]) if tensor else 0})
    return out


def _scale(got: torch.Tensor, ref: torch.Tensor) -> float | None:
    """c with got == c × ref (to within the tolerance), or None."""
    if got.shape != ref.shape or not ref.numel():
        return None
    got, ref = got.double(), ref.double()
    c = (got @ ref / (ref @ ref)).item()
    close = (got - c * ref).abs().max() <= _TOLERANCE * max(1.0, ref.abs().max())
    return c if close else None


def _judge_values(got: torch.Tensor, grads: list[torch.Tensor], rank: int) -> None:
    """Raise WrongAnswer naming what `got`, rank `rank`'s answer, holds instead of
    its shard of the mean of `grads` (the ranks' flat gradients)."""
    n, numel = len(grads), grads[0].numel()
    k = numel // n
    mean = torch.stack([g.double() for g in grads]).mean(0)
    case = t("ex_rs_case", numel=numel, rank=rank)
    if got.numel() == numel:
        raise WrongAnswer("ex_rs_whole_mean" if _close(got.flatten(), mean)
                          else "ex_rs_whole",
                          case=case, numel=numel, k=k)
    if got.numel() != k:
        raise WrongAnswer("ex_rs_size", case=case, got=got.numel(), k=k)
    got = got.flatten()
    c = _scale(got, mean[rank * k:(rank + 1) * k])
    if c is not None:
        if abs(c - n) < 1e-6 * n:
            raise WrongAnswer("ex_rs_sum", case=case, n=n)
        raise WrongAnswer("ex_rs_divisor", case=case, d=n / c, n=n)
    for other in range(n):
        if other != rank and _scale(got, mean[other * k:(other + 1) * k]) is not None:
            raise WrongAnswer("ex_rs_other_shard", rank=rank, other=other,
                              values=_span(other * k, k), numel=numel)
    for shift in (-1, 1):
        start = rank * k + shift
        if 0 <= start and start + k <= numel \
                and _scale(got, mean[start:start + k]) is not None:
            raise WrongAnswer("ex_rs_shifted", rank=rank, shift=shift, numel=numel,
                              values=_span(start, k), want=_span(rank * k, k))
    if _scale(got, grads[rank][rank * k:(rank + 1) * k]) is not None:
        raise WrongAnswer("ex_rs_local", case=case)
    diff = (got.double() - mean[rank * k:(rank + 1) * k]).abs().max().item()
    raise WrongAnswer("ex_rs_off", case=case, diff=diff)


def _span(start: int, k: int) -> str:
    """Values `start` to `start + k - 1`, as the lesson's language writes a range."""
    return t("ex_rs_span", first=start, last=start + k - 1)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(
        (got.double() - want.double()).abs().max() <= _TOLERANCE)


def _judge_calls(r: dict) -> None:
    """Raise WrongAnswer if right values came through anything but one reduce-scatter
    of the whole gradient, or sit in a view that keeps the whole buffer alive."""
    ops = r["ops"]
    if "all_reduce" in ops:
        raise WrongAnswer("ex_rs_all_reduce", count=ops.count("all_reduce"),
                          nbytes=r["numel"] * 4)
    if "reduce_scatter" not in ops:
        raise WrongAnswer("ex_rs_unseen", ops=", ".join(ops) or "-")
    if ops.count("reduce_scatter") > 1:
        raise WrongAnswer("ex_rs_many", count=ops.count("reduce_scatter"))
    if len(ops) > 1:
        raise WrongAnswer("ex_rs_extra", ops=", ".join(op for op in ops
                                                        if op != "reduce_scatter"))
    nbytes = r["got"].numel() * r["got"].element_size()
    if r["held"] > nbytes:
        raise WrongAnswer("ex_rs_view", held=r["held"], nbytes=nbytes)


def grade_gradient_shard(ranks: Ranks, name: str = "shard_of_mean_gradient") -> None:
    """The function `name(flat_grad, rank, world_size)`, defined on the ranks by a
    %%px cell: this rank's shard of the gradient averaged over the ranks, by one
    reduce-scatter; tried on gradients of a few lengths, seeded apart by rank."""
    n = ranks.world_size
    numels = tuple(n * k for k in _SHARD_LENGTHS)
    results = ranks.run(_shard_trial, name, numels)
    for i, numel in enumerate(numels):
        grads = [_gradient(numel, rank) for rank in range(n)]
        k = numel // n
        for rank, per_rank in enumerate(results):
            r = per_rank[i] | {"numel": numel}
            case = t("ex_rs_case", numel=numel, rank=rank)
            if r["kind"] == "NoneType":
                if r["changed"]:
                    raise WrongAnswer("ex_rs_nothing_returned", case=case)
                raise WrongAnswer("ex_fill_in", name=f"{name}(...)")
            if r["got"] is None:
                raise WrongAnswer("ex_rs_not_tensor", case=case, kind=r["kind"])
            want = torch.stack([g.double() for g in grads]).mean(0)[rank * k:
                                                                    (rank + 1) * k]
            if not _close(r["got"].flatten(), want) or r["got"].numel() != k:
                if r["unwaited"]:
                    raise WrongAnswer("ex_rs_not_waited", case=case)
                _judge_values(r["got"], grads, rank)
    for per_rank in results:  # values right everywhere: how they came
        for i, numel in enumerate(numels):
            _judge_calls(per_rank[i] | {"numel": numel})
    right("ex_rs_ok", sizes=", ".join(str(numel) for numel in numels))


# --- exercise 3 ---

register({  # key: (ja, en)
    "ex_z3_undefined": (
        "ランク {rank} に {name} がありません。先に、それを定義する %%px のセルを"
        "実行してください。",
        "Rank {rank} has no {name}: run the %%px cell that defines it first."),
    "ex_z3_shard_freed": (
        "{when}のあとで、ランクのシャード (`self.shards`) のメモリがなくなりました。"
        "ヒント: 解放するのは集めたパラメータ `flat.full` だけです。シャードは "
        "Adam が更新し、次に集めるときに送るものなので、持ち続けます。",
        "After the {when}, the rank's shard (`self.shards`) has lost its memory. "
        "Hint: free only the gathered parameters, `flat.full`. The shard is what "
        "Adam updates and what the next gather sends: keep it."),
    "ex_z3_deleted": (
        "{when}のあとで、`flat.full` がなくなりました (`del flat.full`)。ヒント: "
        "`del` は名前を消すだけで、パラメータは `full` のビューなので、メモリは"
        "残ります。そのうえ次の `gather` が `flat.full` を使えません。ストレージの"
        "大きさを 0 にします: `flat.full.untyped_storage().resize_(0)`。",
        "After the {when}, `flat.full` is gone (`del flat.full`). Hint: `del` "
        "removes a name only; the parameters are views of `full`, so its memory "
        "stays, and the next `gather` has no `flat.full` to fill. Resize its "
        "storage to 0: `flat.full.untyped_storage().resize_(0)`."),
    "ex_z3_no_regather": (
        "逆伝播が、解放したパラメータを読もうとして失敗しました ({error})。ヒント: "
        "autograd は順伝播で使った重みを逆伝播のために保存しています。"
        "`after_forward` で、層の出力にフックを付け "
        "(`output.register_hook(lambda grad: self.gather(flat))`)、逆伝播の前に"
        "もう一度集めます。",
        "The backward pass failed reading freed parameters ({error}). Hint: autograd "
        "saved the weights the forward pass used, for the backward pass. In "
        "`after_forward`, put a hook on the layer's output "
        "(`output.register_hook(lambda grad: self.gather(flat))`) that gathers "
        "them again before the backward pass."),
    "ex_z3_error": (
        "{step} ステップ目の{where}でエラーになりました: {error}",
        "Step {step} failed in the {where}: {error}"),
    "ex_z3_forward": ("順伝播", "forward pass"),
    "ex_z3_backward": ("逆伝播", "backward pass"),
    "ex_z3_step": ("オプティマイザのステップ", "optimizer step"),
    "ex_z3_zeroed": (
        "{when}のあとも、集めたパラメータが {nbytes} バイトのメモリを持っています。"
        "値は 0 になっています。ヒント: `zero_()` は値を 0 にするだけで、メモリは"
        "そのままです。ストレージの大きさを 0 にします: "
        "`flat.full.untyped_storage().resize_(0)`。",
        "After the {when}, the gathered parameters still hold {nbytes} bytes, set "
        "to zero. Hint: `zero_()` writes zeros into the memory and keeps it. "
        "Resize the storage to 0: `flat.full.untyped_storage().resize_(0)`."),
    "ex_z3_kept": (
        "{when}のあとも、集めたパラメータが {nbytes} バイトのメモリを持っています "
        "(0 のはずです)。ヒント: {fix}",
        "After the {when}, the gathered parameters still hold {nbytes} bytes "
        "(should be 0). Hint: {fix}"),
    "ex_z3_late": (
        "層の{when}の直後も、その層の集めたパラメータが {nbytes} バイトのメモリを"
        "持っています。あとでまとめて解放すると、それまで全部の層のパラメータを"
        "集めたまま持つので、シャードしていないのと同じです。ヒント: ステージ 3 が"
        "一度に持つのは 1 つの層のパラメータだけです。呼ばれるたびに、受け取った "
        "`flat` をその場で解放します (`flat.full.untyped_storage().resize_(0)`)。",
        "Right after a layer's {when}, its gathered parameters still hold {nbytes} "
        "bytes: freed later, all together, every layer's stay gathered until then, "
        "as if unsharded. Hint: stage 3 holds one layer's parameters at a time: "
        "free the `flat` each call is given, in that call "
        "(`flat.full.untyped_storage().resize_(0)`)."),
    "ex_z3_fix_forward": (
        "`after_forward` でも解放します。`del full` のように名前を消しても、"
        "パラメータが `full` のビューなのでメモリは残ります。"
        "`flat.full.untyped_storage().resize_(0)` で解放します。",
        "free in `after_forward` too. Deleting a name (`del full`) leaves the memory, "
        "which the parameters still view; `flat.full.untyped_storage().resize_(0)` "
        "frees it."),
    "ex_z3_fix_backward": (
        "`after_backward` でも解放します。逆伝播の前に集め直したパラメータは、"
        "勾配を reduce-scatter したあとは要りません。",
        "free in `after_backward` too: the parameters gathered again for the "
        "backward pass are not needed once the gradients are reduce-scattered."),
    "ex_z3_values": (
        "メモリは解放できていますが、{steps} ステップのあとのパラメータが torch の "
        "DDP と違います (最大の差 {diff:.1e})。ヒント: 逆伝播の前に、解放した"
        "パラメータを `self.gather(flat)` で集め直していますか。",
        "The memory is freed, but after {steps} steps the parameters differ from "
        "torch's DDP (by up to {diff:.1e}). Hint: do you gather the freed "
        "parameters again (`self.gather(flat)`) before the backward pass?"),
    "ex_z3_ok": (
        "各層の集めたパラメータは、その層の順伝播と逆伝播の直後に解放されました "
        "(順伝播と逆伝播のあとは 0 バイト)。各ランクが持つのはシャードの {shard} "
        "バイトだけです。{steps} ステップのあとのパラメータは、torch の DDP と"
        "ビット単位で一致します。",
        "Each layer's gathered parameters are freed right after its own forward and "
        "backward pass (0 bytes after each pass); each rank holds only its shards, "
        "{shard} bytes. After {steps} steps the parameters equal torch's DDP's bit "
        "for bit."),
})


class _Broken(Exception):
    """What the learner's method broke, found right after it returned (all ranks)."""


def _zero3_trial(name: str, steps: int) -> dict:
    """Runs on every rank: the class `name` of this rank's %%px namespace, measured."""
    from IPython import get_ipython
    from torch import nn

    shell = get_ipython()
    if shell is None or name not in shell.user_ns:
        return {"undefined": True}

    def intact(trainer, when: str) -> None:
        # Checked before any further collective: a freed shard handed to gloo
        # would be read from a null pointer. Every rank breaks alike.
        if any(not hasattr(flat, "full") for flat in trainer.units):
            raise _Broken("ex_z3_deleted", when)
        if any(s.untyped_storage().nbytes() < s.numel() * s.element_size()
               for s in trainer.shards):
            raise _Broken("ex_z3_shard_freed", when)

    late = {"forward": 0, "backward": 0}  # a layer's bytes right after its own pass

    def freed_at_once(trainer, flat, when: str) -> None:
        # The root's gather spans the whole forward pass: only the others count.
        root = {id(p) for module, params in sharding.shard_units(trainer.model)
                if module is trainer.model for p in params}
        if not any(id(p) in root for p in flat.params):
            late[when] = max(late[when], sharding.held_bytes([flat.full]))

    class Watched(shell.user_ns[name]):
        def after_forward(self, flat, output):
            super().after_forward(flat, output)
            intact(self, "ex_z3_forward")
            freed_at_once(self, flat, "forward")

        def after_backward(self, flat):
            super().after_backward(flat)
            intact(self, "ex_z3_backward")
            freed_at_once(self, flat, "backward")

    rank, world_size = dist.get_rank(), dist.get_world_size()
    loss_fn = nn.CrossEntropyLoss()
    batch, per = 16, 16 // world_size
    mine = slice(rank * per, (rank + 1) * per)
    torch.manual_seed(rank)  # different on each rank: the class must broadcast
    trainer = Watched(models.TiedMLP(), lr=1e-3)
    torch.manual_seed(0)
    reference = nn.parallel.DistributedDataParallel(models.TiedMLP())
    adam = torch.optim.Adam(reference.parameters(), lr=1e-3)
    held = {"forward": [], "backward": []}
    zeroed = {"forward": False, "backward": False}
    fulls = [flat.full for flat in trainer.units]
    where = "ex_z3_forward"

    def measure(when: str) -> None:
        held[when].append(sharding.held_bytes(fulls))
        zeroed[when] |= any(f.untyped_storage().nbytes() and not f.any() for f in fulls)

    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(200 + step)
            X = torch.randint(0, 33, (batch,), generator=g)
            y = torch.randint(0, 33, (batch,), generator=g)
            where = "ex_z3_forward"
            loss = loss_fn(trainer.model(X[mine]), y[mine])
            measure("forward")
            where = "ex_z3_backward"
            loss.backward()
            measure("backward")
            where = "ex_z3_step"
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            loss_fn(reference(X[mine]), y[mine]).backward()
            adam.step()
            adam.zero_grad()
        full = trainer.full_parameters()
    except _Broken as broken:
        return {"broken": broken.args}
    except RuntimeError as err:
        return {"error": str(err).splitlines()[0][:200], "where": where,
                "step": step + 1}
    diff = max((a - b).abs().max().item()
               for a, b in zip(full, reference.module.parameters(), strict=True))
    return {"held": held, "zeroed": zeroed, "late": late, "diff": diff,
            "shard": sharding.held_bytes(trainer.shards)}


def grade_zero3_frees(ranks: Ranks, name: str = "Zero3", steps: int = 3) -> None:
    """The class `name`, defined on the ranks, frees what it gathers, and trains right.

    Measured on the ranks with `sharding.held_bytes`: the gathered parameters
    after each forward and each backward pass (0 bytes once freed), each
    layer's but the root's right after its own pass (freed there, not later),
    the shards kept; the parameters after `steps` steps against torch's DDP from
    the same weights on the same batches (bit for bit on 2 ranks).
    """
    results = ranks.run(_zero3_trial, name, steps)
    for rank, result in enumerate(results):
        if result.get("undefined"):
            raise WrongAnswer("ex_z3_undefined", name=name, rank=rank)
    result = results[0]  # every rank runs the same code on the same shapes
    if "broken" in result:
        key, when = result["broken"]
        raise WrongAnswer(key, when=t(when))
    if "error" in result:
        if result["where"] == "ex_z3_backward" and "storage" in result["error"]:
            raise WrongAnswer("ex_z3_no_regather", error=result["error"])
        raise WrongAnswer("ex_z3_error", step=result["step"], where=t(result["where"]),
                          error=result["error"])
    for when, fix in (("forward", "ex_z3_fix_forward"),
                      ("backward", "ex_z3_fix_backward")):
        kept = max(max(r["held"][when]) for r in results)
        if kept:
            if any(r["zeroed"][when] for r in results):
                raise WrongAnswer("ex_z3_zeroed", when=t(f"ex_z3_{when}"), nbytes=kept)
            raise WrongAnswer("ex_z3_kept", when=t(f"ex_z3_{when}"), nbytes=kept,
                              fix=t(fix))
        late = max(r["late"][when] for r in results)
        if late:
            raise WrongAnswer("ex_z3_late", when=t(f"ex_z3_{when}"), nbytes=late)
    diff = max(r["diff"] for r in results)
    if diff > (0.0 if ranks.world_size == 2 else 1e-6):  # bitwise where exact: 2 ranks
        raise WrongAnswer("ex_z3_values", steps=steps, diff=diff)
    right("ex_z3_ok", shard=result["shard"], steps=steps)
