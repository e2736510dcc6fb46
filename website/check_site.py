"""Checks of the built site that Sphinx does not make: every internal link lands on a
page that exists and on an anchor that page has, every lesson page shows as many
figures as its lesson made when it ran and links its twin, both languages have the
same pages, and the run each page shows passed: errors only in the cells tagged
`raises-exception`, and in each of those. Every solution cell of a lesson is on its
page folded (opened on request), and no Japanese page shows a line break of its
source as a space inside a Japanese sentence.

    python website/check_site.py build/site build/executed  # each problem; exit 1 if so

build/executed/<lang> holds the lessons as make test's nbval run executed them
(tools/executed.py), the copies the site renders.
"""

from __future__ import annotations

import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from build_notebooks import JAPANESE, JAPANESE_PUNCTUATION  # noqa: E402

LANGS = ("ja", "en")
# a break that join_japanese_lines drops from a source, left in a page's text
_JA_BREAK = re.compile(rf"[{JAPANESE}]\s*\n\s*[{JAPANESE}]"
                       rf"|[{JAPANESE_PUNCTUATION}]\s*\n\s*\S"
                       rf"|\S\s*\n\s*[{JAPANESE_PUNCTUATION}]")
# Tags inside a run of text: the text on both sides of one reads as one line.
# Code is a word of its own (a space beside it is right): it reads as "`".
_INLINE = {"a", "strong", "em", "b", "i", "span", "sup", "sub", "abbr", "small"}
# Text that keeps its line breaks, or is no text a reader sees.
_VERBATIM = {"pre", "script", "style", "textarea"}


class _Page(HTMLParser):
    """The ids, links and images of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []
        self.twins: list[str] = []
        self.resources: list[str] = []  # what the page loads: scripts, styles, images
        self.solutions = 0  # solution cells (myst-nb's div.tag_solution)
        # parts of a solution, or of the check run on it, shown without a click
        self.unfolded: list[str] = []
        self.breaks: list[str] = []  # Japanese line breaks shown as spaces
        # the open <div> and <details>: tag, classes, whether folded, and "solution"
        # for a solution cell, "check" for the cell after one
        self._blocks: list[tuple[str, set[str], bool, str]] = []
        self._check_at: int | None = None  # where the cell after a solution starts
        self._verbatim = 0
        self._text = ""

    def _check_text(self) -> None:
        self.breaks += [m.group(0).replace("\n", "⏎") for m in
                        _JA_BREAK.finditer(self._text)]
        self._text = ""

    def handle_data(self, data: str) -> None:
        if not self._verbatim:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if tag in _VERBATIM:
            self._verbatim -= 1
        elif tag == "code":
            self._text += "`"
        elif tag not in _INLINE:
            self._check_text()
        if tag in ("div", "details") and self._blocks:
            if self._blocks.pop()[3] == "solution":
                self._check_at = len(self._blocks)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attr = dict(attrs)
        if tag in _VERBATIM:
            self._verbatim += 1
        elif tag == "code":
            self._text += "`"
        elif tag not in _INLINE:
            self._check_text()
        classes = set((attr.get("class") or "").split())
        kind = ""
        if tag == "div" and "tag_solution" in classes:
            self.solutions += 1
            kind = "solution"
        elif self._check_at == len(self._blocks):  # the next thing after a solution
            kind = "check" if tag == "div" and "cell" in classes else ""
            self._check_at = None
        if tag in ("div", "details"):
            self._blocks.append((tag, classes, tag == "details" and "open" not in attr,
                                 kind))
        part = [name for cls, name in (("cell_input", "code"),
                                       ("cell_output", "output")) if cls in classes]
        if tag == "div" and part:
            inside = self._blocks[:-1]
            kinds = {k for _, _, _, k in inside}
            # a solution folds whole; its check shows its code, not its verdict
            hidden = "solution" in kinds or ("check" in kinds and part == ["output"])
            if hidden and not any(folded for _, _, folded, _ in inside):
                whose = "solution" if "solution" in kinds else "check of a solution"
                self.unfolded.append(f"the {whose}'s {part[0]}")
        if attr.get("id"):
            self.ids.add(attr["id"])
        if tag == "a" and attr.get("name"):
            self.ids.add(attr["name"])
        if tag == "a" and attr.get("href"):
            self.links.append(attr["href"])
            if "labkit-twin" in (attr.get("class") or "").split():
                self.twins.append(attr["href"])
        if tag == "img" and attr.get("src"):
            self.images.append(attr["src"])
        if tag in ("script", "img", "iframe", "source") and attr.get("src"):
            self.resources.append(attr["src"])
        if tag == "link" and attr.get("href") and set(
                (attr.get("rel") or "").split()) & {"stylesheet", "preload", "icon"}:
            self.resources.append(attr["href"])


def read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _pages(site: Path) -> dict[Path, _Page]:
    return {path: read(path) for path in sorted(site.rglob("*.html"))
            if "_static" not in path.parts}


def solutions(notebook: Path) -> int:
    """How many solution cells (tagged `solution`) a notebook has."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return sum("solution" in c.get("metadata", {}).get("tags", []) for c in cells)


def figures(notebook: Path) -> int:
    """How many figures (images) the cells of an executed notebook output."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return sum(any(mime.startswith("image/") for mime in output.get("data", {}))
               for cell in cells for output in cell.get("outputs", []))


# What the notebook machinery (the kernel, jupyter_client, ipyparallel's engines)
# logs or warns about itself, which is nothing a lesson shows: e.g. ipykernel's
# "[IPKernelApp] WARNING | Kernel is running over TCP without encryption", a
# warning raised in jupyter_client's modules (".../jupyter_client/session.py:721:
# UserWarning"), or a line of its loggers ("jupyter_client.session"). A process the
# kernel starts (an engine) writes to the kernel's stderr, which ipykernel puts in
# the output of whichever cell is running.
_MACHINERY = re.compile(r"\[(IPKernelApp|IPEngine|IPController)[^\]]*\]"
                        r"|Kernel is running over TCP without encryption"
                        r"|(jupyter_client|ipykernel|ipyparallel|zmq)"
                        r"([/\\]\S+\.py:\d+|\.[a-z_]+\b)")


def _output_text(output: dict) -> str:
    """An output's text (a traceback, which a lesson means, left out)."""
    parts = [output.get("text", ""), output.get("data", {}).get("text/plain", "")]
    return "\n".join("".join(p) if isinstance(p, list) else p for p in parts)


def run_problems(notebook: Path) -> list[str]:
    """What is wrong with an executed notebook's run: a cell that raised without
    the `raises-exception` tag, a tagged one that raised nothing, a failed run, an
    output where the notebook machinery talks about itself."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    found = []
    if not nb.get("metadata", {}).get("labkit_run", {}).get("passed", True):
        found.append("its run failed")
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for n, cell in enumerate(code):
        raised = any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        meant = "raises-exception" in cell.get("metadata", {}).get("tags", [])
        if raised and not meant:
            found.append(f"code cell {n} raised, untagged")
        elif meant and not raised:
            found.append(f"code cell {n} is tagged raises-exception and raised nothing")
        for output in cell.get("outputs", []):
            said = _MACHINERY.search(_output_text(output))
            if said:
                found.append(f"code cell {n} shows the machinery's message: "
                             f"{said.group(0)}")
    return found


def problems(site: Path, executed: Path) -> list[str]:
    """Everything wrong with the site built in `site` (its ja/ and en/ folders), its
    lessons as they ran in `executed`/<lang>/<name>.ipynb."""
    site = site.resolve()
    pages = _pages(site)
    found: list[str] = []
    for path, page in pages.items():
        where = path.relative_to(site)
        for href in page.links:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("mailto:"):
                continue  # outside the site: not checked here
            target = path if not parts.path else (path.parent / unquote(parts.path))
            target = target.resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                found.append(f"{where}: link to a missing file: {href}")
                continue
            anchor = unquote(parts.fragment)
            if anchor and target.suffix == ".html" and anchor not in (
                    pages[target] if target in pages else read(target)).ids:
                found.append(f"{where}: link to a missing anchor: {href}")
        for src in page.images:
            if not urlsplit(src).scheme and not (path.parent / unquote(src)).exists():
                found.append(f"{where}: missing image: {src}")
        if where.parts[0] == "ja" and page.breaks:
            found.append(f"{where}: Japanese line breaks shown as spaces: "
                         + ", ".join(page.breaks[:5]))
        found += [f"{where}: {part} shows unfolded" for part in page.unfolded]
    for lang in LANGS:
        twin = LANGS[1 - LANGS.index(lang)]
        names = {p.relative_to(site / lang) for p in pages
                 if p.is_relative_to(site / lang)}
        others = {p.relative_to(site / twin) for p in pages
                  if p.is_relative_to(site / twin)}
        for name in sorted(names - others):
            found.append(f"{lang}/{name}: no {twin} twin")
        for name in sorted(names):
            if not pages[site / lang / name].twins:
                found.append(f"{lang}/{name}: no link to its {twin} twin")
        lessons = sorted(n for n in names if n.parts[0] == "lessons")
        if not lessons:
            found.append(f"{lang}: no lesson pages")
        for name in lessons:
            page = pages[site / lang / name]
            ran = executed / lang / name.with_suffix(".ipynb").name
            if not ran.exists():
                found.append(f"{lang}/{name}: its lesson did not run ({ran})")
                continue
            found += [f"{lang}/{name}: {problem}" for problem in run_problems(ran)]
            shown = sum(Path(urlsplit(src).path).suffix in (".png", ".svg")
                        for src in page.images)
            if shown < figures(ran):
                found.append(f"{lang}/{name}: {shown} of its lesson's "
                             f"{figures(ran)} figures")
            if page.solutions != solutions(ran):
                found.append(f"{lang}/{name}: {page.solutions} solution cells, its "
                             f"lesson has {solutions(ran)}")
    return found


def main(argv: list[str]) -> int:
    found = problems(Path(argv[0]), Path(argv[1]))
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
