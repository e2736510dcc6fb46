"""The self-checks that close the lessons: the question files, and the feedback."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit import i18n, selfcheck

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted((ROOT / "labkit" / "selfchecks").glob("*.toml"))
LESSONS = sorted(p.stem for p in (ROOT / "notebooks" / "en").glob("*.ipynb")
                 if "errata" not in p.stem)

SAMPLE = '''
[[question]]
en = "How many?"
ja = "いくつ?"
answer = "b"
[[question.choice]]
key = "a"
en = "one"
ja = "1"
why_en = "One is the count of a single rank."
why_ja = "1 は 1 ランクの数です。"
[[question.choice]]
key = "b"
en = "two"
ja = "2"
why_en = "Two ranks, one each."
why_ja = "2 ランクが 1 つずつです。"
'''


@pytest.fixture
def sample(tmp_path, monkeypatch):
    """A lesson "99_sample" of three copies of one question."""
    (tmp_path / "99_sample.toml").write_text(SAMPLE * 3, encoding="utf-8")
    monkeypatch.setattr(selfcheck, "_DIR", tmp_path)
    yield tmp_path
    i18n.set_lang("en")


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_each_question_file_loads_whole_in_both_languages(path):
    questions = selfcheck.load(path.stem)
    for q in questions:
        # The feedback for a wrong choice says why, and is not the right one's.
        rights = [c for c in q.choices if c.key == q.answer]
        for c in q.choices:
            if c is not rights[0]:
                assert c.why != rights[0].why
        for lang in ("ja", "en"):
            assert q.text[lang].strip()
    if path.stem in LESSONS:
        return
    pytest.fail(f"{path.name} belongs to no lesson")


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_opens_with_outcomes_and_ends_with_summary_and_self_check(lesson):
    for lang in ("ja", "en"):
        nb = nbformat.read(ROOT / "notebooks" / lang / f"{lesson}.ipynb", as_version=4)
        tagged = {tag: [i for i, c in enumerate(nb.cells)
                        if tag in c.metadata.get("tags", [])]
                  for tag in ("outcomes", "summary", "self-check")}
        assert tagged["outcomes"] and tagged["outcomes"][0] <= 2, (lang, tagged)
        assert tagged["summary"] and tagged["self-check"], (lang, tagged)
        # The summary comes before the self-check, and the self-check ends the lesson.
        assert max(tagged["summary"]) < min(tagged["self-check"]), (lang, tagged)
        assert tagged["self-check"][-1] == len(nb.cells) - 1, (lang, tagged)
        code = "\n".join(nb.cells[i].source for i in tagged["self-check"]
                         if nb.cells[i].cell_type == "code")
        assert f'selfcheck.show("{lesson}")' in code
        assert f'selfcheck.check("{lesson}", my_answers)' in code
        bullets = re.findall(r"^\s*[-*] ", nb.cells[tagged["summary"][0]].source,
                             flags=re.M)
        assert 3 <= len(bullets) <= 5, (lang, len(bullets))
    selfcheck.load(lesson)  # its questions exist and load


def test_show_gives_the_questions_with_each_answer_folded(sample, capsys):
    i18n.set_lang("ja")
    assert selfcheck.show("99_sample") is None  # a cell ending in it shows them once
    text = selfcheck.markdown("99_sample")
    assert text.count("いくつ?") == 3 and "- (a) 1" in text
    # The explanation of the right choice appears only inside a fold.
    outside = re.sub(r"<details>.*?</details>", "", text, flags=re.S)
    assert "2 ランクが 1 つずつです。" in text
    assert "2 ランクが 1 つずつです。" not in outside
    assert text.count("<details><summary>答え</summary>") == 3


def test_check_gives_the_feedback_of_each_choice(sample, capsys):
    results, text = selfcheck.feedback("99_sample", {1: "b", 2: "a", 3: None})
    assert results == [True, False, None]
    assert selfcheck.check("99_sample", {1: "b", 2: "a", 3: None}) is None
    out = capsys.readouterr().out
    assert out == text + "\n"
    assert "1. Right (b). Two ranks, one each." in out
    assert "2. Not (a). One is the count of a single rank." in out
    assert "3. Not answered yet." in out and "1 of 3 right." in out
    i18n.set_lang("ja")
    results, text = selfcheck.feedback("99_sample", {1: "(B)"})
    assert results == [True, None, None] and "1. 正解 (b)。" in text


def test_nothing_answered_prints_no_score(sample, capsys):
    results, text = selfcheck.feedback("99_sample", {1: None, 2: None, 3: None})
    assert results == [None] * 3 and "right." not in text


@pytest.mark.parametrize("answers, named", [
    ({1: "e"}, "'e'"), ({4: "a"}, "question 4"), ({"1": "a"}, "question 1")])
def test_an_answer_that_is_no_choice_is_refused_by_name(sample, answers, named):
    with pytest.raises(ValueError, match=named):
        selfcheck.check("99_sample", answers)


def test_an_unknown_lesson_and_a_broken_file_are_refused(sample):
    with pytest.raises(ValueError, match="'no_such'"):
        selfcheck.load("no_such")
    (sample / "98_two.toml").write_text(SAMPLE * 2, encoding="utf-8")
    with pytest.raises(ValueError, match="2 questions, not 3"):
        selfcheck.load("98_two")
    (sample / "97_bad.toml").write_text(SAMPLE.replace('answer = "b"', 'answer = "c"')
                                        * 3, encoding="utf-8")
    with pytest.raises(ValueError, match="'c' is not a choice"):
        selfcheck.load("97_bad")
    (sample / "96_nowhy.toml").write_text(SAMPLE.replace('why_ja = "1 は', 'x = "')
                                          * 3, encoding="utf-8")
    with pytest.raises(ValueError, match="why_ja"):
        selfcheck.load("96_nowhy")


def test_a_prediction_is_compared_and_never_raises(capsys):
    selfcheck.predicted(None, 4)
    assert "write yours in `guess`" in capsys.readouterr().out
    selfcheck.predicted(4, 4)
    assert capsys.readouterr().out == "As you predicted: 4.\n"
    selfcheck.predicted(3, 4)
    assert capsys.readouterr().out.startswith("You predicted 3; the run gave 4.")
