"""Links to lesson headings resolve, with anchors made the way JupyterLab makes them."""

import json
from pathlib import Path

import pytest

from labkit import links

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_every_lesson_link_has_its_notebook_and_heading(lang):
    folder = NOTEBOOKS / lang
    assert links.broken_links(folder) == []
    found = [link for path in folder.glob("*.ipynb") for link in links.links(path)]
    assert len(found) >= 50  # the errata table alone links every claim


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("## Correct use", "Correct-use"),
        ("## 誤用 1: `ddp_model.no_sync()` と 1 行書く",
         "誤用-1:-ddp_model.no_sync()-と-1-行書く"),
        ("### `pin_memory`", "pin_memory"),
        ("## 4. `gather`: 出力を集める", "4.-gather:-出力を集める"),
        ("## Why *not* **this** [link](x.md)", "Why-not-this-link"),
        ("## Closing hashes ##", "Closing-hashes"),
    ],
)
def test_anchor_is_the_visible_text_with_spaces_as_dashes(heading, anchor):
    assert links.heading_anchor(heading) == anchor


def _notebook(path, *sources):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": s} for s in sources]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}), encoding="utf-8")


def test_missing_notebooks_and_headings_are_reported(tmp_path):
    _notebook(tmp_path / "01_target.ipynb", "# Title\n\n## A `code` heading",
              "```\n## not a heading: fenced\n```")
    _notebook(tmp_path / "02_links.ipynb",
              "[ok](01_target.ipynb#A-code-heading) "
              "[bad](01_target.ipynb#No-such-heading) "
              "[fenced](01_target.ipynb#not-a-heading:-fenced) "
              "[gone](05_missing.ipynb#Anything)")
    assert links.broken_links(tmp_path) == [
        "02_links.ipynb: 01_target.ipynb has no heading #No-such-heading",
        "02_links.ipynb: 01_target.ipynb has no heading #not-a-heading:-fenced",
        "02_links.ipynb: no notebook 05_missing.ipynb",
    ]


def test_links_with_parentheses_are_read_whole():
    text = "| [x](04_no_sync.ipynb#誤用-1:-ddp_model.no_sync()-と-1-行書く) |"
    assert links.LINK.findall(text) == [
        ("04_no_sync.ipynb", "誤用-1:-ddp_model.no_sync()-と-1-行書く")]
