"""How a grader answers: right, or WrongAnswer naming the problem and a hint.

Every grader of labkit.exercises prints "correct" and what the answer got
right, or raises WrongAnswer (an AssertionError). Messages that several
lessons' graders share are here; each lesson's own are beside its graders.
"""

from __future__ import annotations

import re
import string

from .. import i18n
from ..i18n import get_lang, t

__all__ = ["WrongAnswer", "message", "off", "register", "right"]


def register(messages: dict[str, tuple[str, str]]) -> None:
    """Add a grader module's messages, each written as key: (ja, en)."""
    i18n.register({key: {"ja": ja, "en": en} for key, (ja, en) in messages.items()})


register({  # key: (ja, en)
    "ex_right": ("✓ 正解です。", "✓ Correct. "),
    "ex_not_yet": ("まだ正解ではありません。", "Not yet. "),
    "ex_optional_left": ("任意の演習は手つかずなので、実測との比較は飛ばします。",
                         "The optional exercise is left as handed out: its "
                         "comparison with the measurements is skipped."),
    "ex_off": ("{what}が正解と最大 {diff:.1e} 違います。ヒント: {hint}",
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


# Kana, kanji and Japanese punctuation: a value starting or ending in these is
# Japanese and gets no space. Latin text gets one only beside kana or kanji,
# never beside punctuation (、 and 。 and 「」 carry their own space).
_JAPANESE = re.compile(r"[\u3000-\u30ff\u3400-\u9fff\uff00-\uffef]")
_KANA_KANJI = re.compile(r"[\u3040-\u30ff\u3400-\u9fff]")


def message(key: str, **fields: object) -> str:
    """`t(key, **fields)`, with Japanese spaced around each value as it is written.

    A Japanese template puts no space between a field and the text next to it
    (`{what}が`), because the field may hold Japanese (評価の損失が). A value that
    begins or ends in Latin text, a number or code gets a half-width space on
    that side (`p.grad が`), as Japanese typesetting spaces Latin text; beside
    、。「」 it gets none (`、499 要素`).
    """
    text = t(key, **fields)
    if get_lang() != "ja":
        return text
    parts = []
    parsed = list(string.Formatter().parse(i18n.MESSAGES[key]["ja"]))
    for i, (literal, name, spec, conversion) in enumerate(parsed):
        parts.append(literal)
        if name is None:
            continue
        value = format(fields[name] if conversion is None
                       else {"r": repr, "s": str, "a": ascii}[conversion](fields[name]),
                       spec or "")
        after = parsed[i + 1][0] if i + 1 < len(parsed) else ""
        if value and literal and _KANA_KANJI.match(literal[-1]) \
                and not _JAPANESE.match(value[0]):
            value = " " + value
        if value and after and _KANA_KANJI.match(after[0]) \
                and not _JAPANESE.match(value[-1]):
            value += " "
        parts.append(value)
    return "".join(parts)


class WrongAnswer(AssertionError):
    """An answer not right yet; `key` names the message (or the hint) that says why."""

    def __init__(self, key: str, hint: str | None = None, **fields: object):
        self.key = hint or key
        if hint:
            fields["hint"] = t(hint)
        super().__init__(t("ex_not_yet") + message(key, **fields))


def off(what: str, diff: float, hint: str) -> WrongAnswer:
    """`what` is off the right answer by up to `diff`; `hint` says what to fix."""
    return WrongAnswer("ex_off", hint, what=what, diff=diff)


def right(key: str, **fields: object) -> None:
    """Print the verdict "correct", then the message `key`."""
    print(t("ex_right") + message(key, **fields))
