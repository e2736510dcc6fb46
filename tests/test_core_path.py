"""The two-hour core path: the README's table names its lessons, and those lessons
(and only those) mark each section core or deep dive."""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"outcomes", "summary", "self-check"}  # the lesson's frame, not a section


def core_lessons(readme: Path, heading: str) -> list[str]:
    """The lesson numbers of the core path's table, in its order."""
    text = readme.read_text(encoding="utf-8")
    table = text[text.index(heading):].split("\n\n")[2]  # heading, sentence, table
    return [m.group(1) for line in table.splitlines()
            if (m := re.match(r"\|\s*\d+\s*\|\s*(\d\d) ", line))]


def sections(path: Path) -> list[tuple[str, list[str]]]:
    """Each `##` section's heading and tags, outcomes, summary and self-check aside."""
    nb = nbformat.read(path, as_version=4)
    return [(c.source.splitlines()[0], c.metadata.get("tags", [])) for c in nb.cells
            if c.cell_type == "markdown" and c.source.startswith("## ")
            and not SHAPE & set(c.metadata.get("tags", []))]


def test_both_readmes_give_one_core_path():
    en = core_lessons(ROOT / "README.md", "### The core path")
    ja = core_lessons(ROOT / "README.ja.md", "### 中核コース")
    assert en == ja and en == sorted(en) and len(en) >= 4, (en, ja)


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_core_lessons_mark_every_section_and_the_others_none(lang):
    core = set(core_lessons(ROOT / "README.md", "### The core path"))
    problems = []
    for path in sorted((ROOT / "notebooks" / lang).glob("*.ipynb")):
        marks = [(h, {"core", "deep-dive"} & set(tags)) for h, tags in sections(path)]
        if path.stem[:2] in core:
            problems += [f"{path.stem}: {h} unmarked" for h, m in marks if len(m) != 1]
            if not any(m == {"core"} for _, m in marks):
                problems.append(f"{path.stem}: no core section")
        else:
            problems += [f"{path.stem}: {h} marked, off the core path"
                         for h, m in marks if m]
    assert problems == []


def test_a_readme_table_is_read_as_its_lessons(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n### The core path\n\nTake these.\n\n| min | lesson |\n"
                      "|---|---|\n| 10 | 00 Setup: a collective |\n| 30 | 03 DDP |\n\n"
                      "### The parts\n\n| 1 | 99 not this |\n", encoding="utf-8")
    assert core_lessons(readme, "### The core path") == ["00", "03"]


OPTIONAL_WORD = {"en": "(optional)", "ja": "(任意)"}


def exercise_headings(path: Path) -> list[tuple[str, bool]]:
    """Each exercise cell's nearest heading above it, and whether the cell is tagged
    `optional` (tools/lesson_time.py leaves those out of the lesson's minutes)."""
    nb = nbformat.read(path, as_version=4)
    heading, found = "", []
    for cell in nb.cells:
        tags = cell.metadata.get("tags", [])
        if cell.cell_type == "markdown" and cell.source.startswith("#"):
            heading = cell.source.splitlines()[0]
        elif "exercise" in tags:
            found.append((heading, "optional" in tags))
    return found


def optional_mismatches(path: Path, lang: str) -> list[str]:
    """Exercises whose `optional` tag and heading disagree."""
    word = OPTIONAL_WORD[lang]
    return [f"{path.stem}: {h!r} tagged {'optional' if opt else 'required'}"
            for h, opt in exercise_headings(path) if (word in h) != opt]


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_an_exercise_is_optional_exactly_when_its_heading_says_so(lang):
    paths = sorted((ROOT / "notebooks" / lang).glob("*.ipynb"))
    assert [p.stem for p in paths if any(o for _, o in exercise_headings(p))]
    assert [m for p in paths for m in optional_mismatches(p, lang)] == []


def test_an_optional_tag_without_its_word_is_found(tmp_path):
    optional = {"tags": ["exercise", "optional"]}
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("## Exercise: predict the split"),
        nbformat.v4.new_code_cell("x = None", metadata=optional),
        nbformat.v4.new_markdown_cell("## Exercise (optional): more"),
        nbformat.v4.new_code_cell("y = None", metadata={"tags": ["exercise"]}),
        nbformat.v4.new_markdown_cell("## 演習 (任意): 分け方"),
        nbformat.v4.new_code_cell("z = None", metadata=optional)])
    path = tmp_path / "99_x.ipynb"
    nbformat.write(nb, path)
    assert len(optional_mismatches(path, "en")) == 3
    assert optional_mismatches(path, "ja") == [
        "99_x: '## Exercise: predict the split' tagged optional"]
