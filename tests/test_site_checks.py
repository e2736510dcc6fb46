"""The website's own parts, without building it: the checker of the built site finds
each kind of problem it is for, and the lessons' cell links are made into links the
site resolves. (The built site itself is checked by tests/test_site.py.)"""

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from docutils import nodes

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "website"))

import check_site  # noqa: E402
import labkit_site  # noqa: E402

PAGE = """<html><body><section id="top"><h1>{title}</h1>
<a class="labkit-twin" href="../../{twin}/lessons/{name}.html">twin</a>
{body}</section></body></html>"""


FIGURE = {"output_type": "display_data", "data": {"image/png": "iVBOR"}}


def _site(tmp_path, ja_body="", en_body="", lessons=("01_a",)) -> Path:
    """A built site in miniature (in site/): index pages and lesson pages in both
    languages, each lesson with the one figure its run (in ran/) made."""
    for lang, body in (("ja", ja_body), ("en", en_body)):
        ran = tmp_path / "ran" / lang
        ran.mkdir(parents=True)
        for name in lessons:
            (ran / f"{name}.ipynb").write_text(json.dumps({"cells": [
                {"cell_type": "code", "outputs": [FIGURE]}]}))
        twin = "en" if lang == "ja" else "ja"
        site = tmp_path / "site"
        (site / lang / "lessons").mkdir(parents=True)
        (site / lang / "index.html").write_text(
            f'<a class="labkit-twin" href="../{twin}/index.html">twin</a>'
            + "".join(f'<a href="lessons/{n}.html">{n}</a>' for n in lessons))
        for name in lessons:
            (site / lang / "lessons" / "fig.png").write_bytes(b"png")
            (site / lang / "lessons" / f"{name}.html").write_text(PAGE.format(
                title=name, twin=twin, name=name,
                body='<img src="fig.png">' + body))
    return tmp_path / "site"


def _problems(site: Path) -> list[str]:
    return check_site.problems(site, site.parent / "ran")


def test_a_whole_site_has_no_problems(tmp_path):
    site = _site(tmp_path, ja_body='<a href="01_a.html#top">here</a>')
    assert _problems(site) == []


@pytest.mark.parametrize(("body", "problem"), [
    ('<a href="02_missing.html">x</a>', "link to a missing file: 02_missing.html"),
    ('<a href="01_a.html#no">x</a>', "link to a missing anchor: 01_a.html#no"),
    ('<a href="#nowhere">x</a>', "link to a missing anchor: #nowhere"),
    ('<img src="gone.png">', "missing image: gone.png"),
])
def test_each_broken_link_or_image_is_found(tmp_path, body, problem):
    site = _site(tmp_path, en_body=body)
    assert _problems(site) == [f"en/lessons/01_a.html: {problem}"]


def test_a_page_without_its_twin_and_a_lesson_without_its_figures_are_found(tmp_path):
    site = _site(tmp_path)
    (site / "en" / "lessons" / "01_a.html").write_text(
        '<a href="../../ja/lessons/01_a.html">twin, unmarked</a>')
    (site / "en" / "extra.html").write_text("only in English")
    ran = site.parent / "ran" / "ja"
    two = {"cells": [{"cell_type": "code", "outputs": [FIGURE, FIGURE]}]}
    (ran / "01_a.ipynb").write_text(json.dumps(two))
    assert _problems(site) == [
        "ja/lessons/01_a.html: 1 of its lesson's 2 figures",
        "en/extra.html: no ja twin",
        "en/extra.html: no link to its ja twin",
        "en/lessons/01_a.html: no link to its ja twin",
        "en/lessons/01_a.html: 0 of its lesson's 1 figures",
    ]


ERROR = {"output_type": "error", "ename": "ValueError", "evalue": "", "traceback": []}


@pytest.mark.parametrize(("cells", "metadata", "problem"), [
    ([{"cell_type": "code", "outputs": [FIGURE, ERROR]}], {},
     "code cell 0 raised, untagged"),
    ([{"cell_type": "code", "outputs": [FIGURE],
       "metadata": {"tags": ["raises-exception"]}}], {},
     "code cell 0 is tagged raises-exception and raised nothing"),
    ([{"cell_type": "code", "outputs": [FIGURE]}],
     {"labkit_run": {"passed": False}}, "its run failed"),
])
def test_a_page_showing_a_run_that_went_wrong_is_found(tmp_path, cells, metadata,
                                                       problem):
    """The site shows make test's run: a cell that raised where the lesson does not
    mean it, a failure meant but gone, or a failed run, is a problem of the page."""
    site = _site(tmp_path)
    ran = site.parent / "ran" / "en" / "01_a.ipynb"
    ran.write_text(json.dumps({"cells": cells, "metadata": metadata}))
    assert _problems(site) == [f"en/lessons/01_a.html: {problem}"]
    tagged = {"cell_type": "code", "outputs": [FIGURE, ERROR],
              "metadata": {"tags": ["raises-exception"]}}
    ran.write_text(json.dumps({"cells": [tagged],
                               "metadata": {"labkit_run": {"passed": True}}}))
    assert _problems(site) == []  # a failure meant, and shown: no problem


def test_cell_links_become_links_to_targets_the_site_has():
    notebook = {"cells": [
        {"cell_type": "markdown", "id": "11-errata", "source": [
            "# Errata\n", "See [the proof](04_no_sync.ipynb#cell-id=04-equal)."]},
        {"cell_type": "code", "id": "11-001", "source": ["x = '#cell-id=1'"]},
        {"cell_type": "markdown", "id": "11-plain", "source": ["no heading here"]},
    ]}
    source = [json.dumps(notebook)]
    labkit_site.cell_targets(None, "lessons/11_errata", source)
    cells = json.loads(source[0])["cells"]
    assert cells[0]["source"] == ("(11-errata)=\n# Errata\n"
                                  "See [the proof](04_no_sync.ipynb#04-equal).")
    assert cells[1]["source"] == ["x = '#cell-id=1'"]  # code is left as it is
    assert cells[2]["source"] == "no heading here"  # a target only on a heading
    index = [json.dumps(notebook)]
    labkit_site.cell_targets(None, "index", index)  # not a lesson: not touched
    assert index == [json.dumps(notebook)]


@pytest.mark.parametrize(("lang", "joined"), [
    ("ja", "勾配を平均する。次に、GPU\nで all-reduce\nする。"),  # GPU で: spaced
    ("en", "勾配を平均\nする。次に、\nGPU\nで all-reduce\nする。"),
])
def test_japanese_sentences_lose_their_line_breaks_on_the_japanese_site(lang, joined):
    """A break between two Japanese characters, or after 、 or 。, would show as a
    space; one before or after a Latin word otherwise stays (the sources space
    them), and code keeps its lines."""
    text = "勾配を平均\nする。次に、\nGPU\nで all-reduce\nする。"
    # as Markdown gives it: each line break a node of its own, and some inline markup
    lines = [nodes.Text(part) for part in re.split("(\n)", text)]
    lines[2:3] = [nodes.strong("", "する。"), nodes.Text("次に、")]
    doctree = nodes.section("", nodes.paragraph("", "", *lines),
                            nodes.literal_block("", "平均\nする"))
    app = SimpleNamespace(config=SimpleNamespace(language=lang))
    labkit_site.join_japanese_lines(app, doctree)
    assert doctree[0].astext() == joined
    assert doctree[1].astext() == "平均\nする"
