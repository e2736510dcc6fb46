"""Checks of the lessons' exercises: right, or what is wrong and a hint.

A check prints its verdict in the lesson's language when the answer is right,
and raises WrongAnswer (an AssertionError) naming the problem and a hint when
it is not. Checks that take `ranks` run the learner's function on every rank;
the functions named `_..._trial` are what the ranks run.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import comm, ddp, i18n, models, nosync
from . import data as datasets
from . import data_parallel as dp
from .i18n import t

if TYPE_CHECKING:
    from .cluster import Ranks

__all__ = [
    "WrongAnswer",
    "check_accumulation",
    "check_allreduce_prediction",
    "check_average_gradients",
    "check_chunk_sizes",
    "check_keeps_batch",
    "check_manual_data_parallel",
    "check_replicas_agree",
    "check_set_epoch",
    "check_step_prediction",
    "check_train_step",
]

_MESSAGES = {  # key: (ja, en)
    "ex_right": ("✓ 正解です。", "✓ Correct. "),
    "ex_not_yet": ("まだです。", "Not yet. "),
    "ex_off": ("{what} が正解と最大 {diff:.1e} 違います。ヒント: {hint}",
               "{what} is off by up to {diff:.1e}. Hint: {hint}"),
    "ex_value_off": ("{name} = {got:.4g} 秒はモデルの値と違います。ヒント: {hint}",
                     "{name} = {got:.4g} s is not the model's value. Hint: {hint}"),
    "ex_fill_in": ("{name} がまだ None です。自分の答えに置き換えてください。",
                   "{name} is still None: put your answer there."),
    "ex_units": ("{name} はミリ秒の値のようです。答えは秒で書きます。",
                 "{name} looks like milliseconds: answer in seconds."),
    # 01
    "ex_batch": ("形 {shape} の入力の出力が {got} です ({want} のはずです)。ヒント: "
                 "平らにするのは各サンプルだけで、バッチの次元 (0) は残します。",
                 "An input of shape {shape} gives an output of shape {got}, not "
                 "{want}. Hint: flatten each sample only; keep the batch dimension "
                 "(0)."),
    "ex_batch_error": ("形 {shape} の入力でエラーになりました ({err})。ヒント: "
                       "`x.view(-1)` はバッチ全体を 1 本のベクトルにします。"
                       "平らにするのは各サンプルだけです。",
                       "An input of shape {shape} fails ({err}). Hint: `x.view(-1)` "
                       "makes the whole batch one vector; flatten each sample only."),
    "ex_batch_fix": ("変えるのは `view(-1)` の行だけです。",
                     "change the `view(-1)` line only."),
    "ex_batch_ok": ("形 {shapes} のどの入力でも、直したモデルと同じ出力です。",
                    "Inputs of shapes {shapes} all give the corrected model's output."),
    "ex_no_backward": ("勾配が None のままです。ヒント: `loss.backward()` "
                       "と括弧を付けます。",
                       "The gradients stay None. Hint: call `loss.backward()`."),
    "ex_no_step": ("パラメータが変わっていません。ヒント: 最後に `optimizer.step()` "
                   "を呼びます。",
                   "The parameters did not change. Hint: end with `optimizer.step()`."),
    "ex_no_zero_grad": (
        "1 回目の更新は正しいのですが、{step} 回目が違います。ヒント: `.grad` "
        "に前の更新の勾配が残っていて、backward() はそこに足します。毎回、最初に "
        "`optimizer.zero_grad()` を呼びます。",
        "Update 1 is right, update {step} is not. Hint: `.grad` still holds the "
        "previous update's gradient and backward() adds to it; start every update "
        "with `optimizer.zero_grad()`."),
    "ex_order_step": ("zero_grad() → 順伝播 → 損失 → backward() → step() の順です。",
                      "zero_grad() → forward → loss → backward() → step()."),
    "ex_train_ok": ("{steps} 回の更新が正しい SGD と一致しました。",
                    "{steps} updates match correct SGD."),
    # 02
    "ex_chunks": ("バッチ {batch} を {n} 台に分けた結果は {pred} ではありません。"
                  "ヒント: 1 つの塊の大きさは「バッチ ÷ 台数」の切り上げで、"
                  "小さくなるのは最後の塊だけです。"
                  "塊の数が台数より少なくなることもあります。",
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
                       "塊ごとに 1 つずつ動かします。",
                       "On {n} simulated devices the replicas ran {replicas} times, "
                       "the original model {original} times. Hint: run the replicas "
                       "made by `dp.replicate` with `dp.parallel_apply`, one per "
                       "chunk."),
    "ex_dp_hint": ("レプリカは `dp.replicate` で作り、塊 i をレプリカ i に入れます。",
                   "make replicas with `dp.replicate`; chunk i goes to replica i."),
    "ex_dp_ok": ("バッチ / 台数 = {cases} で、出力も勾配も 1 デバイスと同じです。",
                 "Outputs and gradients equal one device's for {cases} (batch / "
                 "devices)."),
    # 03
    "ex_epochs": ("エポック {epoch} で、ランクの添字が重なっているか、"
                  "欠けているサンプルがあります。ヒント: 全ランクが同じ `seed` "
                  "と同じエポック番号を使えば、1 つの並びを重ならずに分け合います。",
                  "In epoch {epoch} the ranks' indices overlap or miss samples. "
                  "Hint: with the same `seed` and the same epoch number on every "
                  "rank, the ranks share one order without overlap."),
    "ex_repeats": ("エポック {a} と {b} の並びが同じです。ヒント: 各エポックの初めに "
                   "`sampler.set_epoch(epoch)` を呼びます。",
                   "Epochs {a} and {b} have the same order. Hint: call "
                   "`sampler.set_epoch(epoch)` at the start of each epoch."),
    "ex_epochs_ok": ("どのエポックでも、ランクは全 {n} サンプルを重ならずに分け合い、"
                     "並びはエポックごとに変わりました。",
                     "In every epoch the ranks share all {n} samples without "
                     "overlap, and the order changes from epoch to epoch."),
    "ex_grads_apart": ("ランクの勾配が {diff:.1e} 違います。各ランクの `.grad` は、"
                       "まだ自分の分のデータの勾配です。ヒント: 各パラメータの "
                       "`p.grad` そのものを `dist.all_reduce` します (コピーを "
                       "all-reduce しても `p.grad` は変わりません)。",
                       "The ranks' gradients differ by {diff:.1e}: each `.grad` "
                       "still holds its own share's gradient. Hint: all-reduce each "
                       "parameter's `p.grad` itself (all-reducing a copy leaves "
                       "`p.grad` as it was)."),
    "ex_grads_summed": (
        "勾配が全体バッチの勾配のちょうど {ratio:.0f} 倍です。ヒント: all-reduce "
        "は全ランクの値を足し合わせます。平均にするには world size で割ります。",
        "The gradients are exactly {ratio:.0f} times the whole batch's. Hint: "
        "all-reduce adds up the ranks' values; divide by the world size for their "
        "mean."),
    "ex_mean_hint": ("平均 = 全ランクの和 ÷ world size です。",
                     "the mean is the ranks' sum divided by the world size."),
    "ex_grads_ok": ("どのランクの勾配も、全体バッチの勾配と同じになりました。DDP "
                    "が逆伝播の中で行っていることです。",
                    "Every rank's gradient equals the whole batch's: what DDP does "
                    "during backward."),
    # 04
    "ex_steps": (
        "1 回の更新で `optimizer.step()` が {steps} 回呼ばれました。ヒント: `step()` "
        "は、最後のマイクロバッチで同期したあとに 1 回だけ呼びます。`no_sync` の中で "
        "`step()` すると、レプリカがずれます。",
        "`optimizer.step()` ran {steps} times in one update. Hint: call `step()` "
        "once, after the last micro-batch has synchronized; a `step()` inside "
        "`no_sync` splits the replicas."),
    "ex_no_sync_at_all": ("all-reduce が 1 回もありません。ヒント: "
                          "最後のマイクロバッチは `no_sync` "
                          "の外で順伝播と逆伝播をします。",
                          "No all-reduce ran. Hint: the last micro-batch runs "
                          "forward and backward outside `no_sync`."),
    "ex_sync_every": ("1 回の更新で all-reduce が {calls} 回起きました (1 "
                      "回のはずです)。ヒント: 最初の K−1 個のマイクロバッチは、"
                      "順伝播も逆伝播も `with model.no_sync():` の中で行います。",
                      "An update ran {calls} all-reduces, not 1. Hint: the first K−1 "
                      "micro-batches run both forward and backward inside `with "
                      "model.no_sync():`."),
    "ex_apart": ("{step} 回目の更新で、ランクのパラメータが {diff:.1e} ずれました。"
                 "ヒント: `step()` の前に全ランクの勾配がそろっている必要があります。"
                 "同期させるのは最後のマイクロバッチです。",
                 "Update {step} left the ranks' parameters {diff:.1e} apart. Hint: "
                 "every rank needs the same gradient before `step()`; the last "
                 "micro-batch is the one to synchronize."),
    "ex_not_divided": ("更新の大きさが、K 倍のバッチでの更新の {ratio:.1f} 倍です。"
                       "ヒント: 各マイクロバッチの損失を K で割ります。",
                       "The update is {ratio:.1f} times the K-times batch's. Hint: "
                       "divide each micro-batch's loss by K."),
    "ex_order_accum": ("zero_grad()、K−1 個を no_sync の中、最後の 1 個を外、step()。",
                       "zero_grad(), K−1 inside no_sync, the last outside, step()."),
    "ex_accum_ok": ("{updates} 回の更新のどれでも、all-reduce は 1 回、"
                    "レプリカは一致し、K 倍のバッチで 1 回更新したのと同じ結果です。",
                    "In all {updates} updates: one all-reduce, identical replicas, "
                    "and the same result as one update on the K-times batch."),
    "ex_lr_apart": ("ランクの学習率が違います ({lrs})。ヒント: `scheduler.step()` "
                    "も全ランクで呼びます。`if rank == 0:` の中に置くのは、"
                    "記録や保存のようにパラメータを変えない処理だけです。",
                    "The ranks' learning rates differ ({lrs}). Hint: every rank "
                    "calls `scheduler.step()`; only work that changes no parameter, "
                    "such as logging and saving, goes under `if rank == 0:`."),
    "ex_train_apart": (
        "ランクのパラメータが {diff:.1e} 違います。ヒント: 全ランクが、"
        "同じ勾配と同じ学習率で、同じ回数だけ `step()` します。",
        "The ranks' parameters differ by {diff:.1e}. Hint: every rank calls `step()` "
        "as often, with the same gradient and learning rate."),
    "ex_only_line": ("直すのは、レプリカをずらしていた行だけです。",
                     "change only the line that split the replicas."),
    "ex_diverge_ok": ("レプリカは一致し、学習率はどのランクも {lr:g} です。",
                      "The replicas agree; every rank ends at learning rate {lr:g}."),
    # 05
    "ex_nosync_once": ("{name} の式では K 回同期しています。ヒント: no_sync では、"
                       "同期は 1 回の更新につき 1 回です。",
                       "{name} synchronizes K times. Hint: with no_sync an update "
                       "synchronizes once."),
    "ex_sync_k": ("{name} の式では同期が 1 回です。ヒント: no_sync を使わなければ、K "
                  "個のマイクロバッチのそれぞれで同期します。",
                  "{name} synchronizes once. Hint: without no_sync each of the K "
                  "micro-batches synchronizes."),
    "ex_forgot_o": ("{name} の式に o がありません。ヒント: 1 回の更新ごとに o が 1 "
                    "回加わります。",
                    "{name} lacks o. Hint: every update adds o once."),
    "ex_forgot_k": ("{name} の式では c が 1 回分です。ヒント: 順伝播と逆伝播は、K "
                    "個のマイクロバッチのそれぞれで行います。",
                    "{name} counts c once. Hint: each of the K micro-batches runs "
                    "forward and backward."),
    "ex_step_hint": ("c が K 回、s が K 回 (no_sync なら 1 回)、o が 1 回です。",
                     "c K times, s K times (once with no_sync), o once."),
    "ex_step_ok": ("K = {K}: 同期あり {sync:.1f} ms、no_sync {nosync:.1f} ms "
                   "の予測です。",
                   "Predicted for K = {K}: sync {sync:.1f} ms, no_sync {nosync:.1f} "
                   "ms."),
    "ex_bytes": ("{name} の式では、パラメータの数をバイト数として使っています。"
                 "ヒント: float32 は 1 つ 4 バイトです。",
                 "{name} takes the number of parameters for bytes. Hint: a float32 "
                 "takes 4 bytes."),
    "ex_ring": ("{name} の式の係数が違います。ヒント: n ランクのリング all-reduce "
                "では、各ランクが S の 2(n−1)/n 倍を送ります。",
                "{name} has a wrong factor. Hint: in a ring all-reduce over n ranks "
                "each rank sends 2(n−1)/n times S."),
    "ex_ab_hint": ("時間 = α + 2(n−1)/n × S / β、S はバイト数です。",
                   "time = alpha + 2(n−1)/n × S / beta, S in bytes."),
    "ex_ab_ok": ("{n} ランクで {ms:.2f} ms の予測です (2 ランクでは {ms2:.2f} ms)。",
                 "The model predicts {ms:.2f} ms on {n} ranks ({ms2:.2f} ms on 2)."),
}
i18n.register({key: {"ja": ja, "en": en} for key, (ja, en) in _MESSAGES.items()})


class WrongAnswer(AssertionError):
    """An answer not right yet; `key` names the message (or the hint) that says why."""

    def __init__(self, key: str, hint: str | None = None, **fields: object):
        self.key = hint or key
        if hint:
            fields["hint"] = t(hint)
        super().__init__(t("ex_not_yet") + t(key, **fields))


def _off(what: str, diff: float, hint: str) -> WrongAnswer:
    """`what` is off the right answer by up to `diff`; `hint` says what to fix."""
    return WrongAnswer("ex_off", hint, what=what, diff=diff)


def _right(key: str, **fields: object) -> None:
    print(t("ex_right") + t(key, **fields))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([x.detach().reshape(-1) for x in tensors])


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return _flat(torch.zeros_like(p) if p.grad is None else p.grad
                 for p in model.parameters())


def _gap(a, b) -> float:
    """Largest difference between two models' parameters."""
    return (_flat(a.parameters()) - _flat(b.parameters())).abs().max().item()


def _apart(x: torch.Tensor) -> float:
    """Largest difference between this rank's `x` and rank 0's (collective)."""
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return max((o - out[0]).abs().max().item() for o in out)


def check_keeps_batch(model_cls: type) -> None:
    """Doc 004's model with `view(-1)` fixed: the output keeps every sample."""
    torch.manual_seed(0)
    model, reference = model_cls(), models.MLP()
    reference.load_state_dict(model.state_dict())
    shapes = [(100, 10), (1, 10), (4, 2, 5)]
    for shape in shapes:
        X = torch.randn(shape)
        want = reference(X)
        try:
            got = model(X)
        except (RuntimeError, ValueError) as e:
            raise WrongAnswer("ex_batch_error", shape=shape,
                              err=str(e).splitlines()[0]) from None
        if got.shape != want.shape:
            raise WrongAnswer("ex_batch", shape=shape, got=tuple(got.shape),
                              want=tuple(want.shape))
        if (diff := (got - want).abs().max().item()) > 1e-6:
            raise _off("model(X)", diff, "ex_batch_fix")
    _right("ex_batch_ok", shapes=", ".join(map(str, shapes)))


def check_train_step(train_step: Callable) -> None:
    """`train_step(model, optimizer, criterion, X, y)`: one correct SGD update."""
    torch.manual_seed(0)
    model = models.MLP()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    criterion, g = models.MyLoss(), torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        X, y = torch.randn(32, 10, generator=g), torch.randn(32, 10, generator=g)
        before = _flat(model.parameters())
        train_step(model, optimizer, criterion, X, y)
        ref_opt.zero_grad()
        criterion(reference(X), y).backward()
        ref_opt.step()
        if all(p.grad is None for p in model.parameters()):
            raise WrongAnswer("ex_no_backward")
        if torch.equal(before, _flat(model.parameters())):
            raise WrongAnswer("ex_no_step")
        if (diff := _gap(model, reference)) > 1e-6:
            if step > 1:
                raise WrongAnswer("ex_no_zero_grad", step=step)
            raise _off("model.parameters()", diff, "ex_order_step")
    _right("ex_train_ok", steps=3)


def check_chunk_sizes(predicted: dict[tuple[int, int], list[int] | None]) -> None:
    """`predicted[batch, n]`: the sizes of the chunks `scatter` makes on n devices."""
    for (batch, n), sizes in predicted.items():
        if sizes is None:
            raise WrongAnswer("ex_fill_in", name=f"predicted[{batch}, {n}]")
        chunks = dp.scatter(torch.zeros(batch, 1), list(range(n)))
        if list(sizes) != [len(c) for c in chunks]:
            raise WrongAnswer("ex_chunks", batch=batch, n=n, pred=list(sizes))
    _right("ex_chunks_ok", sizes=predicted)


def check_manual_data_parallel(fn: Callable) -> None:
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
                raise _off("fn(module, X, device_ids)", diff, "ex_dp_hint")
            criterion(out, y).backward()
            criterion(want, y).backward()
            if (diff := (_grads(module) - _grads(reference)).abs().max().item()) > 1e-6:
                raise _off("module.parameters() .grad", diff, "ex_dp_hint")
    finally:
        hook.remove()
    _right("ex_dp_ok", cases=", ".join(f"{b} / {len(ids)}" for b, ids in cases))


def _epoch_trial(fn: Callable, n: int, num_epochs: int) -> list[list[int]]:
    """Runs on every rank: the learner's index lists, one per epoch."""
    orders = fn(datasets.MyDataset(n=n), dist.get_rank(), dist.get_world_size(),
                num_epochs)
    return [[int(i) for i in order] for order in orders]


def check_set_epoch(ranks: Ranks, fn: Callable, n: int = 16,
                    num_epochs: int = 3) -> None:
    """`fn(dataset, rank, world_size, num_epochs)`: a rank's indices in each epoch."""
    per_rank = ranks.run(_epoch_trial, fn, n, num_epochs)
    for epoch in range(num_epochs):
        seen = [i for orders in per_rank for i in orders[epoch]]
        if len(seen) != n or set(seen) != set(range(n)):
            raise WrongAnswer("ex_epochs", epoch=epoch)
    for b in range(1, num_epochs):
        for a in range(b):
            if all(orders[a] == orders[b] for orders in per_rank):
                raise WrongAnswer("ex_repeats", a=a, b=b)
    _right("ex_epochs_ok", n=n)


def _average_trial(fn: Callable) -> dict:
    """Runs on every rank: its share's gradient averaged by `fn`, vs the whole batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = models.MLP()
    local, criterion = copy.deepcopy(model), models.MyLoss()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 10, generator=g), torch.randn(64, 10, generator=g)
    criterion(model(ddp.shard(X, rank, world_size)),
              ddp.shard(y, rank, world_size)).backward()
    fn(model, world_size)
    criterion(local(X), y).backward()
    grad, want = _grads(model), _grads(local)
    return {"apart": _apart(grad), "diff": (grad - want).abs().max().item(),
            "ratio": (grad @ want / (want @ want)).item()}


def check_average_gradients(ranks: Ranks, fn: Callable) -> None:
    """`fn(model, world_size)`: every `.grad` becomes the mean over the ranks."""
    r = ranks.run(_average_trial, fn)[0]
    if r["apart"] > 0:
        raise WrongAnswer("ex_grads_apart", diff=r["apart"])
    if r["diff"] > 1e-6:
        if abs(r["ratio"] - ranks.world_size) < 1e-3:
            raise WrongAnswer("ex_grads_summed", ratio=r["ratio"])
        raise _off("p.grad", r["diff"], "ex_mean_hint")
    _right("ex_grads_ok")


def _accumulation_trial(fn: Callable, updates: int, accum_steps: int) -> list[dict]:
    """Runs on every rank: each update by `fn` vs one step on the K-times batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = nosync.NoSyncConfig(accum_steps=accum_steps, batch_per_rank=8)
    dataset, criterion = nosync.make_dataset(cfg), models.MyLoss()
    model, counter = nosync.wrap(cfg)
    reference = nosync.make_model(cfg)
    optimizer = nosync.make_optimizer(model, cfg)
    ref_opt = nosync.make_optimizer(reference, cfg)
    steps, step = [0], optimizer.step

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    optimizer.step = counted_step
    out = []
    for u in range(updates):
        (X, y), = nosync.micro_batches(dataset, cfg, u, rank, world_size, whole=True)
        before, ref_before = _flat(model.parameters()), _flat(reference.parameters())
        counter.reset()
        steps[0] = 0
        fn(model, optimizer, criterion,
           nosync.micro_batches(dataset, cfg, u, rank, world_size))
        ref_opt.zero_grad()
        criterion(reference(X), y).backward()
        ref_opt.step()
        moved = (_flat(model.parameters()) - before).norm()
        ref_moved = (_flat(reference.parameters()) - ref_before).norm()
        out.append({"calls": counter.calls, "steps": steps[0],
                    "apart": _apart(_flat(model.parameters())),
                    "diff": _gap(model.module, reference),
                    "ratio": (moved / ref_moved).item()})
    return out


def check_accumulation(ranks: Ranks, fn: Callable, updates: int = 3,
                       accum_steps: int = 4) -> None:
    """`fn(model, optimizer, criterion, batches)`: one update of K micro-batches."""
    results = ranks.run(_accumulation_trial, fn, updates, accum_steps)[0]
    for u, r in enumerate(results, start=1):
        if r["steps"] != 1:
            raise WrongAnswer("ex_steps", steps=r["steps"])
        if r["calls"] == 0:
            raise WrongAnswer("ex_no_sync_at_all")
        if r["calls"] > 1:
            raise WrongAnswer("ex_sync_every", calls=r["calls"])
        if r["apart"] > 0:
            raise WrongAnswer("ex_apart", step=u, diff=r["apart"])
        if r["diff"] > 1e-5:
            if u == 1 and abs(r["ratio"] - accum_steps) < 0.01 * accum_steps:
                raise WrongAnswer("ex_not_divided", ratio=r["ratio"])
            if u > 1:
                raise WrongAnswer("ex_no_zero_grad", step=u)
            raise _off("model.parameters()", r["diff"], "ex_order_accum")
    _right("ex_accum_ok", updates=updates)


def _schedule_trial(fn: Callable, updates: int) -> dict:
    """Runs on every rank: `fn` trains with a halving learning rate; one process too."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = nosync.NoSyncConfig(accum_steps=2, batch_per_rank=8, lr=0.1)
    dataset, criterion = nosync.make_dataset(cfg), models.MyLoss()
    model, _ = nosync.wrap(cfg)
    reference = nosync.make_model(cfg)
    optimizers = [nosync.make_optimizer(m, cfg) for m in (model, reference)]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in optimizers]
    batches = [nosync.micro_batches(dataset, cfg, u, rank, world_size)
               for u in range(updates)]
    fn(model, optimizers[0], schedulers[0], criterion, batches, rank)
    for u in range(updates):
        (X, y), = nosync.micro_batches(dataset, cfg, u, rank, world_size, whole=True)
        optimizers[1].zero_grad()
        criterion(reference(X), y).backward()
        optimizers[1].step()
        schedulers[1].step()
    return {"lr": optimizers[0].param_groups[0]["lr"],
            "apart": _apart(_flat(model.parameters())),
            "diff": _gap(model.module, reference)}


def check_replicas_agree(ranks: Ranks, fn: Callable, updates: int = 6) -> None:
    """`fn(model, optimizer, scheduler, criterion, updates, rank)`: equal replicas."""
    results = ranks.run(_schedule_trial, fn, updates)
    lrs = [r["lr"] for r in results]
    if len(set(lrs)) > 1:
        raise WrongAnswer("ex_lr_apart", lrs=", ".join(
            f"rank {rank}: {lr:g}" for rank, lr in enumerate(lrs)))
    if (r := results[0])["apart"] > 0:
        raise WrongAnswer("ex_train_apart", diff=r["apart"])
    if r["diff"] > 1e-5:
        raise _off("model.parameters()", r["diff"], "ex_only_line")
    _right("ex_diverge_ok", lr=lrs[0])


def _judge(name: str, got: float | None, right: float, wrong: list[tuple[str, float]],
           hint: str) -> None:
    """Raise WrongAnswer unless `got` is `right`, naming the mistake it matches."""
    if got is None:
        raise WrongAnswer("ex_fill_in", name=name)
    close = [key for key, value in [("", right), ("ex_units", right * 1e3), *wrong]
             if math.isclose(float(got), value, rel_tol=1e-3)]
    if close and close[0]:
        raise WrongAnswer(close[0], name=name)
    if not close:
        raise WrongAnswer("ex_value_off", hint, name=name, got=float(got))


def check_step_prediction(model: comm.StepModel, K: int, sync_s: float | None,
                          no_sync_s: float | None) -> None:
    """Seconds per update of K micro-batches: all synchronized, and with no_sync."""
    c, s, o = model.compute_s, model.sync_s, model.optimizer_s
    _judge("sync_s", sync_s, K * c + K * s + o,
           [("ex_sync_k", K * c + s + o), ("ex_forgot_o", K * c + K * s),
            ("ex_forgot_k", c + K * s + o)], "ex_step_hint")
    _judge("no_sync_s", no_sync_s, K * c + s + o,
           [("ex_nosync_once", K * c + K * s + o), ("ex_forgot_o", K * c + s),
            ("ex_forgot_k", c + s + o)], "ex_step_hint")
    _right("ex_step_ok", K=K, sync=sync_s * 1e3, nosync=no_sync_s * 1e3)


def check_allreduce_prediction(ab: comm.AlphaBeta, params: int, world_size: int,
                               allreduce_s: float | None) -> None:
    """Seconds of one all-reduce of `params` float32 values, by the alpha-beta model."""
    nbytes, factor = 4 * params, comm.ring_factor(world_size)
    _judge("allreduce_s", allreduce_s, ab.time(nbytes, world_size),
           [("ex_bytes", ab.alpha + factor * params / ab.beta),
            ("ex_ring", ab.alpha + nbytes / ab.beta),
            ("ex_ring", ab.alpha + 2 * nbytes / ab.beta)], "ex_ab_hint")
    _right("ex_ab_ok", n=world_size, ms=ab.time(nbytes, world_size) * 1e3,
           ms2=ab.time(nbytes, 2) * 1e3)
