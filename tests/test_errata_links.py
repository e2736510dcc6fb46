"""Lesson links land on their heading's cell; anchors as JupyterLab makes them."""

import json
from pathlib import Path

import links
import pytest

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
    cells = [{"cell_type": "markdown", "id": f"{path.name[:2]}-{n:03d}", "metadata": {},
              "source": s} for n, s in enumerate(sources)]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}), encoding="utf-8")


def test_links_that_do_not_land_are_reported(tmp_path):
    _notebook(tmp_path / "01_target.ipynb", "# Title\n\n## A `code` heading",
              "```\n## not a heading: fenced\n```", "## Other")
    _notebook(tmp_path / "02_links.ipynb",
              "[01: A `code` heading](01_target.ipynb#cell-id=01-000) "
              "[top](01_target.ipynb#A-code-heading) "
              "[bad](01_target.ipynb#No-such-heading) "
              "[fenced](01_target.ipynb#not-a-heading:-fenced) "
              "[01: A `code` heading](01_target.ipynb#cell-id=01-002) "
              "[01: Other](01_target.ipynb#cell-id=01-001) "
              "[gone](05_missing.ipynb#Anything)")
    assert links.broken_links(tmp_path) == [
        "02_links.ipynb: 01_target.ipynb #A-code-heading opens the notebook at its "
        "top in JupyterLab; link its cell (python tools/links.py SOURCE)",
        "02_links.ipynb: 01_target.ipynb has no heading #No-such-heading",
        "02_links.ipynb: 01_target.ipynb has no heading #not-a-heading:-fenced",
        "02_links.ipynb: 01_target.ipynb #cell-id=01-002 holds Other, not the heading "
        "that [01: A `code` heading] names (python tools/links.py SOURCE)",
        "02_links.ipynb: 01_target.ipynb has no heading cell #cell-id=01-001",
        "02_links.ipynb: no notebook 05_missing.ipynb",
    ]


def test_land_links_each_heading_to_its_cell_in_either_language(tmp_path):
    for lang, heading in [("ja", "## 誤用 1: `no_sync()` と 1 行書く"),
                          ("en", "## Misuse 1: `no_sync()` on its own line")]:
        (tmp_path / lang).mkdir()
        _notebook(tmp_path / lang / "04_no_sync.ipynb", "# 04", "text", heading)
    folders = [tmp_path / "ja", tmp_path / "en"]
    source = ("| [04: 誤用 1: `no_sync()` と 1 行書く]"
              "(04_no_sync.ipynb#誤用-1:-no_sync()-と-1-行書く) |\n"
              "| [04: Misuse 1: `no_sync()` on its own line]"
              "(04_no_sync.ipynb#Misuse-1:-no_sync()-on-its-own-line) |\n")
    landed = links.land(source, folders)
    assert landed == ("| [04: 誤用 1: `no_sync()` と 1 行書く]"
                      "(04_no_sync.ipynb#cell-id=04-002) |\n"
                      "| [04: Misuse 1: `no_sync()` on its own line]"
                      "(04_no_sync.ipynb#cell-id=04-002) |\n")
    assert links.land(landed, folders) == landed  # idempotent
    # A cell id that no longer holds its heading (the lesson gained a cell)
    # is found again from the heading the link's text names.
    moved = landed.replace("cell-id=04-002", "cell-id=04-001")
    assert links.land(moved, folders) == landed
    with pytest.raises(ValueError, match="no heading cell"):
        links.land("[x](04_no_sync.ipynb#No-such-heading)", folders)


def test_links_with_parentheses_are_read_whole():
    text = "| [x](04_no_sync.ipynb#誤用-1:-ddp_model.no_sync()-と-1-行書く) |"
    assert links.LINK.findall(text) == [
        ("x", "04_no_sync.ipynb", "誤用-1:-ddp_model.no_sync()-と-1-行書く")]
