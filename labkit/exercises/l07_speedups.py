"""Lesson 07 (speed-ups): the activations a model keeps, an evaluation that keeps none.

Messages below; how a grader answers: labkit.exercises.feedback. The truth is
measured, not written down: the bytes with activations.saved_activation_bytes
on real DeepMLPs, the evaluation against the same model in eval mode under
no_grad.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from .. import activations, models
from ..i18n import t
from .feedback import WrongAnswer, off, register, right

__all__ = ["grade_evaluation", "grade_saved_activations"]

register({  # key: (ja, en)
    "ex_act_values": (
        "{case} で {got} と答えましたが、これは値の個数です。ヒント: float32 の値は "
        "1 つ 4 バイトです。",
        "For {case} you answered {got}: that is a number of values. Hint: a float32 "
        "value takes 4 bytes."),
    "ex_act_twice": (
        "{case} で、ReLU の出力と次の Linear の入力を別々に数えています。ヒント: "
        "2 つの層が同じテンソルを保存しても、メモリは 1 つ分です。",
        "For {case} you count a ReLU's output and the next Linear's input apart. "
        "Hint: a tensor two layers save is kept once."),
    "ex_act_one_short": (
        "{case} で、テンソル 1 つ分少なく答えています。ヒント: 最後の ReLU の出力も、"
        "最初の Linear の入力 (モデルの入力 X) も保存されます。",
        "For {case} you are one tensor short. Hint: the last ReLU's output is kept "
        "too, and so is the first Linear's input (the model's input X)."),
    "ex_act_ckpt_output": (
        "{case} で、区間の出力も数えています。ヒント: チェックポイントが残すのは"
        "各区間の入力だけです。出力は逆伝播のときに計算し直します。",
        "For {case} you count the segments' outputs too. Hint: a checkpoint keeps "
        "each segment's input only; the output is computed again during backward."),
    "ex_act_ckpt_same": (
        "{case} で、チェックポイントなしと同じ値を答えています。ヒント: "
        "チェックポイントをすると、区間の中の活性値は保存されません。",
        "For {case} you answer what the plain model keeps. Hint: with "
        "checkpointing, nothing inside a segment is kept."),
    "ex_act_ckpt_short": (
        "{case} で、テンソル 1 つ分少なく答えています。ヒント: 最初の区間の入力 "
        "(モデルの入力 X) も、ほかの区間の入力と同じように保存されます。",
        "For {case} you are one tensor short. Hint: the first segment's input (the "
        "model's input X) is kept like every other segment's."),
    "ex_act_batch": (
        "{case} で {got} と答えましたが、これはサンプル 1 つ分です。ヒント: "
        "活性値の形は (batch, width) で、バッチのサンプルごとに保存されます。",
        "For {case} you answered {got}: that is one sample's. Hint: an activation "
        "has the shape (batch, width); every sample of the batch keeps its own."),
    "ex_act_units": (
        "{case} で {got} と答えましたが、これは MB (または MiB) の値です。"
        "ヒント: 答えはバイト数です。",
        "For {case} you answered {got}: that is in MB (or MiB). Hint: answer in "
        "bytes."),
    "ex_act_float64": (
        "{case} の答えが、正しい値のちょうど 2 倍です。ヒント: float32 の値は 1 つ "
        "4 バイトです (8 バイトなのは float64 です)。",
        "For {case} your answer is exactly twice the right one. Hint: a float32 "
        "value takes 4 bytes (8 is float64)."),
    "ex_act_hint": (
        "Linear は入力を、ReLU は出力を保存し、同じテンソルは 1 回だけ数えます。",
        "a Linear keeps its input, a ReLU its output, and one tensor counts once."),
    "ex_act_ok": (
        "{cases} 通りの形で、測った値と一致しました。幅 256、バッチ 2048 の 12 層なら "
        "{plain:.1f} MB が、4 区間のチェックポイントで {ckpt:.1f} MB になります。",
        "It matches the measured bytes for {cases} shapes. For 12 layers of width "
        "256 and a batch of 2048: {plain:.1f} MB, and {ckpt:.1f} MB with 4 "
        "checkpointed segments."),
    "ex_eval_graph": (
        "評価のあいだに、逆伝播のための活性値を {nbytes} バイト保存しています。"
        "ヒント: 評価は `with torch.no_grad():` の中で行います。",
        "The evaluation saved {nbytes} bytes of activations for a backward pass. "
        "Hint: evaluate inside `with torch.no_grad():`."),
    "ex_eval_mode": (
        "評価で BatchNorm の running_mean が変わりました (Dropout も働いています)。"
        "ヒント: 評価の前に `model.eval()` を呼びます。",
        "Evaluating changed BatchNorm's running_mean (and Dropout was on). Hint: "
        "call `model.eval()` before evaluating."),
    "ex_eval_tensor": (
        "戻り値がテンソルです。ヒント: `.item()` で Python の float にして返します。",
        "It returned a tensor. Hint: return a Python float, with `.item()`."),
    "ex_eval_grad_off": (
        "評価のあと、勾配の計算がオフのままです (`torch.is_grad_enabled()` が False)。"
        "このあとの学習では勾配が求まりません。ヒント: `torch.set_grad_enabled(False)` "
        "ではなく、`with torch.no_grad():` のブロックの中で評価します。",
        "After the evaluation gradients stay off (`torch.is_grad_enabled()` is "
        "False): training after it gets no gradient. Hint: evaluate inside a `with "
        "torch.no_grad():` block, not after `torch.set_grad_enabled(False)`."),
    "ex_eval_frozen": (
        "評価のあと、パラメータ {names} の requires_grad が False のままです。"
        "このあとの学習では更新されません。ヒント: パラメータは変えずに、"
        "`with torch.no_grad():` の中で評価します。",
        "After the evaluation the parameters {names} have requires_grad False: "
        "training after it leaves them as they are. Hint: leave the parameters "
        "alone and evaluate inside `with torch.no_grad():`."),
    "ex_eval_loss": (
        "評価の損失", "the evaluation loss"),
    "ex_eval_hint": (
        "`models.MyLoss()(model(X), y)` を float にして返します。",
        "return `models.MyLoss()(model(X), y)` as a float."),
    "ex_eval_ok": (
        "損失 {loss:.4f} を、活性値を保存せず、BatchNorm の統計も変えずに"
        "計算しました。",
        "The loss, {loss:.4f}, computed with no activation saved and BatchNorm's "
        "statistics unchanged."),
})

# (batch, width, depth, segments): shapes where each mistake gives another number.
SHAPES = ((8, 16, 4, 2), (16, 8, 6, 3), (4, 32, 12, 4), (8, 16, 6, 1))


def grade_saved_activations(fn: Callable) -> None:
    """`fn(batch, width, depth, segments, checkpointed)`: bytes DeepMLP keeps."""
    for batch, width, depth, segments in SHAPES:
        for checkpointed in (False, True):
            case = (f"saved_bytes({batch}, {width}, {depth}, {segments}, "
                    f"{checkpointed})")
            got = fn(batch, width, depth, segments, checkpointed)
            if got is None:
                raise WrongAnswer("ex_fill_in", name=case)
            model = activations.DeepMLP(width=width, depth=depth, segments=segments,
                                        checkpointed=checkpointed)
            want = activations.saved_activation_bytes(model, torch.randn(batch, width))
            if got == want:
                continue
            tensor = batch * width * 4  # bytes of one activation
            if got * 4 == want:
                raise WrongAnswer("ex_act_values", case=case, got=got)
            if got * batch == want:
                raise WrongAnswer("ex_act_batch", case=case, got=got)
            if any(math.isclose(got * unit, want, rel_tol=1e-6)
                   for unit in (1e6, 2**20)):
                raise WrongAnswer("ex_act_units", case=case, got=got)
            if got == 2 * want:
                raise WrongAnswer("ex_act_float64", case=case)
            if not checkpointed and got == 2 * depth * tensor:
                raise WrongAnswer("ex_act_twice", case=case)
            if got == want - tensor:
                raise WrongAnswer("ex_act_ckpt_short" if checkpointed
                                  else "ex_act_one_short", case=case)
            if checkpointed and got == want + tensor:
                raise WrongAnswer("ex_act_ckpt_output", case=case)
            if checkpointed and got == (depth + 1) * tensor:
                raise WrongAnswer("ex_act_ckpt_same", case=case)
            raise off(case, abs(float(got) - want), "ex_act_hint")
    # What the answer says of the lesson's model, to compare with its printout.
    lesson = (2048, 256, 12, 4)
    right("ex_act_ok", cases=2 * len(SHAPES), plain=fn(*lesson, False) / 1e6,
          ckpt=fn(*lesson, True) / 1e6)


def _evaluated_model() -> nn.Module:
    """A model whose training mode shows: BatchNorm's statistics and Dropout."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(),
                         nn.Dropout(0.5), nn.Linear(32, 10))


def grade_evaluation(fn: Callable) -> None:
    """`fn(model, X, y)`: the loss as a float, in eval mode, keeping no activations."""
    model, X, y = _evaluated_model(), torch.randn(64, 10), torch.randn(64, 10)
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = models.MyLoss()(reference(X), y).item()
    before = model[1].running_mean.clone()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(x):
        if (ptr := x.untyped_storage().data_ptr()) not in params:
            saved[ptr] = x.untyped_storage().nbytes()
        return x

    grad_on = torch.is_grad_enabled()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            got = fn(model, X, y)
        grad_left_off = grad_on and not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(grad_on)  # the notebook's state, whatever fn left
    if got is None:
        raise WrongAnswer("ex_fill_in", name="evaluate(model, X, y)")
    if grad_left_off:
        raise WrongAnswer("ex_eval_grad_off")
    if frozen := [name for name, p in model.named_parameters() if not p.requires_grad]:
        raise WrongAnswer("ex_eval_frozen", names=", ".join(frozen))
    if saved:
        raise WrongAnswer("ex_eval_graph", nbytes=sum(saved.values()))
    if not torch.equal(model[1].running_mean, before):
        raise WrongAnswer("ex_eval_mode")
    if isinstance(got, torch.Tensor):
        raise WrongAnswer("ex_eval_tensor")
    if abs(float(got) - want) > 1e-6:
        raise off(t("ex_eval_loss"), abs(float(got) - want), "ex_eval_hint")
    right("ex_eval_ok", loss=want)
