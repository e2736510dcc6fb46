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
- Japanese sentences lose the line breaks of their source, which a browser would
  show as spaces;
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

LESSONS = "lessons/"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

TEXT = {
    "ja": {
        "run": "このレッスンを実行するには: ",
        "run_how": " で JupyterLab を開き、",
        "run_open": " を開きます。",
        "student": "演習の解答を除いた受講者用のコピー: ",
        "ran": "このページの出力は、コミット {commit} のレッスンを {when} に"
               "実行した結果です (make test の nbval による実行、{seconds:g} 秒)。",
        "widget": "ここにはスライダー (ipywidgets) があります。カーネルを動かすと"
                  "使えます: make lab で開いたレッスンで、このセルを実行してください。",
    },
    "en": {
        "run": "To run this lesson: ",
        "run_how": " opens JupyterLab; open ",
        "run_open": ".",
        "student": "The student copy, without the exercises' solutions: ",
        "ran": "The outputs on this page come from running this lesson at commit "
               "{commit} on {when} (make test's nbval run, {seconds:g} s).",
        "widget": "Here the lesson has sliders (ipywidgets), which need a running "
                  "kernel: run this cell in the lesson opened by make lab.",
    },
}

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


def cell_targets(app: Sphinx, docname: str, source: list[str]) -> None:
    """Make each heading cell a target named by its cell id, and point the lessons'
    `#cell-id=` links at those targets (`source-read`: the notebook's JSON)."""
    if not docname.startswith(LESSONS):
        return
    nb = json.loads(source[0])
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            text = _CELL_LINK.sub(r"](\1.ipynb#\2)", text)
            if text.startswith("#") and cell.get("id"):
                text = f"({cell['id']})=\n{text}"
            cell["source"] = text
    source[0] = json.dumps(nb)


def _run_note(app: Sphinx, lang: str, docname: str) -> nodes.Node:
    """How to run a lesson, and its student copy."""
    name = docname[len(LESSONS):]
    text = TEXT[lang]
    box = nodes.container(classes=["labkit-run"])
    run = nodes.paragraph()
    run += nodes.Text(text["run"])
    run += nodes.literal(text="make lab")
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


# A line break between two Japanese characters, or after Japanese punctuation: the
# browser shows it as a space, which Japanese text does not have there (the sources
# wrap their lines).
_CJK = "\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef"
_CJK_PUNCTUATION = "\u3000-\u303f\uff00-\uffef"  # 、。「」（）: no space after
_CJK_BREAK = re.compile(f"(?<=[{_CJK}])\n(?=[{_CJK}])|(?<=[{_CJK_PUNCTUATION}])\n")


def join_japanese_lines(app: Sphinx, doctree: nodes.document) -> None:
    """Drop the line breaks inside Japanese sentences, on the Japanese site. A
    paragraph's text is in several nodes (a Markdown line break is a node of its own),
    so the breaks are found in the paragraph's whole text."""
    if app.config.language != "ja":
        return
    for block in list(doctree.findall(lambda n: isinstance(n, (nodes.paragraph,
                                                                 nodes.title)))):
        texts = list(block.findall(nodes.Text))
        drop = {m.start() for m in _CJK_BREAK.finditer("".join(texts))}
        offset = 0
        for text in texts:
            kept = "".join(c for k, c in enumerate(text) if offset + k not in drop)
            offset += len(text)
            if kept != text:
                text.parent.replace(text, nodes.Text(kept))


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
    app.connect("source-read", cell_targets)
    # before Sphinx's collectors (priority 500), so that the student copy's
    # download link is collected and copied with the page
    app.connect("doctree-read", run_note, priority=400)
    app.connect("doctree-read", join_japanese_lines)
    app.connect("doctree-read", widgets_as_notes, priority=400)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
