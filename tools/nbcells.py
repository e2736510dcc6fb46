"""What the tools read in a lesson notebook's cells: tags and headings.

A cell's tags say its part in an exercise (`exercise`: what a student fills in,
`solution`: the reference answer, removed from the student copies; `optional` on an
exercise: practice off the lesson's 45-minute path, which its heading says) or how nbval
treats it (`raises-exception`). A Markdown heading names its cell: the cell's id
(tools/build_notebooks.py) and the anchor a link lands on (tools/links.py) come
from the same heading lines, found here once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["HEADING", "heading_lines", "is_exercise", "is_optional", "is_solution",
           "tags"]

# A Markdown heading line: up to three spaces, one to six "#", a space; group 1 is
# its text.
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*)$")
_FENCE = re.compile(r"^(```|~~~)")


def tags(cell: Mapping) -> list[str]:
    """The tags of a notebook cell (nbformat's node or the plain JSON dict)."""
    return cell.get("metadata", {}).get("tags", [])


def is_solution(cell: Mapping) -> bool:
    """Whether `cell` holds a reference answer."""
    return "solution" in tags(cell)


def is_exercise(cell: Mapping) -> bool:
    """Whether `cell` is an exercise a student fills in."""
    return "exercise" in tags(cell)


def is_optional(cell: Mapping) -> bool:
    """Whether `cell` is an exercise a learner may skip (tagged `optional`)."""
    return is_exercise(cell) and "optional" in tags(cell)


def heading_lines(markdown: str) -> list[str]:
    """The heading lines of a Markdown cell's source, fenced code left out (a
    `# comment` in a code block is no heading)."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and HEADING.match(line):
            lines.append(line)
    return lines
