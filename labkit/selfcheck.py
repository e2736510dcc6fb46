"""Self-check questions that close each lesson, and predictions checked by a run.

A lesson's three questions live in `labkit/selfchecks/<lesson>.toml`, each text in
both languages, beside the feedback each choice earns. `show` prints them in the
notebook's language with every answer folded; `check` gives the feedback for the
learner's choices; `predicted` compares a guess with what a cell measured. None of
them raises on a wrong or missing answer: a self-check teaches, it does not grade.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomllib

from . import i18n

__all__ = ["Choice", "Question", "check", "feedback", "load", "markdown", "predicted",
           "show"]

_DIR = Path(__file__).with_name("selfchecks")
KEYS = ("a", "b", "c", "d")

i18n.register({
    "sc_title": {"ja": "確認問題", "en": "Self-check"},
    "sc_answer": {"ja": "答え", "en": "Answer"},
    "sc_how": {
        "ja": "答えを決めてから折りたたみを開くか、下のセルの `my_answers` に書いて"
        "実行してください。",
        "en": "Decide on your answers before opening a fold, or write them in "
        "`my_answers` in the cell below and run it.",
    },
    "sc_right": {"ja": "{n}. 正解 ({choice})。{why}",
                 "en": "{n}. Right ({choice}). {why}"},
    "sc_wrong": {"ja": "{n}. ({choice}) ではありません。{why}",
                 "en": "{n}. Not ({choice}). {why}"},
    "sc_unanswered": {"ja": "{n}. まだ答えていません。",
                      "en": "{n}. Not answered yet."},
    "sc_score": {"ja": "{right} / {total} 問正解。", "en": "{right} of {total} right."},
    "sc_bad_key": {
        "ja": "問題 {n} の答え {choice!r} は選択肢にありません。{keys} のどれかを書いて"
        "ください。",
        "en": "Answer {choice!r} to question {n} is not a choice: write one of {keys}.",
    },
    "sc_bad_number": {
        "ja": "問題 {n} はありません。問題は 1 から {total} までです。",
        "en": "There is no question {n}: the questions are 1 to {total}.",
    },
    "sc_no_lesson": {
        "ja": "レッスン {lesson!r} の確認問題はありません。あるのは {known} です。",
        "en": "No self-check for lesson {lesson!r}; there are {known}.",
    },
    "pred_none": {
        "ja": "予想がまだです。`guess` に予想を書いてからこのセルを実行してください "
        "(実行結果は {actual})。",
        "en": "No prediction yet: write yours in `guess`, then run this cell "
        "(the run gave {actual}).",
    },
    "pred_right": {"ja": "予想どおりです: {actual}。",
                   "en": "As you predicted: {actual}."},
    "pred_wrong": {
        "ja": "予想は {guess}、実行結果は {actual} です。どこで数え違えたかを、"
        "前の説明で確かめてください。",
        "en": "You predicted {guess}; the run gave {actual}. Look back at the "
        "explanation above to see where the count differs.",
    },
})


@dataclass(frozen=True)
class Choice:
    """One choice of a question, and the feedback for choosing it."""

    key: str
    text: dict[str, str]
    why: dict[str, str]


@dataclass(frozen=True)
class Question:
    """One self-check question: its text, choices and the right key."""

    text: dict[str, str]
    choices: tuple[Choice, ...]
    answer: str


def _texts(entry: dict, prefix: str, where: str) -> dict[str, str]:
    missing = [lang for lang in i18n.LANGS if not entry.get(prefix + lang)]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(prefix + m for m in missing)}")
    return {lang: entry[prefix + lang] for lang in i18n.LANGS}


def load(lesson: str) -> tuple[Question, ...]:
    """The questions of `lesson` (a notebook's stem, e.g. "03_ddp"), checked whole."""
    path = _DIR / f"{lesson}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in _DIR.glob("*.toml")))
        raise ValueError(i18n.t("sc_no_lesson", lesson=lesson, known=known))
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    questions = []
    for n, entry in enumerate(raw.get("question", []), start=1):
        where = f"{path.name}, question {n}"
        choices = tuple(
            Choice(c.get("key", ""), _texts(c, "", f"{where}, choice {i}"),
                   _texts(c, "why_", f"{where}, choice {i}"))
            for i, c in enumerate(entry.get("choice", []), start=1))
        keys = [c.key for c in choices]
        if not 2 <= len(keys) <= len(KEYS) or keys != list(KEYS[:len(keys)]):
            raise ValueError(f"{where}: choices must be keyed {KEYS[:len(keys)]} "
                             f"in order, 2 to 4 of them; found {keys}")
        if entry.get("answer") not in keys:
            raise ValueError(f"{where}: answer {entry.get('answer')!r} is not a choice")
        questions.append(Question(_texts(entry, "", where), choices, entry["answer"]))
    if len(questions) != 3:
        raise ValueError(f"{path.name} holds {len(questions)} questions, not 3")
    return tuple(questions)


def _markdown(questions: tuple[Question, ...], lang: str) -> str:
    lines = [f"**{i18n.t('sc_title')}**: {i18n.t('sc_how')}", ""]
    for n, q in enumerate(questions, start=1):
        lines += [f"**{n}.** {q.text[lang]}", ""]
        lines += [f"- ({c.key}) {c.text[lang]}" for c in q.choices]
        right = next(c for c in q.choices if c.key == q.answer)
        # A <details> fold at the top level (not inside the list, where renderers
        # differ) keeps the answer out of sight until the learner opens it; the
        # blank lines let Markdown inside it render, in JupyterLab and on the site.
        lines += ["", f"<details><summary>{i18n.t('sc_answer')}</summary>", "",
                  f"({right.key}) {right.why[lang]}", "", "</details>", ""]
    return "\n".join(lines)


def markdown(lesson: str) -> str:
    """The lesson's questions in the current language, each answer folded."""
    return _markdown(load(lesson), i18n.get_lang())


def show(lesson: str) -> None:
    """Display the lesson's questions in the current language (returns nothing, so
    that a cell ending in it shows them once)."""
    text = markdown(lesson)
    try:
        from IPython.display import Markdown, display
    except ImportError:  # plain Python: the text itself
        print(text)
    else:
        display(Markdown(text))


def check(lesson: str, answers: dict[int, str | None]) -> None:
    """Print the feedback on `answers` ({question number: "a".."d" or None})."""
    print(feedback(lesson, answers)[1])


def feedback(lesson: str, answers: dict[int, str | None]
             ) -> tuple[list[bool | None], str]:
    """Per question True (right), False (wrong) or None (not answered), and the
    feedback's text in the current language."""
    questions = load(lesson)
    for n in answers:
        if not isinstance(n, int) or not 1 <= n <= len(questions):
            raise ValueError(i18n.t("sc_bad_number", n=n, total=len(questions)))
    lang, results, lines = i18n.get_lang(), [], []
    for n, q in enumerate(questions, start=1):
        given = answers.get(n)
        if given is None:
            results.append(None)
            lines.append(i18n.t("sc_unanswered", n=n))
            continue
        key = str(given).strip().lower().strip("()")
        chosen = next((c for c in q.choices if c.key == key), None)
        if chosen is None:
            raise ValueError(i18n.t("sc_bad_key", n=n, choice=given,
                                    keys=", ".join(c.key for c in q.choices)))
        results.append(key == q.answer)
        lines.append(i18n.t("sc_right" if key == q.answer else "sc_wrong", n=n,
                            choice=key, why=chosen.why[lang]))
    if any(r is not None for r in results):
        lines.append(i18n.t("sc_score", right=sum(r is True for r in results),
                            total=len(questions)))
    return results, "\n".join(lines)


def predicted(guess: object, actual: object) -> None:
    """Compare a learner's `guess` (None: not yet) with the run's `actual` value,
    and print what the learner should make of it."""
    if guess is None:
        print(i18n.t("pred_none", actual=actual))
    else:
        print(i18n.t("pred_right" if guess == actual else "pred_wrong", guess=guess,
                     actual=actual))
