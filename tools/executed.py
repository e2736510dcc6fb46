"""The lessons as they last ran: one executed copy of each notebook, reused.

nbval, `make test`'s notebook test, executes every lesson; its plugin
(tools/nbval_record.py) keeps what it ran in build/executed/<lang>/<name>.ipynb,
with the run's facts in the notebook's metadata (`labkit_run`): when it ran, at
which commit, in how many seconds, in how many kernels, whether every cell passed,
and what it depended on. The site renders those copies and the output checks read
them, so a lesson runs once per `make test` and the site shows the very run that
was checked.

What it depended on is everything that changes what a lesson outputs (its
`ingredients`): the notebook itself, labkit's source, the installed packages and
their versions, and Python, each as a hash or a text. A copy whose ingredients differ
from today's notebook and environment is stale, as is one from a run that failed;
`refresh` runs the stale ones again (nbval, with the same plugin), so a kept copy
never shows an old run.

    python tools/executed.py              # run what is stale; list what was run
    python tools/executed.py --list       # only say what is stale, and why
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
FOLDER = ROOT / "build" / "executed"
LANGS = ("ja", "en")
META = "labkit_run"
# How nbval runs a lesson in make test; refresh runs stale lessons the same way.
NBVAL = ["--nbval-lax", "--nbval-current-env", "--nbval-cell-timeout=300"]


def labkit_fingerprint(root: Path = ROOT) -> str:
    """A hash of labkit's source: what the lessons run besides their own cells."""
    digest = hashlib.sha256()
    for path in sorted((root / "labkit").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache  # asked for each notebook; what is installed stays put in a run
def installed_packages() -> str:
    """Every installed distribution and its version, one per line, sorted."""
    return "\n".join(sorted({f"{d.metadata['Name']}=={d.version}".lower()
                             for d in importlib.metadata.distributions()
                             if d.metadata["Name"]}))


def python_version() -> str:
    return f"{platform.python_implementation()} {sys.version} {platform.machine()}"


def ingredients(notebook: Path) -> dict[str, str]:
    """What a lesson's outputs depend on besides chance, each as a hash or a text."""
    return {"notebook": hashlib.sha256(notebook.read_bytes()).hexdigest(),
            "labkit": labkit_fingerprint(),
            "packages": hashlib.sha256(installed_packages().encode()).hexdigest(),
            "python": python_version()}


def copy_of(notebook: Path, folder: Path = FOLDER) -> Path:
    """Where the executed copy of notebooks/<lang>/<name>.ipynb is kept."""
    return folder / notebook.parent.name / notebook.name


def commit() -> str:
    """The commit the lessons ran at; `+changes` when notebooks/ or labkit/ differ
    from it (a run from a working tree, not from the commit alone)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              encoding="utf-8", errors="replace")
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--", "notebooks", "labkit")
    return head + ("+changes" if changed else "")


def run_facts(notebook: Path, *, seconds: float, kernels: int, passed: bool,
              started: datetime.datetime) -> dict:
    """The `labkit_run` metadata of an executed copy."""
    return {"ingredients": ingredients(notebook), "commit": commit(),
            "executed_at": started.astimezone(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC"),
            "seconds": round(seconds, 1), "kernels_started": kernels,
            "passed": passed}


def facts(copy: Path) -> dict | None:
    """The `labkit_run` metadata of an executed copy, or None without one."""
    if not copy.exists():
        return None
    return json.loads(copy.read_text(encoding="utf-8"))["metadata"].get(META)


def why_stale(notebook: Path, folder: Path = FOLDER) -> str | None:
    """Why the executed copy of `notebook` cannot be shown, or None if it can."""
    found = facts(copy_of(notebook, folder))
    if found is None:
        return "never executed"
    if not found.get("passed"):
        return "its last run failed"
    now, then = ingredients(notebook), found.get("ingredients", {})
    changed = [name for name in now if now[name] != then.get(name)]
    return f"changed since it ran: {', '.join(changed)}" if changed else None


def notebooks(root: Path = NOTEBOOKS) -> list[Path]:
    return sorted(p for lang in LANGS for p in (root / lang).glob("*.ipynb"))


def stale(paths: list[Path], folder: Path = FOLDER) -> dict[Path, str]:
    """{notebook: why} for each of `paths` whose executed copy is stale."""
    return {p: why for p in paths if (why := why_stale(p, folder)) is not None}


def nbval_args(folder: Path = FOLDER) -> list[str]:
    """pytest's arguments that run lessons as make test does, with the recording
    plugin keeping each run in `folder`; the plugin needs tools_env()."""
    return ["-p", "nbval_record", *NBVAL, f"--executed-dir={folder}"]


def tools_env() -> dict[str, str]:
    """This process's environment with tools/ first on PYTHONPATH (where pytest
    finds the nbval_record plugin)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "tools"), *filter(None, [os.environ.get("PYTHONPATH")])]))


def execute(paths: list[Path], folder: Path = FOLDER) -> int:
    """Run `paths` under nbval with the recording plugin, as make test does; the
    exit status of pytest."""
    if not paths:
        return 0
    cmd = [sys.executable, "-m", "pytest", *nbval_args(folder), *map(str, paths)]
    return subprocess.run(cmd, cwd=ROOT, env=tools_env()).returncode


def refresh(paths: list[Path], folder: Path = FOLDER) -> tuple[list[Path], int]:
    """Run again the notebooks of `paths` whose copy is stale; (run, exit status)."""
    todo = list(stale(paths, folder))
    return todo, execute(todo, folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true",
                        help="only list the stale copies and why")
    parser.add_argument("--out", type=Path, default=FOLDER)
    parser.add_argument("paths", nargs="*", type=Path,
                        help="notebooks (default: every lesson of both languages)")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.paths] or notebooks()
    if args.list:
        for path, why in stale(paths, args.out).items():
            print(f"{path.relative_to(ROOT)}: {why}")
        return 0
    for path, why in stale(paths, args.out).items():
        print(f"executed: {path.relative_to(ROOT)} runs again: {why}")
    todo, status = refresh(paths, args.out)
    print(f"executed: {len(paths) - len(todo)} of {len(paths)} notebooks reused, "
          f"{len(todo)} run")
    return status


if __name__ == "__main__":
    sys.exit(main())
