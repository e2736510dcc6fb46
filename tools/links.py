"""Links between lesson notebooks, checked the way JupyterLab resolves them.

JupyterLab 4 gives each rendered Markdown heading the id
`header.textContent.replace(/ /g, "-")` (rendermime's
`renderMarkdown.createHeaderId`): the heading's visible text, with markup such
as backticks gone, and every space replaced by "-". Nothing else changes:
case, punctuation and Japanese text stay as they are.

Such a heading link opens the right notebook but does not land on its heading
in JupyterLab 4.6: a link's fragment reaches `Notebook.setFragment` as
`anchor.hash`, percent-encoded (every Japanese character, and `"`), and is
never decoded; and a plain `#Heading` fragment is looked up among the rendered
cells just after the notebook's model loads, before the cells are rendered,
so the notebook stays at its top. What JupyterLab does resolve on a freshly
opened notebook, in any language, is a cell id: `NN_topic.ipynb#cell-id=NN-012`
finds the cell in the notebook's model and scrolls it into view.

So the lessons link to headings with `#cell-id=`, and the heading a link means
is its text's end: `[04: Correct use](04_no_sync.ipynb#cell-id=04-correct-use)`
goes to the cell whose heading reads "Correct use". tools/build_notebooks.py
names a heading cell after its English heading (the Japanese twin gets the
same id), so a link stays true when a lesson gains or loses cells. `land`
writes such links from heading links, and rewrites the ids that no longer hold
the heading their text names (after a heading is renamed):

    python tools/links.py course/16_errata.py   # then build the notebooks

That the heading then stays on screen needs the course's JupyterLab defaults
(jupyterlab-settings/, which `make lab` uses); tests/test_browser.py clicks
such links in both languages.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbcells

__all__ = ["CELL_ID", "LINK", "broken_links", "heading_anchor", "heading_cells",
           "headings", "land", "links", "notebook_cells", "section_code"]

# [text](NN_topic.ipynb#fragment): a link to a place in a lesson notebook. The
# text may hold [brackets] one level deep, the fragment (balanced) parentheses.
LINK = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]"
                  r"\((\d\d_[A-Za-z0-9_]+\.ipynb)#((?:[^()\s]|\([^()\s]*\))+)\)")
CELL_ID = "cell-id="


def _inline_text(markdown: str) -> str:
    """The visible text of inline Markdown (what textContent returns)."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parseInline(markdown)
    out = []
    for token in tokens:
        for child in token.children or []:
            if child.type in ("text", "code_inline"):
                out.append(child.content)
            elif child.type in ("softbreak", "hardbreak"):
                out.append(" ")
    return "".join(out)


def heading_anchor(heading: str) -> str:
    """JupyterLab's anchor for a Markdown heading line or text ("## A `b` c")."""
    heading = heading.strip()
    line = nbcells.HEADING.match(heading)
    text = line.group(1) if line else heading
    text = re.sub(r"\s+#+\s*$", "", text)  # closing hashes are not text
    return _inline_text(text).replace(" ", "-")


def notebook_cells(path: Path) -> list[tuple[str, str, str]]:
    """(cell id, cell type, source) of every cell of the notebook at `path`."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    return [(c.get("id", ""), c["cell_type"],
             "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in nb["cells"]]


def _markdown_cells(path: Path) -> list[tuple[str, str]]:
    """(cell id, source) of each Markdown cell of the notebook at `path`."""
    return [(cell_id, source) for cell_id, kind, source in notebook_cells(path)
            if kind == "markdown"]


def _cell_headings(source: str) -> list[str]:
    """Anchors of the headings of one Markdown cell, fenced code left out."""
    return [heading_anchor(line) for line in nbcells.heading_lines(source)]


def heading_cells(path: Path) -> dict[str, list[str]]:
    """Cell id -> anchors of its headings, for each Markdown cell with one."""
    return {cell_id: found for cell_id, source in _markdown_cells(path)
            if (found := _cell_headings(source))}


def headings(path: Path) -> set[str]:
    """Anchors of every Markdown heading in the notebook at `path`."""
    return {a for found in heading_cells(path).values() for a in found}


def section_code(path: Path, fragment: str) -> list[str] | None:
    """Code cells of the section a link's `fragment` names, in the notebook `path`.

    A section is a heading (`Heading-anchor`, or the first heading of the cell
    `cell-id=ID`) and the cells under it, up to the next heading of any level.
    None if the notebook has no such heading.
    """
    inside, code = False, []
    for cell_id, kind, source in notebook_cells(path):
        if kind == "code":
            if inside:
                code.append(source)
            continue
        for n, anchor in enumerate(_cell_headings(source)):
            if inside:
                return code
            inside = (fragment == anchor or
                      (n == 0 and fragment == CELL_ID + cell_id))
    return code if inside else None


def links(path: Path) -> list[tuple[str, str]]:
    """Every (notebook, fragment) that the notebook at `path` links to."""
    return [m.groups()[1:] for _, source in _markdown_cells(path)
            for m in LINK.finditer(source)]


def _names(text: str, anchors: list[str]) -> bool:
    """Whether link text `text` ends with one of the heading `anchors`."""
    said = heading_anchor(text)
    return any(said == a or said.endswith("-" + a) for a in anchors)


def _problem(text: str, fragment: str, cells: dict[str, list[str]]) -> str | None:
    """Why the link [text](...#fragment) does not land on its heading, or None."""
    if not fragment.startswith(CELL_ID):
        if fragment in {a for found in cells.values() for a in found}:
            return (f"#{fragment} opens the notebook at its top in JupyterLab; "
                    f"link its cell (python tools/links.py SOURCE)")
        return f"has no heading #{fragment}"
    cell_id = fragment[len(CELL_ID):]
    if cell_id not in cells:
        return f"has no heading cell #{fragment}"
    if not _names(text, cells[cell_id]):
        return (f"#{fragment} holds {', '.join(cells[cell_id])}, not the heading "
                f"that [{text}] names (python tools/links.py SOURCE)")
    return None


def broken_links(folder: Path) -> list[str]:
    """Links in the notebooks of `folder` that do not land on their heading."""
    folder = Path(folder)
    known: dict[str, dict[str, list[str]] | None] = {}
    problems = []
    for path in sorted(folder.glob("*.ipynb")):
        for _, source in _markdown_cells(path):
            for text, target, fragment in LINK.findall(source):
                if target not in known:
                    dest = folder / target
                    known[target] = heading_cells(dest) if dest.exists() else None
                cells = known[target]
                if cells is None:
                    problems.append(f"{path.name}: no notebook {target}")
                elif why := _problem(text, fragment, cells):
                    problems.append(f"{path.name}: {target} {why}")
    return problems


def _landing_cell(text: str, fragment: str, targets: list[dict[str, list[str]]]) -> str:
    """The id of the cell a link means: its heading anchor's, else its text's."""
    found = set()
    for cells in targets:
        for cell_id, anchors in cells.items():
            if fragment.startswith(CELL_ID) and _names(text, anchors):
                found.add(cell_id)
            elif fragment in anchors:
                found.add(cell_id)
    if len(found) != 1:
        where = "no heading cell" if not found else f"several cells ({sorted(found)})"
        raise ValueError(f"[{text}](…#{fragment}): {where} to link to")
    return found.pop()


def land(markdown: str, folders: list[Path]) -> str:
    """`markdown` with each lesson link pointing at its heading's cell id.

    A link to `NN_topic.ipynb` looks its heading up in NN_topic.ipynb of each
    folder of `folders` (one per language: a lesson source holds both, and
    twin cells share their id). Idempotent: a link that already lands is
    written back unchanged.
    """
    def one(m: re.Match) -> str:
        text, target, fragment = m.groups()
        targets = [heading_cells(Path(f) / target) for f in folders
                   if (Path(f) / target).exists()]
        if not targets:
            raise ValueError(f"[{text}]({target}#…): no notebook {target}")
        cell_id = _landing_cell(text, fragment, targets)
        return f"[{text}]({target}#{CELL_ID}{cell_id})"

    return LINK.sub(one, markdown)


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(
        description="Point lesson links at their heading's cell, so that JupyterLab "
                    "lands on it. Reads the built notebooks: build them first, and "
                    "again afterwards.")
    parser.add_argument("sources", nargs="+", type=Path,
                        help="lesson sources to rewrite")
    parser.add_argument("--notebooks", type=Path, default=root / "notebooks")
    args = parser.parse_args(argv)
    folders = sorted(p for p in args.notebooks.iterdir() if p.is_dir())
    for source in args.sources:
        text = source.read_text(encoding="utf-8")
        try:
            new = land(text, folders)
        except ValueError as e:
            print(f"{source}: {e}", file=sys.stderr)
            return 1
        if new != text:
            source.write_text(new, encoding="utf-8")
            print(f"rewrote {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
