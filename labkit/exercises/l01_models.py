"""Lesson 01 (models): doc 004's model keeps the batch, and one SGD step.

Messages below; how a grader answers: labkit.exercises.feedback.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from .. import compare, models
from .feedback import WrongAnswer, off, register, right

__all__ = ['grade_keeps_batch', 'grade_train_step']

register({  # key: (ja, en)
    "ex_batch": ("形 {shape} の入力の出力が {got} です ({want} のはずです)。ヒント: "
                 "平坦化するのは各サンプルだけで、バッチの次元 (0) は残します。",
                 "An input of shape {shape} gives an output of shape {got}, not "
                 "{want}. Hint: flatten each sample only; keep the batch dimension "
                 "(0)."),
    "ex_batch_error": ("形 {shape} の入力でエラーになりました ({err})。ヒント: "
                       "`x.view(-1)` はバッチ全体を 1 本のベクトルにします。"
                       "平坦化するのは各サンプルだけです。",
                       "An input of shape {shape} fails ({err}). Hint: `x.view(-1)` "
                       "makes the whole batch one vector; flatten each sample only."),
    "ex_batch_error_later": (
        "形 {passed} の入力は通りますが、形 {shape} の入力でエラーになりました "
        "({err})。"
        "ヒント: バッチの大きさも特徴の形も決め打ちせず、次元 0 を残して、"
        "残りの次元を各サンプルの 1 行に平坦化します。",
        "Inputs of shape {passed} work, but one of shape {shape} fails ({err}). "
        "Hint: write neither the batch size nor the shape of a sample; keep "
        "dimension 0 and flatten the other dimensions into one row per sample."),
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
    "ex_step_no_grad": (
        "`optimizer.step()` は呼ばれましたが、そのとき勾配がなく、パラメータが"
        "変わっていません。ヒント: `step()` は `loss.backward()` のあとに呼び、"
        "そのあいだで `zero_grad()` を呼びません。",
        "`optimizer.step()` ran, but with no gradient to apply, so the parameters "
        "did not change. Hint: call `step()` after `loss.backward()`, with no "
        "`zero_grad()` between them."),
    "ex_order_step": ("zero_grad() → 順伝播 → 損失 → backward() → step() の順です。",
                      "zero_grad() → forward → loss → backward() → step()."),
    "ex_train_ok": ("{steps} 回の更新が正しい SGD と一致しました。",
                    "{steps} updates match correct SGD."),
})


def grade_keeps_batch(model_cls: type) -> None:
    """Doc 004's model with `view(-1)` fixed: the output keeps every sample."""
    torch.manual_seed(0)
    model, reference = model_cls(), models.MLP()
    reference.load_state_dict(model.state_dict())
    shapes = [(100, 10), (1, 10), (4, 2, 5)]
    for i, shape in enumerate(shapes):
        X = torch.randn(shape)
        want = reference(X)
        try:
            got = model(X)
        except (RuntimeError, ValueError) as e:
            err = str(e).splitlines()[0]
            if i:  # the first shape passed: the batch size or sample shape is fixed
                raise WrongAnswer("ex_batch_error_later", shape=shape, err=err,
                                  passed=", ".join(map(str, shapes[:i]))) from None
            raise WrongAnswer("ex_batch_error", shape=shape, err=err) from None
        if got.shape != want.shape:
            raise WrongAnswer("ex_batch", shape=shape, got=tuple(got.shape),
                              want=tuple(want.shape))
        if (diff := (got - want).abs().max().item()) > 1e-6:
            raise off("model(X)", diff, "ex_batch_fix")
    right("ex_batch_ok", shapes=", ".join(map(str, shapes)))


def grade_train_step(train_step: Callable) -> None:
    """`train_step(model, optimizer, criterion, X, y)`: one correct SGD update."""
    torch.manual_seed(0)
    model = models.MLP()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    criterion, g = models.MyLoss(), torch.Generator().manual_seed(1)
    # What ran, and whether step() found gradients: zero_grad() between backward()
    # and step() leaves None too, which alone would read as a missing backward().
    backward_ran, steps_with_grad, steps = [0], [0], [0]
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p: backward_ran.__setitem__(0, backward_ran[0] + 1))
        for p in model.parameters()]
    step_fn = optimizer.step

    def counted_step(*args, **kwargs):
        steps[0] += 1
        steps_with_grad[0] += any(p.grad is not None and p.grad.abs().sum() > 0
                                  for p in model.parameters())
        return step_fn(*args, **kwargs)

    optimizer.step = counted_step
    try:
        for step in (1, 2, 3):
            X, y = torch.randn(32, 10, generator=g), torch.randn(32, 10, generator=g)
            before = compare.flat(model.parameters())
            backward_ran[0] = steps[0] = steps_with_grad[0] = 0
            train_step(model, optimizer, criterion, X, y)
            ref_opt.zero_grad()
            criterion(reference(X), y).backward()
            ref_opt.step()
            if not backward_ran[0]:
                raise WrongAnswer("ex_no_backward")
            if torch.equal(before, compare.flat(model.parameters())):
                if steps[0] and not steps_with_grad[0]:
                    raise WrongAnswer("ex_step_no_grad")
                raise WrongAnswer("ex_no_step")
            diff = compare.max_abs_diff(model.parameters(), reference.parameters())
            if diff > 1e-6:
                if step > 1:
                    raise WrongAnswer("ex_no_zero_grad", step=step)
                raise off("model.parameters()", diff, "ex_order_step")
    finally:
        optimizer.step = step_fn
        for hook in hooks:
            hook.remove()
    right("ex_train_ok", steps=3)
