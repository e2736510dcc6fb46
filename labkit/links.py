"""Links between lesson notebooks, checked the way JupyterLab resolves them.

JupyterLab 4 gives each rendered Markdown heading the id
`header.textContent.replace(/ /g, "-")` (rendermime's
`renderMarkdown.createHeaderId`): the heading's visible text, with markup such
as backticks gone, and every space replaced by "-". Nothing else changes:
case, punctuation and Japanese text stay as they are.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["LINK", "broken_links", "heading_anchor", "headings", "links"]

# [text](NN_topic.ipynb#anchor): a link to a heading of a lesson notebook.
LINK = re.compile(r"\]\((\d\d_[A-Za-z0-9_]+\.ipynb)#((?:[^()\s]|\([^()\s]*\))+)\)")
_FENCE = re.compile(r"^(```|~~~)")


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
    text = re.sub(r"^\s{0,3}#{1,6}\s+", "", heading.strip())
    text = re.sub(r"\s+#+\s*$", "", text)  # closing hashes are not text
    return _inline_text(text).replace(" ", "-")


def _markdown_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in nb["cells"] if c["cell_type"] == "markdown"]


def headings(path: Path) -> set[str]:
    """Anchors of every Markdown heading in the notebook at `path`."""
    anchors = set()
    for source in _markdown_cells(path):
        fenced = False
        for line in source.splitlines():
            if _FENCE.match(line.strip()):
                fenced = not fenced
            elif not fenced and re.match(r"^\s{0,3}#{1,6}\s", line):
                anchors.add(heading_anchor(line))
    return anchors


def links(path: Path) -> list[tuple[str, str]]:
    """Every (notebook, anchor) that the notebook at `path` links to."""
    return [m.groups() for source in _markdown_cells(path)
            for m in LINK.finditer(source)]


def broken_links(folder: Path) -> list[str]:
    """Links in the notebooks of `folder` whose notebook or heading is missing."""
    folder = Path(folder)
    known: dict[str, set[str] | None] = {}
    problems = []
    for path in sorted(folder.glob("*.ipynb")):
        for target, anchor in links(path):
            if target not in known:
                dest = folder / target
                known[target] = headings(dest) if dest.exists() else None
            if known[target] is None:
                problems.append(f"{path.name}: no notebook {target}")
            elif anchor not in known[target]:
                problems.append(f"{path.name}: {target} has no heading #{anchor}")
    return problems
