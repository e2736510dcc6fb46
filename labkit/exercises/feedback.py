"""How a grader answers: right, or WrongAnswer naming the problem and a hint.

Every grader of labkit.exercises prints "correct" and what the answer got
right, or raises WrongAnswer (an AssertionError). Messages that several
lessons' graders share are here; each lesson's own are beside its graders.
"""

from __future__ import annotations

from .. import i18n
from ..i18n import t

__all__ = ["WrongAnswer", "off", "register", "right"]


def register(messages: dict[str, tuple[str, str]]) -> None:
    """Add a grader module's messages, each written as key: (ja, en)."""
    i18n.register({key: {"ja": ja, "en": en} for key, (ja, en) in messages.items()})


register({  # key: (ja, en)
    "ex_right": ("✓ 正解です。", "✓ Correct. "),
    "ex_not_yet": ("まだです。", "Not yet. "),
    "ex_off": ("{what} が正解と最大 {diff:.1e} 違います。ヒント: {hint}",
               "{what} is off by up to {diff:.1e}. Hint: {hint}"),
    "ex_fill_in": ("{name} がまだ None です。自分の答えに置き換えてください。",
                   "{name} is still None: put your answer there."),
    "ex_no_zero_grad": (
        "1 回目の更新は正しいのですが、{step} 回目が違います。ヒント: `.grad` "
        "に前の更新の勾配が残っていて、backward() はそこに足します。毎回、最初に "
        "`optimizer.zero_grad()` を呼びます。",
        "Update 1 is right, update {step} is not. Hint: `.grad` still holds the "
        "previous update's gradient and backward() adds to it; start every update "
        "with `optimizer.zero_grad()`."),
})


class WrongAnswer(AssertionError):
    """An answer not right yet; `key` names the message (or the hint) that says why."""

    def __init__(self, key: str, hint: str | None = None, **fields: object):
        self.key = hint or key
        if hint:
            fields["hint"] = t(hint)
        super().__init__(t("ex_not_yet") + t(key, **fields))


def off(what: str, diff: float, hint: str) -> WrongAnswer:
    """`what` is off the right answer by up to `diff`; `hint` says what to fix."""
    return WrongAnswer("ex_off", hint, what=what, diff=diff)


def right(key: str, **fields: object) -> None:
    """Print the verdict "correct", then the message `key`."""
    print(t("ex_right") + t(key, **fields))
