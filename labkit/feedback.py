"""How an exercise check answers: right, or WrongAnswer naming the problem and a hint.

Shared by the modules of checks (labkit.exercises, labkit.exercises_scale);
the texts are in labkit.exercise_messages, in both languages.
"""

from __future__ import annotations

from . import exercise_messages  # noqa: F401  (registers the checks' messages)
from .i18n import t

__all__ = ["WrongAnswer", "off", "right"]


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
