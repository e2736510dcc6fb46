"""A lesson's code cells as the tests run them: each found by a line it contains.

Tests that run a lesson's own cells (as written, or with one line changed) read
them from the built notebook, so that what they check is what learners run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def finder(lesson: str, lang: str = "en") -> Callable[..., str]:
    """`find(text, tag=None)` for the notebook `lesson` (its stem) in `lang`.

    `find` returns the one code cell that contains `text`, without its `%%px`
    line: among the cells tagged `tag` when one is given, else among the cells
    that are not an exercise's starting point (whose lines the solution shares).
    """
    cells = [c for c in nbformat.read(NOTEBOOKS / lang / f"{lesson}.ipynb",
                                      as_version=4).cells if c.cell_type == "code"]

    def find(text: str, tag: str | None = None) -> str:
        found = [c.source for c in cells if text in c.source
                 and (tag in c.metadata.get("tags", []) if tag
                      else "exercise" not in c.metadata.get("tags", []))]
        assert len(found) == 1, (lesson, text, len(found))
        return found[0].removeprefix("%%px\n") + "\n"

    return find
