"""Run lesson notebooks headless, as a learner's "Run All" in JupyterLab does.

Each notebook runs in the kernel its metadata names, in its own folder (where
JupyterLab starts its kernel, so that relative paths mean the same), and a cell
may take TIMEOUT_S seconds (nbgrader's course runs its cells with the same
limit). Nothing is written back: this times a lesson (tools/lesson_time.py --run,
bench/run.py) and runs the course without nbval. The checked run of a lesson,
whose outputs the site shows, is nbval's (tools/executed.py).

    python tools/execute.py notebooks/ja/*.ipynb   # non-zero on a cell's error
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat

__all__ = ["TIMEOUT_S", "run"]

# Seconds a cell may take: room for a lesson's slowest cell on a slow laptop, and
# still an end to a cell that hangs.
TIMEOUT_S = 600


def run(path: Path, timeout_s: int = TIMEOUT_S) -> float:
    """Execute the notebook at `path`; its seconds, kernel start included.

    Raises nbclient's CellExecutionError for a cell that raises and is not
    tagged `raises-exception`.
    """
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout_s,
                   resources={"metadata": {"path": str(path.parent.resolve())}}
                   ).execute()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=TIMEOUT_S,
                        help="seconds a cell may take")
    args = parser.parse_args(argv)
    from nbclient.exceptions import (
        CellExecutionError,
        CellTimeoutError,
        DeadKernelError,
    )

    failed = 0
    for path in args.notebooks:
        try:
            seconds = run(path, args.timeout)
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
            failed += 1
            print(f"{path}: failed\n{err}", file=sys.stderr)
            continue
        print(f"{path}: {seconds:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
