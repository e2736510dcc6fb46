"""The claims ledger: every claim the course states, and the cell that proves it.

The ledger is the tables of the errata notebook: each row starts with an id
(`000-3`, `004-12` for the documents' claims, `L03-2` for a lesson's own) and
links to the section that proves it (tools/links.py says how links land). A
section is a heading and the cells under it up to the next heading; it proves
something only if one of its code cells asserts: an `assert` statement, or a
call that raises when the claim is false (`assert_*`, `check_*`, an exercise's
`grade_*`, or one of labkit.checks.RAISING).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import links

__all__ = ["CLAIM_ID", "asserts", "ledger", "ledger_problems"]

# 000-7, 004-12 (the documents' claims), L03-2 (a lesson's own claim).
CLAIM_ID = re.compile(r"^(?:\d{3}|L\d\d)-\d+$")
# Calls that raise when the claim is false: torch.testing.assert_close,
# labkit's exercises.grade_* and comm.check_*; and checks.NAME for the names in
# labkit.checks.RAISING.
_RAISING_CALL = re.compile(r"^(assert|check_|grade_)")


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


def _table_lines(path: Path) -> list[str]:
    """The table lines of the Markdown cells of the notebook at `path`."""
    return [line for _, kind, source in links.notebook_cells(path) if kind == "markdown"
            for line in source.splitlines() if line.startswith("|")]


def ledger(path: Path) -> list[tuple[str, str | None, str | None]]:
    """(id, notebook, fragment) of every ledger row in the notebook at `path`.

    A ledger row is a table row whose first cell is a claim id; notebook and
    fragment are None when the row has no link.
    """
    rows = []
    for line in _table_lines(path):
        first = line.split("|")[1].strip()
        if CLAIM_ID.match(first):
            m = links.LINK.search(line)
            rows.append((first, *(m.groups()[1:] if m else (None, None))))
    return rows


def ledger_problems(folder: Path, name: str = "16_errata.ipynb",
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
                for line in _table_lines(folder / name)
                if (first := line.split("|")[1].strip()) not in ("id", "")
                and not set(first) <= set("-:") and not CLAIM_ID.match(first)]
    problems += [f"{id_}: id used {n} times"
                 for id_, n in Counter(id_ for id_, _, _ in rows).items() if n > 1]
    for id_, target, fragment in rows:
        if target is None:
            problems.append(f"{id_}: no link to the cell that proves it")
            continue
        code = (links.section_code(folder / target, fragment)
                if (folder / target).exists() else None)
        if code is None:
            problems.append(f"{id_}: {target} has no heading #{fragment}")
        elif not any(asserts(c) for c in code):
            if id_ not in known_gaps:
                problems.append(f"{id_}: no assertion under {target}#{fragment}")
        elif id_ in known_gaps:
            problems.append(f"{id_}: {target}#{fragment} asserts now; "
                            "remove it from the known gaps")
    ids = {id_ for id_, _, _ in rows}
    problems += [f"{id_}: a known gap that no row has" for id_ in known_gaps
                 if id_ not in ids]
    return problems
