"""Build notebooks/ja and notebooks/en from the lesson sources in course/.

A source is a jupytext py:percent file. Markdown cells marked `lang="ja"` /
`lang="en"` come in adjacent pairs, Japanese first, and say the same thing in
each language. Code cells are shared: one source, both notebooks. The one
place the code says which language it runs in, `labkit.set_lang("ja")`,
reads `labkit.set_lang("en")` in the English notebook.

    python tools/build_notebooks.py          # write the notebooks
    python tools/build_notebooks.py --check  # fail if any is missing or stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import jupytext
import nbcells
import nbformat

ROOT = Path(__file__).resolve().parent.parent
LANGS = ("ja", "en")


class SourceError(ValueError):
    """A lesson source breaks the one-source, two-languages rules."""


_SET_LANG = 'labkit.set_lang("ja")'


def _in_language(cell: nbformat.NotebookNode, lang: str) -> nbformat.NotebookNode:
    """A shared code cell as the `lang` notebook runs it."""
    if lang == "ja" or _SET_LANG not in cell.source:
        return cell
    return nbformat.from_dict({**cell, "source": cell.source.replace(
        _SET_LANG, f'labkit.set_lang("{lang}")')})


def split_languages(source: nbformat.NotebookNode, name: str) -> dict[str, list]:
    """Per language, the list of cells of that language's notebook."""
    cells = source.cells
    out: dict[str, list] = {lang: [] for lang in LANGS}
    i = 0
    while i < len(cells):
        cell = cells[i]
        lang = cell.metadata.get("lang")
        where = f"{name}, cell {i + 1} ({cell.cell_type})"
        if lang is None:
            if cell.cell_type == "markdown":
                raise SourceError(f"{where}: markdown cell without lang=\"ja\"/\"en\"")
            for lang_ in LANGS:
                out[lang_].append(_in_language(cell, lang_))
            i += 1
            continue
        if cell.cell_type == "code":
            raise SourceError(f"{where}: code cells are shared, not per language; "
                              f"write {_SET_LANG} once, the English notebook gets "
                              "\"en\"")
        if lang != "ja":
            raise SourceError(
                f"{where}: a lang={lang!r} cell must follow its lang=\"ja\" twin"
            )
        twin = cells[i + 1] if i + 1 < len(cells) else None
        if twin is None or twin.metadata.get("lang") != "en":
            raise SourceError(f"{where}: lang=\"ja\" cell lacks its lang=\"en\" twin")
        if twin.cell_type != cell.cell_type:
            raise SourceError(f"{where}: its twin is a {twin.cell_type} cell")
        out["ja"].append(cell)
        out["en"].append(twin)
        i += 2
    return out


# Japanese script (kana, kanji, full-width forms), and the Japanese punctuation
# (、。「」（）and full-width forms) beside which no space goes at all.
JAPANESE = "\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef"
JAPANESE_PUNCTUATION = "\u3000-\u303f\uff00-\uffef"
_JAPANESE_CHAR = re.compile(f"[{JAPANESE}]")
_JAPANESE_PUNCTUATION_CHAR = re.compile(f"[{JAPANESE_PUNCTUATION}]")
# A line that starts a block of its own, so that the line break before it stays: a
# list item, a heading, a table row, a quote, a fence (``` ~~~ or MyST's :::), HTML,
# a MyST target "(name)=", a rule or a heading's underline, display math.
_BLOCK_START = re.compile(
    r"([-*+]|\d{1,9}[.)])(\s|$)|#|\||>|```|~~~|:::|<|\(\S+\)=\s*$|"
    r"([-*_=]\s*){3,}$|\$\$")
_FENCE = re.compile(r"\s*(```+|~~~+)")
# Markup at a line's end or start that the reader does not see: emphasis, a link's
# brackets and target. Code spans count as code: a space beside them is right.
_MARKUP_AT_END = re.compile(r"(\]\([^()\s]*\)|[*_~])+$")
_MARKUP_AT_START = re.compile(r"^[*_~\[]+")


def _joins(line: str, following: str) -> bool:
    """Whether the line break between `line` and `following` (two lines of one
    paragraph) is one a reader would see as a wrong space: between two Japanese
    characters, or beside Japanese punctuation."""
    before = _MARKUP_AT_END.sub("", line.rstrip())[-1:]
    after = _MARKUP_AT_START.sub("", following.lstrip())[:1]
    if not before or not after:
        return False
    return bool(_JAPANESE_CHAR.match(before) and _JAPANESE_CHAR.match(after)
                or _JAPANESE_PUNCTUATION_CHAR.match(before)
                or _JAPANESE_PUNCTUATION_CHAR.match(after))


def join_japanese_lines(markdown: str) -> str:
    """`markdown` without the line breaks inside its Japanese sentences.

    A Markdown renderer (JupyterLab's, Sphinx's) shows a line break inside a
    paragraph as a space, which Japanese text has nowhere: a break between two
    Japanese characters, or beside 、。「」, is dropped. Breaks that mean something
    stay: around a list item, a heading, a table row, a quote, a fence and all
    lines inside it, a blank line, a hard break (two spaces or a backslash at the
    line's end), and a break beside Latin text, numbers or code, where the space
    is right ("GPU で", "`no_sync` を").
    """
    out: list[str] = []
    fence = ""  # the marker of the fenced block we are in, if any
    joinable = False  # whether the last line in `out` is a paragraph's line
    for line in markdown.split("\n"):
        stripped = line.lstrip()
        if fence:
            out.append(line)
            if stripped.startswith(fence) and not stripped[len(fence):].strip():
                fence = ""
            continue
        opened = _FENCE.match(line)
        # a quote's next line goes on without its ">"
        text = (stripped[1:].lstrip() if stripped.startswith(">")
                and out and out[-1].lstrip().startswith(">") else stripped)
        starts_block = not text or bool(_BLOCK_START.match(text))
        if joinable and not starts_block and _joins(out[-1], text):
            out[-1] = out[-1].rstrip() + text
        else:
            out.append(line)
        if opened:
            fence = opened.group(1)
        last = out[-1]
        joinable = bool(last.strip()) and not opened and not (
            last.endswith(("  ", "\\")) or re.match(r"\s*(#|\||<|\(\S+\)=)", last))
    return "\n".join(out)


# The line a section's heading gets when its cell is tagged `core` (on the two-hour
# core path) or `deep-dive` (off it), in the cell's language: the tag says it once
# for both languages, and the heading, which names the cell and its links, stays.
SECTION_MARKS = {
    "core": {"ja": "*★ 中核コース*", "en": "*★ Core path*"},
    "deep-dive": {"ja": "*発展 (中核コースでは飛ばせます)*",
                  "en": "*Deep dive (off the core path)*"},
}


def mark_section(source: str, tags: list[str], lang: str) -> str:
    """`source` with its section's mark under its first heading, if tagged."""
    marks = [SECTION_MARKS[t][lang] for t in tags if t in SECTION_MARKS]
    headings = nbcells.heading_lines(source)
    if not marks:
        return source
    if len(marks) > 1 or not headings:
        raise SourceError(f"a cell tagged {tags} needs one heading and one of "
                          f"{sorted(SECTION_MARKS)}: {source[:60]!r}")
    lines = source.split("\n")
    at = lines.index(headings[0]) + 1
    return "\n".join([*lines[:at], "", marks[0], *lines[at:]])


# A code cell tagged so draws a figure or checks a result that the lesson has
# already computed in view: JupyterLab shows it folded (its output stays in view,
# a click opens the code) and the site behind a "show code" toggle (myst-nb reads
# the same tag). The code a lesson teaches is never folded (tests/test_core_path.py).
FOLD_CODE = "hide-input"


def _clean(cell: nbformat.NotebookNode, cell_id: str) -> nbformat.NotebookNode:
    metadata = {k: v for k, v in cell.metadata.items() if k != "lang"}
    if cell.cell_type == "markdown":
        source = mark_section(cell.source, metadata.get("tags", []),
                              cell.metadata.get("lang", "en"))
        if cell.metadata.get("lang") == "ja":
            source = join_japanese_lines(source)
        new = nbformat.v4.new_markdown_cell(source, metadata=metadata)
    else:
        if FOLD_CODE in metadata.get("tags", []):
            metadata = {**metadata, "jupyter": {**metadata.get("jupyter", {}),
                                                "source_hidden": True}}
        new = nbformat.v4.new_code_cell(cell.source, metadata=metadata)
    new.id = cell_id
    return new


def cell_ids(lesson: str, cells: list[nbformat.NotebookNode]) -> list[str]:
    """The id of each cell: "04-correct-use" for a cell whose English heading is
    "Correct use", else its position ("04-017").

    Lesson links land on heading cells by id (tools/links.py), so a heading's id
    must not move when a lesson gains a cell; twins in the other language get
    the same id.
    """
    ids: list[str] = []
    for n, cell in enumerate(cells):
        found = (nbcells.heading_lines(cell.source) if cell.cell_type == "markdown"
                 else [])
        text = nbcells.HEADING.match(found[0]).group(1) if found else ""
        slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
        cell_id = f"{lesson}-{slug}"[:64].rstrip("-")
        if not slug or cell_id in ids:
            cell_id = f"{lesson}-{n:03d}"
        ids.append(cell_id)
    return ids


# What a lesson's kernel (ipykernel) says about itself when the lesson opens.
# JupyterLab writes both into the notebook's metadata as the kernel starts, and
# anything that differs from what the file holds marks the lesson modified: closing
# it would ask to save a lesson nobody changed. Python's version is the one part a
# notebook cannot know for every learner: this is the course's reference Python
# (the one its checks run on); under another, opening a lesson records that one.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python",
              "name": "python3"}
PYTHON_VERSION = "3.11.7"
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
    "version": PYTHON_VERSION,
}


def build(path: Path) -> dict[str, str]:
    """The JSON text of each language's notebook for the source `path`."""
    source = jupytext.read(path, fmt="py:percent")
    per_lang = split_languages(source, path.name)
    ids = cell_ids(path.stem[:2], per_lang["en"])
    texts = {}
    for lang, cells in per_lang.items():
        nb = nbformat.v4.new_notebook()
        nb.metadata = {
            "kernelspec": KERNELSPEC,
            "language_info": LANGUAGE_INFO,
            "labkit": {"lang": lang, "source": f"course/{path.name}"},
        }
        nb.cells = [_clean(c, cell_id) for c, cell_id in zip(cells, ids, strict=True)]
        nbformat.validate(nb)
        texts[lang] = nbformat.writes(nb) + "\n"
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; fail if a notebook is missing or stale")
    parser.add_argument("--course", type=Path, default=ROOT / "course")
    parser.add_argument("--out", type=Path, default=ROOT / "notebooks")
    args = parser.parse_args(argv)

    sources = sorted(args.course.glob("[0-9][0-9]_*.py"))
    if not sources:
        print(f"no lesson sources in {args.course}", file=sys.stderr)
        return 1
    problems: list[str] = []
    expected: set[Path] = set()
    for path in sources:
        try:
            texts = build(path)
        except SourceError as e:
            problems.append(str(e))
            continue
        for lang, text in texts.items():
            target = args.out / lang / f"{path.stem}.ipynb"
            expected.add(target)
            current = target.read_text(encoding="utf-8") if target.exists() else None
            if current == text:
                continue
            if args.check:
                state = "missing" if current is None else "differs from its source"
                problems.append(f"{target.relative_to(args.out.parent)}: {state}")
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
                print(f"wrote {target.relative_to(args.out.parent)}")
    for lang in LANGS:
        for stray in sorted((args.out / lang).glob("*.ipynb")):
            if stray not in expected:
                problems.append(f"{stray.relative_to(args.out.parent)}: has no source")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        if args.check:
            print("run `make notebooks` and commit the result", file=sys.stderr)
        return 1
    if args.check:
        print(f"{len(expected)} notebooks in sync with {len(sources)} sources")
    return 0


if __name__ == "__main__":
    sys.exit(main())
