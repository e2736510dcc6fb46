"""The README's table of labkit's modules and the site's reference list name the
modules that exist, and every one of them: a rename that forgets either fails here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABKIT = ROOT / "labkit"


def _package_names() -> set[str]:
    """labkit's flat modules, and its subpackages with a trailing slash."""
    flat = {p.stem for p in LABKIT.glob("*.py") if p.stem != "__init__"}
    packages = {f"{p.name}/" for p in LABKIT.iterdir() if (p / "__init__.py").is_file()}
    return flat | packages


def _table_names(text: str) -> set[str]:
    """The names in the first column of a README's module table."""
    start = text.index("\nmodels, data ")
    block = text[start:text.index("```", start)]
    names = set()
    for line in block.splitlines():
        if not line or line.startswith(" "):
            continue  # a continuation line
        first = re.split(r" {2,}", line)[0]
        names.update(name.strip() for name in first.split(","))
    return names


@pytest.mark.parametrize("readme", ["README.md", "README.ja.md"])
def test_the_module_table_names_every_module_and_only_those(readme):
    table = _table_names((ROOT / readme).read_text(encoding="utf-8"))
    modules = _package_names()
    assert table - modules == set(), f"{readme} names modules labkit does not have"
    assert modules - table == set(), f"{readme}'s module table misses these"


def test_the_table_reader_sees_names_and_skips_continuation_lines():
    """What the check above compares: a table's first-column names, several to a
    line, and nothing from a description's continuation lines."""
    text = ("x\nmodels, data          the models\ncomm                  costs\n"
            "cluster/              the ranks (ranks.py,\n"
            "                      engine.py)\n```\n")
    assert _table_names(text) == {"models", "data", "comm", "cluster/"}


def test_the_site_reference_documents_modules_that_exist():
    page = (ROOT / "website" / "api_modules.md").read_text(encoding="utf-8")
    listed = re.findall(r"automodule:: (\S+)", page)
    assert listed, "website/api_modules.md lists no module"
    missing = [name for name in listed if importlib.util.find_spec(name) is None]
    assert missing == []
