"""What the course's web pages add to the lessons, as a Sphinx extension.

The lessons are the notebooks as `make test`'s nbval run executed them, kept in
build/executed/<lang> (tools/executed.py): each build copies them into
website/<lang>/lessons/ (not committed), so that Sphinx finds them beside the home
page, with the same names and the same links between them. The site executes
nothing: a lesson whose executed copy is missing, failed, or stale (its notebook,
labkit, the packages or Python changed since it ran) stops the build, and
`make site` runs such lessons first. On the site:

- links between lessons keep working: JupyterLab's form, `NN_topic.ipynb#cell-id=ID`,
  lands on the heading of cell ID (each heading cell becomes a target named by its id);
- every page links to its twin in the other language (the header's button,
  website/_templates/labkit-twin.html);
- every lesson page says how to run it, links its student copy (dist/student,
  written by `make student`), and says which run its outputs come from (the
  commit and the time);
- each exercise's solution (a cell tagged `solution`) is folded, opened on request,
  and so is the output of the check after it (the check's verdict on the solution,
  which often quotes it), so that the page reads as the student copy until a
  learner asks;
- Japanese sentences lose the line breaks of their source, which a browser would
  show as spaces (the function that builds the notebooks so,
  build_notebooks.join_japanese_lines, applied to every Markdown source);
- sliders, which need a running kernel, are replaced by a note saying so, and
  progress bars, which tell nothing after their cell ran, are left out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from docutils import nodes
from myst_nb.sphinx_ import NbMetadataCollector
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import executed  # noqa: E402
from build_notebooks import join_japanese_lines  # noqa: E402

LESSONS = "lessons/"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

TEXT = {
    "ja": {
        "run": "このレッスンを実行するには: ",
        "run_windows": " (Windows では ",
        "run_how": ") で JupyterLab を開き、",
        "run_open": " を開きます。",
        "student": "演習の解答を除いた受講者用のコピー: ",
        "solutions": "このページでは、各演習の解答と、解答を確認した結果を"
                     "折りたたんでいます。まず自分で解いてから、「解答を表示」"
                     "で開いてください。",
        "show": "解答を表示",
        "hide": "解答を隠す",
        "show_check": "解答の確認結果を表示",
        "hide_check": "解答の確認結果を隠す",
        "show_code": "図と確認のコードを表示",
        "hide_code": "図と確認のコードを隠す",
        "ran": "このページの出力は、コミット {commit} のレッスンを {when} に"
               "実行した結果です (make test の nbval による実行、{seconds:g} 秒)。",
        "widget": "ここにはスライダー (ipywidgets) があります。カーネルを動かすと"
                  "使えます: このページの冒頭のとおりに開いたレッスンで、このセルを"
                  "実行してください。",
    },
    "en": {
        "run": "To run this lesson: ",
        "run_windows": " (on Windows, ",
        "run_how": ") opens JupyterLab; open ",
        "run_open": ".",
        "student": "The student copy, without the exercises' solutions: ",
        "solutions": "On this page each exercise's solution is folded away below "
                     "it, and so is its check's verdict on the solution: try the "
                     "exercise first, then open it with \"Show the solution\".",
        "show": "Show the solution",
        "hide": "Hide the solution",
        "show_check": "Show the check of the solution",
        "hide_check": "Hide the check of the solution",
        "show_code": "Show the code that draws and checks",
        "hide_code": "Hide the code that draws and checks",
        "ran": "The outputs on this page come from running this lesson at commit "
               "{commit} on {when} (make test's nbval run, {seconds:g} s).",
        "widget": "Here the lesson has sliders (ipywidgets), which need a running "
                  "kernel: run this cell in the lesson opened as the top of this page "
                  "says.",
    },
}

# What opens the course in JupyterLab: on Linux and macOS (`make lab` runs it), and
# on Windows, which has no make.
LAB = ("python3 tools/course.py lab", r"py tools\course.py lab")

# JupyterLab's link to a cell, as the lessons write it: 06_x.ipynb#cell-id=06-y
_CELL_LINK = re.compile(r"\]\((\d\d_[A-Za-z0-9_]+)\.ipynb#cell-id=([A-Za-z0-9_-]+)\)")


def copy_lessons(app: Sphinx, config) -> None:
    """Copy the executed lessons (build/executed/<lang>) into the site's lessons/
    folder (`config-inited`: before Sphinx looks for pages). A copy keeps its
    notebook's time, so a lesson not run again is not read again; a lesson no
    longer in notebooks/ leaves the site. Stops at a lesson without a fresh run."""
    lessons = [p for p in executed.notebooks() if p.parent.name == config.language]
    stale = executed.stale(lessons)
    if stale:
        raise ExtensionError(
            "lessons without a fresh run (make site runs them first: python "
            "tools/executed.py):\n" + "\n".join(
                f"  {p.relative_to(ROOT)}: {why}" for p, why in stale.items()))
    target = Path(app.srcdir) / LESSONS
    target.mkdir(exist_ok=True)
    names = {path.name for path in lessons}
    for old in target.glob("*.ipynb"):
        if old.name not in names:
            old.unlink()
    for path in lessons:
        source, copy = executed.copy_of(path), target / path.name
        if not copy.exists() or copy.stat().st_mtime != source.stat().st_mtime:
            shutil.copy2(source, copy)


def lesson_source(app: Sphinx, docname: str, source: list[str]) -> None:
    """A page's source as the site shows it (`source-read`; a lesson's is its
    notebook's JSON): each heading cell a target named by its cell id, and the
    lessons' `#cell-id=` links pointed at those targets; each solution cell folded
    (myst-nb's `hide-cell`, with the page language's prompt), and a cell the lesson
    folds (`hide-input`) with its code folded the same way; on the Japanese site,
    Japanese sentences without their line breaks."""
    japanese = app.config.language == "ja"
    if not docname.startswith(LESSONS):
        if japanese:  # a Markdown page, e.g. the home page
            source[0] = join_japanese_lines(source[0])
        return
    nb = json.loads(source[0])
    after_solution = False
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            text = _CELL_LINK.sub(r"](\1.ipynb#\2)", text)
            if japanese:
                text = join_japanese_lines(text)
            if text.startswith("#") and cell.get("id"):
                text = f"({cell['id']})=\n{text}"
            cell["source"] = text
        elif "solution" in cell["metadata"].get("tags", []):
            _fold(cell, "hide-cell", TEXT[app.config.language], "")
        elif after_solution:  # its check, run on the solution
            _fold(cell, "hide-output", TEXT[app.config.language], "_check")
        elif "hide-input" in cell["metadata"].get("tags", []):  # folded in the lesson
            _fold(cell, "hide-input", TEXT[app.config.language], "_code")
        after_solution = "solution" in cell["metadata"].get("tags", [])
    source[0] = json.dumps(nb)


def _fold(cell: dict, tag: str, text: dict[str, str], what: str) -> None:
    """Fold a code cell (myst-nb's `tag`), with the page language's prompts."""
    tags = cell["metadata"].get("tags", [])
    cell["metadata"]["tags"] = tags if tag in tags else [*tags, tag]
    cell["metadata"]["mystnb"] = {"code_prompt_show": text[f"show{what}"],
                                  "code_prompt_hide": text[f"hide{what}"]}


def _run_note(app: Sphinx, lang: str, docname: str) -> nodes.Node:
    """How to run a lesson, and its student copy."""
    name = docname[len(LESSONS):]
    text = TEXT[lang]
    box = nodes.container(classes=["labkit-run"])
    run = nodes.paragraph()
    run += nodes.Text(text["run"])
    run += nodes.literal(text=LAB[0])
    run += nodes.Text(text["run_windows"])
    run += nodes.literal(text=LAB[1])
    run += nodes.Text(text["run_how"])
    run += nodes.literal(text=f"{lang}/{name}.ipynb")
    run += nodes.Text(text["run_open"])
    box += run
    student = ROOT / "dist" / "student" / lang / f"{name}.ipynb"
    if student.exists():
        copy = nodes.paragraph()
        copy += nodes.Text(text["student"])
        copy += addnodes.download_reference(
            "", "", nodes.literal(text=f"{name}.ipynb"),
            reftarget="/" + os.path.relpath(student, app.srcdir),
            refdoc=docname, refexplicit=True, classes=["labkit-student"])
        box += copy
    lesson = json.loads((Path(app.srcdir) / f"{docname}.ipynb").read_text("utf-8"))
    if any("solution" in c["metadata"].get("tags", []) for c in lesson["cells"]):
        box += nodes.paragraph(text=text["solutions"], classes=["labkit-solutions"])
    ran = executed.facts(Path(app.srcdir) / f"{docname}.ipynb")
    if ran:
        box += nodes.paragraph(text=text["ran"].format(
            commit=ran["commit"], when=ran["executed_at"], seconds=ran["seconds"]),
            classes=["labkit-ran"])
    return box


def run_note(app: Sphinx, doctree: nodes.document) -> None:
    """Under a lesson's title, how to run it and its student copy."""
    docname = app.env.docname
    section = next(iter(doctree.findall(nodes.section)), None)
    if not docname.startswith(LESSONS) or section is None:
        return
    title = next(iter(section.findall(nodes.title)))
    note = _run_note(app, app.config.language, docname)
    section.insert(section.index(title) + 1, note)


def japanese_includes(app: Sphinx, relative_path: Path, parent_docname: str,
                      content: list[str]) -> None:
    """An included file (the README's parts on the home page) as cell_targets
    treats a page: on the Japanese site, without its Japanese line breaks."""
    if app.config.language == "ja":
        content[0] = join_japanese_lines(content[0])


def widgets_as_notes(app: Sphinx, doctree: nodes.document) -> None:
    """A widget shows nothing without a kernel. Where a lesson has sliders
    (ipywidgets' `interact`), say so; a progress bar (ipyparallel's, while ranks
    start or a %%px cell runs) tells nothing once its cell has run: leave it out."""
    text = TEXT[app.config.language]["widget"]
    for node in list(doctree.findall(nodes.container)):
        if node.get("nb_element") != "mime_bundle":
            continue
        mimes = {child.get("mime_type"): child for child in node.children}
        if WIDGET_MIME not in mimes:
            continue
        plain = mimes["text/plain"].astext() if "text/plain" in mimes else ""
        if plain.startswith("interactive("):
            note = nodes.note()
            note += nodes.paragraph(text=text)
            node.replace_self(note)
        else:
            node.parent.remove(node)
    # ... and no page carries the widgets' state, which only a widget would read
    js_files = NbMetadataCollector.get_js_files(app.env, app.env.docname)
    for key in [key for key in js_files if key.startswith("ipywidgets")]:
        del js_files[key]


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", copy_lessons)
    app.connect("source-read", lesson_source)
    # before Sphinx's collectors (priority 500), so that the student copy's
    # download link is collected and copied with the page
    app.connect("doctree-read", run_note, priority=400)
    app.connect("include-read", japanese_includes)
    app.connect("doctree-read", widgets_as_notes, priority=400)
    # env_version: bump it when what these functions put in a page changes, so
    # that a build reads every page again rather than reusing the pages it kept
    return {"parallel_read_safe": True, "parallel_write_safe": True,
            "env_version": 2}
