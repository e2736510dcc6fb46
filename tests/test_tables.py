"""Every Markdown table row of every lesson has as many cells as its header.

GFM splits a row at every pipe not escaped as `\\|`, inside code spans too, then
ignores the cells past the header's count and pads the missing ones with empty
ones: a stray pipe in `|G|²` silently loses the rest of the row, its link
included. The rows are split here with markdown-it's own GFM splitter.
"""

from pathlib import Path

import links
import pytest
from markdown_it import MarkdownIt
from markdown_it.rules_block.table import escapedSplit

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
_MD = MarkdownIt("commonmark").enable("table")


def _cells(line: str) -> int:
    """How many cells GFM reads in one table row (its enclosing pipes aside)."""
    columns = escapedSplit(line.strip())
    if columns and columns[0] == "":
        columns.pop(0)
    if columns and columns[-1] == "":
        columns.pop()
    return len(columns)


def ragged_rows(markdown: str) -> list[str]:
    """The rows of `markdown`'s tables whose cell count differs from the header's."""
    lines = markdown.split("\n")
    found, in_head, header = [], False, 0
    for token in _MD.parse(markdown):
        if token.type in {"thead_open", "thead_close"}:
            in_head = token.type == "thead_open"
        elif token.type == "tr_open":
            row = lines[token.map[0]]
            if in_head:
                header = _cells(row)
            elif (n := _cells(row)) != header:
                found.append(f"{n} cells, header {header}: {row[:60]}")
    return found


def test_a_stray_pipe_is_found_and_an_escaped_one_is_not():
    table = "| id | claim | link |\n|---|---|---|\n"
    assert ragged_rows(table + "| 1 | B = tr(Σ) / \\|G\\|² | [x](y) |\n") == []
    assert ragged_rows(table + "| 1 | a `x | y` code span | [x](y) |\n") == [
        "4 cells, header 3: | 1 | a `x | y` code span | [x](y) |"]
    assert ragged_rows(table + "| 1 | B = tr(Σ) / |G|² | [x](y) |\n") == [
        "5 cells, header 3: | 1 | B = tr(Σ) / |G|² | [x](y) |"]
    assert ragged_rows(table + "| 1 | short |\n") == [
        "2 cells, header 3: | 1 | short |"]
    assert ragged_rows("```\n| a | b |\n|---|---|\n| 1 |\n```\n") == []  # fenced


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_every_table_row_has_the_header_s_cell_count(lang):
    notebooks = sorted((NOTEBOOKS / lang).glob("*.ipynb"))
    assert len(notebooks) >= 13
    found = [f"{path.name} {cell_id}: {row}" for path in notebooks
             for cell_id, kind, source in links.notebook_cells(path)
             if kind == "markdown" for row in ragged_rows(source)]
    assert found == []


def test_the_glossary_s_table_rows_have_the_header_s_cell_count():
    glossary = NOTEBOOKS.parent / "TERMINOLOGY.md"
    assert ragged_rows(glossary.read_text(encoding="utf-8")) == []
