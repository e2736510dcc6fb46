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
