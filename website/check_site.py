"""Checks of the built site that Sphinx does not make: every internal link lands on a
page that exists and on an anchor that page has, every lesson page shows as many
figures as its lesson made when it ran and links its twin, both languages have the
same pages, and the run each page shows passed: errors only in the cells tagged
`raises-exception`, and in each of those.

    python website/check_site.py build/site build/executed  # each problem; exit 1 if so

build/executed/<lang> holds the lessons as make test's nbval run executed them
(tools/executed.py), the copies the site renders.
"""

from __future__ import annotations

import json
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

LANGS = ("ja", "en")


class _Page(HTMLParser):
    """The ids, links and images of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []
        self.twins: list[str] = []
        self.resources: list[str] = []  # what the page loads: scripts, styles, images

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attr = dict(attrs)
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


def figures(notebook: Path) -> int:
    """How many figures (images) the cells of an executed notebook output."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return sum(any(mime.startswith("image/") for mime in output.get("data", {}))
               for cell in cells for output in cell.get("outputs", []))


def run_problems(notebook: Path) -> list[str]:
    """What is wrong with an executed notebook's run: a cell that raised without
    the `raises-exception` tag, a tagged one that raised nothing, a failed run."""
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
    return found


def main(argv: list[str]) -> int:
    found = problems(Path(argv[0]), Path(argv[1]))
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
