"""Write the student copies: every lesson notebook without its solution cells.

Cells tagged `solution` are removed; everything else, the `exercise` cells and
the checks after them included, is kept, with empty outputs.

    python tools/student_copies.py                  # dist/student/ja, dist/student/en
    python tools/student_copies.py --out some/dir   # some/dir/ja, some/dir/en
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbcells
import nbformat

ROOT = Path(__file__).resolve().parent.parent
LANGS = ("ja", "en")


def student_copy(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of `nb` without solution cells, and without outputs."""
    nb = nbformat.from_dict(nb)
    nb.cells = [cell for cell in nb.cells if not nbcells.is_solution(cell)]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "student")
    args = parser.parse_args(argv)

    written = 0
    for lang in LANGS:
        sources = sorted((args.notebooks / lang).glob("*.ipynb"))
        if not sources:
            print(f"no notebooks in {args.notebooks / lang}", file=sys.stderr)
            return 1
        target = args.out / lang
        target.mkdir(parents=True, exist_ok=True)
        for stale in target.glob("*.ipynb"):  # a lesson that no longer exists
            stale.unlink()
        for path in sources:
            nb = student_copy(nbformat.read(path, as_version=4))
            nbformat.write(nb, target / path.name)
            written += 1
    print(f"wrote {written} student notebooks to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
