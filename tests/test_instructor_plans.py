"""The instructor guides' plans add up, and fit what the lessons ask of a learner."""

import re
from pathlib import Path

import lesson_time
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent

GUIDES = {"en": ROOT / "docs" / "instructor.md",
          "ja": ROOT / "docs" / "instructor.ja.md"}
# A plan is a table whose first two columns are the start time and the minutes.
_PLAN_HEADER = re.compile(r"^\|\s*(time|時刻)\s*\|\s*(minutes|分)\s*\|")
_LESSON = re.compile(r"^(\d\d)\s")


def plans(text: str) -> list[list[list[str]]]:
    """Every plan table in a guide: its rows, each a list of cells."""
    tables, rows = [], None
    for line in text.splitlines():
        if _PLAN_HEADER.match(line):
            rows = []
            tables.append(rows)
        elif rows is not None and line.startswith("|"):
            if not set(line) <= set("|- "):  # the |---| line
                rows.append([cell.strip() for cell in line.strip("|").split("|")])
        else:
            rows = None
    return tables


def _minute(clock: str) -> int:
    hours, minutes = clock.split(":")
    return int(hours) * 60 + int(minutes)


# A row that ends a day of a plan that spans several: the next row starts a new clock.
_DAY_END = re.compile(r"^(end of day \d|\d 日目の終わり)$")


def plan_problems(rows: list[list[str]]) -> list[str]:
    """Rows whose start is not the previous start plus its minutes; a missing end."""
    problems = []
    for row, following in zip(rows, rows[1:], strict=False):
        if not row[1] and _DAY_END.match(row[2]):
            continue
        if not row[1].isdigit():
            problems.append(f"{row[0]} {row[2]}: no minutes")
        elif _minute(row[0]) + int(row[1]) != _minute(following[0]):
            problems.append(f"{row[0]} + {row[1]} min is not {following[0]}")
    if rows and rows[-1][1]:
        problems.append(f"the last row ({rows[-1][0]}) is not the end")
    return problems


def lesson_minutes(rows: list[list[str]]) -> dict[str, int]:
    """Minutes a plan gives each lesson number (a lesson may span several rows)."""
    given: dict[str, int] = {}
    for row in rows:
        if (m := _LESSON.match(row[2])) and row[1].isdigit():
            given[m.group(1)] = given.get(m.group(1), 0) + int(row[1])
    return given


def estimates(lang: str) -> dict[str, float]:
    """tools/lesson_time.py's minutes for each lesson, without running it."""
    folder = ROOT / "notebooks" / lang
    return {path.stem[:2]: lesson_time.measure(path, lang, run=False).minutes(lang)
            for path in sorted(folder.glob("*.ipynb"))}


@pytest.mark.parametrize("lang", sorted(GUIDES))
def test_each_plan_adds_up(lang):
    short, full = plans(GUIDES[lang].read_text(encoding="utf-8"))
    assert plan_problems(short) == [] and plan_problems(full) == []
    assert _minute(short[-1][0]) - _minute(short[0][0]) == 90


@pytest.mark.parametrize("lang", sorted(GUIDES))
def test_the_full_day_gives_every_lesson_the_time_it_asks(lang):
    _, full = plans(GUIDES[lang].read_text(encoding="utf-8"))
    given, wanted = lesson_minutes(full), estimates(lang)
    assert sorted(given) == sorted(wanted)  # every lesson, no other
    short_of = {n: (given[n], round(wanted[n])) for n in wanted if given[n] < wanted[n]}
    assert short_of == {}, f"lesson: (minutes given, minutes estimated) {short_of}"


@pytest.mark.parametrize("lang", sorted(GUIDES))
def test_the_short_plan_says_what_it_leaves_out(lang):
    short, _ = plans(GUIDES[lang].read_text(encoding="utf-8"))
    wanted = estimates(lang)
    for row in short:
        m = _LESSON.match(row[2])
        if m and int(row[1]) < wanted[m.group(1)]:
            wants = wanted[m.group(1)]
            assert row[4], f"{row[2]}: {row[1]} of {wants:.0f} min, nothing left out"


def test_a_plan_that_does_not_add_up_is_reported():
    rows = [["9:00", "20", "00 Setup"], ["9:30", "40", "01 Models"],
            ["10:10", "", "end"]]
    assert plan_problems(rows) == ["9:00 + 20 min is not 9:30"]
    assert plan_problems([["9:00", "20", "00 Setup"], ["9:20", "40", "01 Models"]]) == [
        "the last row (9:20) is not the end"]
    assert lesson_minutes(rows) == {"00": 20, "01": 40}


def test_a_plan_may_end_a_day_and_start_the_next():
    rows = [["9:00", "20", "00 Setup"], ["9:20", "", "end of day 1"],
            ["9:00", "40", "01 Models"], ["9:40", "", "end"]]
    assert plan_problems(rows) == []
    rows[1][2] = "lunch"  # any other row without minutes is still a mistake
    assert plan_problems(rows) == ["9:20 lunch: no minutes"]


def test_reading_units_count_words_in_english_and_characters_in_japanese():
    assert lesson_time.prose_units("Two ranks, one `all_reduce`.", "en") == 4
    # 8 kana/kanji, plus two Latin words
    assert lesson_time.prose_units("ランクは DDP の all_reduce", "ja") == 7


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_timed_run_starts_in_the_notebooks_folder_and_fails_on_an_error(tmp_path):
    """`--run` times a notebook as a learner runs it (tools/execute.py): in its own
    folder, and a cell that raises is an error, not a time."""
    import execute
    import nbformat
    from nbclient.exceptions import CellExecutionError

    folder = tmp_path / "lessons"
    folder.mkdir()
    (folder / "data.txt").write_text("here")
    path = folder / "demo.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "assert open('data.txt').read() == 'here'")])
    nbformat.write(nb, path)
    # the cell's assert is the check of the folder: run_s comes only if it held
    assert lesson_time.measure(path, "en", run=True).run_s is not None
    nb.cells.append(nbformat.v4.new_code_cell("raise ValueError('a wrong answer')"))
    nbformat.write(nb, path)
    with pytest.raises(CellExecutionError, match="a wrong answer"):
        execute.run(path)
    assert execute.main([str(path)]) == 1


def test_a_folded_note_is_read_apart_and_lab_sentences_are_counted(tmp_path):
    """What the shape columns count: words in a fold are not in the minutes, a
    sentence about the machine is `lab`, and the tags say summary and self-check."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(
            "Two ranks average one gradient. On this machine it took 3 ms.\n\n"
            "<details><summary>How</summary>\n\nTen more words of detail are "
            "folded away here.\n\n</details>"),
        nbformat.v4.new_code_cell("plots.timeline(t)\nx = 1"),
        nbformat.v4.new_markdown_cell("## What to remember", metadata={
            "tags": ["summary"]}),
    ]
    path = tmp_path / "07_x.ipynb"
    nbformat.write(nb, path)
    t = lesson_time.measure(path, "en", run=False)
    # the fold's tags count as words (details, summary twice, How)
    assert t.prose_units == 5 + 7 + 3 and t.fold_units == 5 + 9
    assert t.lab_share == pytest.approx(7 / 15)
    assert (t.figures, t.summary, t.self_check) == (1, True, False)
    ja = "この実行では 3 ms でした。勾配は同じです。"
    assert lesson_time.lab_units(ja, "ja") == 11
