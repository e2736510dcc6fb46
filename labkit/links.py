"""Links between lesson notebooks, checked the way JupyterLab resolves them.

JupyterLab 4 gives each rendered Markdown heading the id
`header.textContent.replace(/ /g, "-")` (rendermime's
`renderMarkdown.createHeaderId`): the heading's visible text, with markup such
as backticks gone, and every space replaced by "-". Nothing else changes:
case, punctuation and Japanese text stay as they are.

The claims ledger is the tables of the errata notebook: each row starts with an
id (`000-3`, `004-12` for the documents' claims, `L03-2` for a lesson's own)
and links to the section that proves it. A section is a heading and the cells
under it up to the next heading; it proves something only if one of its code
cells asserts (an `assert` statement, or a call that raises when the claim is
false: `assert_*`, `check_*`, or one of labkit.checks.RAISING).
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path

__all__ = ["CLAIM_ID", "LINK", "asserts", "broken_links", "heading_anchor", "headings",
           "ledger", "ledger_problems", "links", "section_code"]

# [text](NN_topic.ipynb#anchor): a link to a heading of a lesson notebook.
LINK = re.compile(r"\]\((\d\d_[A-Za-z0-9_]+\.ipynb)#((?:[^()\s]|\([^()\s]*\))+)\)")
_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s")
# 000-7, 004-12 (the documents' claims), L03-2 (a lesson's own claim).
CLAIM_ID = re.compile(r"^(?:\d{3}|L\d\d)-\d+$")
# Calls that raise when the claim is false: torch.testing.assert_close,
# labkit's exercises.check_* and comm.check_*; and checks.NAME for the names in
# labkit.checks.RAISING.
_RAISING_CALL = re.compile(r"^(assert|check_)")


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


def _cells(path: Path) -> list[tuple[str, str]]:
    """(cell type, source) of every cell of the notebook at `path`."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [(c["cell_type"],
             "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in nb["cells"]]


def _markdown_cells(path: Path) -> list[str]:
    return [source for kind, source in _cells(path) if kind == "markdown"]


def _heading_lines(source: str) -> list[str]:
    """The heading lines of one Markdown cell, fenced code left out."""
    found, fenced = [], False
    for line in source.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and _HEADING.match(line):
            found.append(line)
    return found


def headings(path: Path) -> set[str]:
    """Anchors of every Markdown heading in the notebook at `path`."""
    return {heading_anchor(line) for source in _markdown_cells(path)
            for line in _heading_lines(source)}


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


def section_code(path: Path, anchor: str) -> list[str] | None:
    """Code cells under the heading `anchor`, up to the next heading of any level.

    None if the notebook has no such heading.
    """
    inside, code = False, []
    for kind, source in _cells(path):
        if kind == "code":
            if inside:
                code.append(source)
            continue
        for line in _heading_lines(source):
            if inside:
                return code
            inside = heading_anchor(line) == anchor
    return code if inside else None


def _python(source: str) -> str:
    """A cell's Python, without IPython magics (`%%px`, `%time`, `!pip`)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def _is_raising_check(func: ast.expr) -> bool:
    """Whether `func` is `checks.NAME` with NAME one of labkit's raising checks."""
    from labkit import checks

    return (isinstance(func, ast.Attribute) and func.attr in checks.RAISING
            and isinstance(func.value, ast.Name) and func.value.id == "checks")


def asserts(source: str) -> bool:
    """Whether a code cell asserts: an `assert` statement or a raising check call."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = (func.attr if isinstance(func, ast.Attribute)
                    else getattr(func, "id", ""))
            if _RAISING_CALL.match(name) or _is_raising_check(func):
                return True
    return False


def ledger(path: Path) -> list[tuple[str, str | None, str | None]]:
    """(id, notebook, anchor) of every ledger row in the notebook at `path`.

    A ledger row is a table row whose first cell is a claim id; notebook and
    anchor are None when the row has no link.
    """
    rows = []
    for source in _markdown_cells(path):
        for line in source.splitlines():
            cells = line.split("|")
            if len(cells) > 2 and CLAIM_ID.match(cells[1].strip()):
                m = LINK.search(line)
                rows.append((cells[1].strip(), *(m.groups() if m else (None, None))))
    return rows


def ledger_problems(folder: Path, name: str = "08_errata.ipynb",
                    known_gaps: dict[str, str] | None = None) -> list[str]:
    """What is wrong with the claims ledger in `folder`/`name`, one line each.

    A row must have a unique id and a link to a section whose code asserts.
    `known_gaps` (id -> why) names rows whose section does not assert yet: they
    are not reported, but one that asserts now, or that no row has, is.
    """
    folder, known_gaps = Path(folder), dict(known_gaps or {})
    rows = ledger(folder / name)
    # A row whose id is mistyped would drop out of the ledger unseen.
    problems = [f"a table row without an id: {line[:60]}"
                for source in _markdown_cells(folder / name)
                for line in source.splitlines() if line.startswith("|")
                and line.split("|")[1].strip() not in ("id", "")
                and not set(line.split("|")[1].strip()) <= set("-:")
                and not CLAIM_ID.match(line.split("|")[1].strip())]
    problems += [f"{id_}: id used {n} times"
                 for id_, n in Counter(id_ for id_, _, _ in rows).items() if n > 1]
    for id_, target, anchor in rows:
        if target is None:
            problems.append(f"{id_}: no link to the cell that proves it")
            continue
        code = (section_code(folder / target, anchor)
                if (folder / target).exists() else None)
        if code is None:
            problems.append(f"{id_}: {target} has no heading #{anchor}")
        elif not any(asserts(c) for c in code):
            if id_ not in known_gaps:
                problems.append(f"{id_}: no assertion under {target}#{anchor}")
        elif id_ in known_gaps:
            problems.append(f"{id_}: {target}#{anchor} asserts now; "
                            "remove it from the known gaps")
    ids = {id_ for id_, _, _ in rows}
    problems += [f"{id_}: a known gap that no row has" for id_ in known_gaps
                 if id_ not in ids]
    return problems
