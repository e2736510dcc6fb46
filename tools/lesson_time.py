"""Estimate how long each lesson takes a learner: reading, running, exercises.

    python tools/lesson_time.py              # reading and exercises only
    python tools/lesson_time.py --run        # also execute each notebook, timed
    python tools/lesson_time.py --lang ja --run

Reading speed is an assumption, not a measurement, and is printed with the table:
prose at READ_RATE units a minute (English words; Japanese characters), code at
CODE_LINES_PER_MIN lines a minute, EXERCISE_MIN minutes for each exercise (its
attempt and the check). `--run` adds the seconds the notebook takes to execute
here (tools/execute.py); without it that column is empty. The instructor
guides' plans are built from this table.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import execute
import nbcells
import nbformat

ROOT = Path(__file__).resolve().parent.parent
READ_RATE = {"en": 180, "ja": 450}  # words / characters a minute, technical text
CODE_LINES_PER_MIN = 20
EXERCISE_MIN = 8
# A Japanese reading unit is one CJK or kana character, or one Latin word
# (code names and numbers inside the prose).
_JA_UNIT = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uff00-\uffef]|[A-Za-z0-9_.]+")


@dataclass
class LessonTime:
    """What one lesson asks of a learner, in units and in minutes."""

    name: str
    prose_units: int
    code_lines: int
    exercises: int
    run_s: float | None

    def minutes(self, lang: str) -> float:
        run_min = (self.run_s or 0.0) / 60
        reading = self.prose_units / READ_RATE[lang]
        return (reading + self.code_lines / CODE_LINES_PER_MIN
                + self.exercises * EXERCISE_MIN + run_min)


def prose_units(text: str, lang: str) -> int:
    """Reading units of Markdown `text`: words (en) or characters and words (ja)."""
    text = re.sub(r"\(https?://[^)]*\)|\([0-9]{2}_[^)]*\.ipynb[^)]*\)", "", text)
    if lang == "ja":
        return len(_JA_UNIT.findall(text))
    return len(re.findall(r"[A-Za-z0-9][A-Za-z0-9_'.-]*", text))


def measure(path: Path, lang: str, run: bool) -> LessonTime:
    """The reading, code and exercises of one notebook; its run time if `run`."""
    nb = nbformat.read(path, as_version=4)
    prose = sum(prose_units(c.source, lang)
                for c in nb.cells if c.cell_type == "markdown")
    # A learner reads the code they run; solutions are hidden in the student copy.
    code = [c for c in nb.cells if c.cell_type == "code" and not nbcells.is_solution(c)]
    lines = sum(1 for c in code for line in c.source.splitlines() if line.strip())
    exercises = sum(map(nbcells.is_exercise, nb.cells))
    run_s = execute.run(path) if run else None
    return LessonTime(path.stem, prose, lines, exercises, run_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lang", choices=sorted(READ_RATE), default="en")
    parser.add_argument("--run", action="store_true",
                        help="execute each notebook, timed")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    args = parser.parse_args(argv)

    unit = "words" if args.lang == "en" else "chars"
    print(f"assumed: prose {READ_RATE[args.lang]} {unit}/min, code "
          f"{CODE_LINES_PER_MIN} lines/min, {EXERCISE_MIN} min per exercise")
    print(f"{'lesson':<20} {'prose':>6} {'code':>5} {'ex':>3} {'run s':>6} {'min':>5}")
    total = 0.0
    for path in sorted((args.notebooks / args.lang).glob("*.ipynb")):
        t = measure(path, args.lang, args.run)
        run = f"{t.run_s:6.1f}" if t.run_s is not None else f"{'':>6}"
        total += t.minutes(args.lang)
        print(f"{t.name:<20} {t.prose_units:>6} {t.code_lines:>5} {t.exercises:>3} "
              f"{run} {t.minutes(args.lang):5.0f}")
    print(f"{'total':<20} {'':>6} {'':>5} {'':>3} {'':>6} {total:5.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
