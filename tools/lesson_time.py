"""Estimate how long each lesson takes a learner: reading, running, exercises.

    python tools/lesson_time.py              # reading and exercises only
    python tools/lesson_time.py --run        # also execute each notebook, timed
    python tools/lesson_time.py --lang ja --run

Reading speed is an assumption, not a measurement, and is printed with the table:
prose at READ_RATE units a minute (English words; Japanese characters), code at
CODE_LINES_PER_MIN lines a minute, EXERCISE_MIN minutes for each exercise (its
attempt and the check). An exercise tagged `optional` (practice off the lesson's
path, which its heading says) is counted in `opt` and not in the minutes. `--run`
adds the seconds the notebook takes to execute here (tools/execute.py); without it
that column is empty. The instructor
guides' plans are built from this table.

A folded note (`<details>…</details>`, "how this was measured") is read only by
who opens it: its words are counted apart (`fold`) and not in the minutes; so are
the lines of a folded code cell (tagged `hide-input`: a figure's drawing or a
check, whose output the learner reads), counted in `hid`. The
table also says how the lesson is shaped: its figure calls (`fig`, the `plots.`
calls a learner runs), whether it has a summary and a self-check (cells tagged
so), and `lab %`, the share of the prose outside folds in sentences that report
runs, machines or torch's files rather than teach (LAB_SENTENCE: a rough
detector, for comparing a lesson with itself over time).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import execute
import nbcells
import nbformat
from build_notebooks import FOLD_CODE

ROOT = Path(__file__).resolve().parent.parent
READ_RATE = {"en": 180, "ja": 450}  # words / characters a minute, technical text
CODE_LINES_PER_MIN = 20
EXERCISE_MIN = 8
# A Japanese reading unit is one CJK or kana character, or one Latin word
# (code names and numbers inside the prose).
_JA_UNIT = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uff00-\uffef]|[A-Za-z0-9_.]+")
_FOLD = re.compile(r"<details>.*?</details>", re.S)
_SENTENCE = re.compile(r"[^.!?。！？\n]+[.!?。！？]?")
# Words of a sentence that reports a run, a machine or torch's sources.
LAB_SENTENCE = re.compile(
    r"this machine|on this run|run to run|from run|on another day|\bCI\b|loaded|"
    r"busy|quiet machine|shared CPU|two shared|in \d+ runs|\bruns? (?:gave|took)|"
    r"torch/[\w/]+\.py|\.py:\d+|このマシン|この実行|実行ごと|別の日|負荷|"
    r"\d+ 回の実行|回のうち|out of \d+ runs|torch \d\.\d+'s|`_[a-z]\w*`|\bbench\b|"
    r"\d[\d.]*\s*(?:to|〜|-|–)\s*\d[\d.]*\s*(?:ms|s|%|GB/s|MB/s)\b", re.I)
_FIGURE = re.compile(r"\b(plots|diagrams)\.\w+\(|noise_scale\.steps_vs_batch\(")


@dataclass
class LessonTime:
    """What one lesson asks of a learner, in units and in minutes."""

    name: str
    prose_units: int
    code_lines: int
    exercises: int
    run_s: float | None
    fold_units: int = 0
    figures: int = 0
    summary: bool = False
    self_check: bool = False
    lab_share: float = 0.0
    hidden_lines: int = 0
    optional: int = 0

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


def lab_units(text: str, lang: str) -> int:
    """The reading units of `text`'s sentences that LAB_SENTENCE calls reports."""
    return sum(prose_units(m.group(), lang) for m in _SENTENCE.finditer(text)
               if LAB_SENTENCE.search(m.group()))


def measure(path: Path, lang: str, run: bool) -> LessonTime:
    """The reading, code and exercises of one notebook; its run time if `run`."""
    nb = nbformat.read(path, as_version=4)
    markdown = [c.source for c in nb.cells if c.cell_type == "markdown"]
    shown = [_FOLD.sub("", text) for text in markdown]
    prose = sum(prose_units(text, lang) for text in shown)
    fold = sum(prose_units(text, lang) for text in markdown) - prose
    lab = sum(lab_units(text, lang) for text in shown)
    # A learner reads the code they run; solutions are hidden in the student copy.
    code = [c for c in nb.cells if c.cell_type == "code" and not nbcells.is_solution(c)]
    def lines_of(cells):
        return sum(1 for c in cells for line in c.source.splitlines() if line.strip())
    lines = lines_of(c for c in code if FOLD_CODE not in nbcells.tags(c))
    hidden = lines_of(c for c in code if FOLD_CODE in nbcells.tags(c))
    optional = sum(map(nbcells.is_optional, nb.cells))
    exercises = sum(map(nbcells.is_exercise, nb.cells)) - optional
    run_s = execute.run(path) if run else None
    figures = sum(len(_FIGURE.findall(c.source)) for c in code)
    tagged = {tag for c in nb.cells for tag in nbcells.tags(c)}
    return LessonTime(path.stem, prose, lines, exercises, run_s, fold, figures,
                      "summary" in tagged, "self-check" in tagged,
                      lab / prose if prose else 0.0, hidden, optional)


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
    print(f"{'lesson':<20} {'prose':>6} {'code':>5} {'ex':>3} {'opt':>3} {'run s':>6}"
          f" {'min':>5} {'fold':>5} {'hid':>4} {'fig':>3} {'sum':>3} {'chk':>3}"
          f" {'lab %':>5}")
    total = 0.0
    for path in sorted((args.notebooks / args.lang).glob("*.ipynb")):
        t = measure(path, args.lang, args.run)
        run = f"{t.run_s:6.1f}" if t.run_s is not None else f"{'':>6}"
        total += t.minutes(args.lang)
        print(f"{t.name:<20} {t.prose_units:>6} {t.code_lines:>5} {t.exercises:>3} "
              f"{t.optional:>3} {run} {t.minutes(args.lang):5.0f} {t.fold_units:>5} "
              f"{t.hidden_lines:>4} {t.figures:>3} "
              f"{'yes' if t.summary else 'no':>3} {'yes' if t.self_check else 'no':>3} "
              f"{100 * t.lab_share:5.1f}")
    print(f"{'total':<20} {'':>6} {'':>5} {'':>3} {'':>3} {'':>6} {total:5.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
