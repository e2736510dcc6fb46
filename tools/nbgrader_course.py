"""Write the course as an nbgrader course, then its release for students.

Each lesson with exercises, in each language, is one assignment
(`ja-04_no_sync`, `en-04_no_sync`, ...) whose instructor version, in
source/<assignment>/<lesson>.ipynb, is the lesson with nbgrader's cell metadata:

- an exercise cell and its solution cell become one autograded answer: the
  exercise as the student copies hand it out, then the reference solution
  between nbgrader's markers, which `nbgrader generate_assignment` removes;
- the check cell after them (`exercises.grade_...`) becomes an autograder test
  worth POINTS points: a check raises WrongAnswer, with its hint, on a wrong answer;
- every other cell is read-only.

    python tools/nbgrader_course.py                   # build/nbgrader
    python tools/nbgrader_course.py --out some/dir    # a course folder elsewhere

The folder gets nbgrader_config.py and its gradebook, source/ and release/
(written by nbgrader's generate_assignment). nbgrader's commands run in this
process through its Python API (`grader`): importing nbgrader and starting a
process once for all of them, not once per command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path, PurePath

import execute
import nbcells
import nbformat

ROOT = Path(__file__).resolve().parent.parent
LANGS = ("ja", "en")
POINTS = 1
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CONFIG = '''\
# nbgrader's settings for the course written by tools/nbgrader_course.py.
c = get_config()  # noqa: F821
c.CourseDirectory.root = {root!r}
c.CourseDirectory.course_id = "labkit"
c.CourseDirectory.db_url = {db_url!r}
# The student's version of an answer is the exercise as handed out: nothing is
# put where the reference solution was.
c.ClearSolutions.code_stub = {{"python": ""}}
# Seconds a cell may take, as when a lesson runs headless (tools/execute.py).
c.ExecutePreprocessor.timeout = {timeout}
'''


def _nbgrader(cell, grade_id: str, *, solution=False, grade=False, locked=False):
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked,
            "schema_version": 3, "solution": solution, "task": False}
    if grade:
        meta["points"] = POINTS
    cell.metadata["nbgrader"] = meta
    return cell


def commented_file(cell: str) -> str:
    """A %%writefile cell with the file's lines commented out: the magic stays,
    so that the learner's cell still writes the file."""
    magic, body = cell.split("\n", 1)
    return magic + "\n" + "\n".join(f"# {line}".rstrip() for line in body.splitlines())


def _answer(exercise: str, solution: str) -> str:
    """One cell: the exercise, then the reference solution between the markers. A
    cell magic (%%px: the answer runs on every rank) stays on the first line."""
    if exercise.startswith("%%writefile"):
        # The cell is one file: the exercise stays as comments to start from, or
        # the file would hold both programs
        exercise = commented_file(exercise)
    magic = ""
    if exercise.startswith("%%") and solution.startswith("%%"):
        magic, exercise = exercise.split("\n", 1)
        solution = solution.split("\n", 1)[1]
        magic += "\n"
    return f"{magic}{exercise.rstrip()}\n{BEGIN}\n{solution.rstrip()}\n{END}"


def instructor_version(nb: nbformat.NotebookNode, lesson: str) -> nbformat.NotebookNode:
    """The lesson `nb` with nbgrader's metadata (see the module's docstring)."""
    nb = nbformat.from_dict(nb)
    cells, out, number = nb.cells, [], 0
    i = 0
    while i < len(cells):
        cell = cells[i]
        if nbcells.is_exercise(cell):
            solution, check = cells[i + 1], cells[i + 2]
            if (not nbcells.is_solution(solution)
                    or "exercises.grade_" not in check.source):
                raise ValueError(f"{lesson}, cell {i + 1}: an exercise is followed by "
                                 "its solution, then its check")
            number += 1
            answer = nbformat.v4.new_code_cell(_answer(cell.source, solution.source),
                                               id=cell.id)
            answer.metadata["tags"] = ["exercise"]
            out.append(_nbgrader(answer, f"{lesson}-answer-{number}", solution=True))
            out.append(_nbgrader(check, f"{lesson}-check-{number}", grade=True,
                                 locked=True))
            i += 3
            continue
        if nbcells.is_solution(cell):
            raise ValueError(f"{lesson}, cell {i + 1}: a solution without its exercise")
        out.append(_nbgrader(cell, f"{lesson}-{cell.id}", locked=True))
        i += 1
    nb.cells = out
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb


def assignments(notebooks: Path) -> dict[str, Path]:
    """{assignment id: lesson notebook} for every lesson with exercises."""
    found = {}
    for lang in LANGS:
        for path in sorted((notebooks / lang).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            if any(map(nbcells.is_exercise, nb.cells)):
                found[f"{lang}-{path.stem}"] = path
    return found


def config_text(course: PurePath) -> str:
    """nbgrader_config.py for the course folder `course`.

    Both paths go in as Python literals (repr), so a Windows path's backslashes stay
    backslashes (C:\\Users would otherwise be a \\U escape); the database URL takes
    forward slashes, which SQLAlchemy's sqlite URL and Windows both accept.
    """
    db_url = "sqlite:///" + (course / "gradebook.db").as_posix()
    return CONFIG.format(root=str(course), db_url=db_url, timeout=execute.TIMEOUT_S)


def write_course(course: Path, notebooks: Path = ROOT / "notebooks") -> list[str]:
    """nbgrader_config.py and source/ in `course`; the assignment ids."""
    course = course.resolve()
    course.mkdir(parents=True, exist_ok=True)
    (course / "nbgrader_config.py").write_text(config_text(course), encoding="utf-8")
    found = assignments(notebooks)
    for assignment, path in found.items():
        target = course / "source" / assignment / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        lesson = path.stem.split("_")[0]
        nbformat.write(instructor_version(nbformat.read(path, as_version=4), lesson),
                       target)
    return list(found)


@contextlib.contextmanager
def _scripts_on_path():
    """This Python's scripts first on PATH, also where the environment is not
    activated (make, CI): nbgrader runs `alembic` by name when it creates a
    gradebook."""
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), before])
    try:
        yield
    finally:
        os.environ["PATH"] = before


def grader(course: Path):
    """nbgrader's API (`nbgrader.apps.NbGraderAPI`) on `course`, configured by its
    nbgrader_config.py. Its commands return {"success": bool, "log": ..., "error":
    ...} instead of exiting; a notebook it runs still gets a kernel of its own."""
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py",
                                path=str(Path(course).resolve())).load_config()
    coursedir = CourseDirectory(config=config)
    # Created here, once, where alembic is found; later commands open it.
    with _scripts_on_path():
        Gradebook(coursedir.db_url, coursedir.course_id).close()
    return NbGraderAPI(coursedir=coursedir, config=config)


def validate(api, notebook: Path) -> dict:
    """What `nbgrader validate notebook` reports, run with `api`'s settings: {}
    when every check passes, else the cells that failed or changed."""
    from nbgrader.validator import Validator

    return Validator(parent=api).validate(str(notebook))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "nbgrader")
    args = parser.parse_args(argv)
    found = write_course(args.out)
    api = grader(args.out)
    for assignment in found:
        done = api.generate_assignment(assignment, force=True)
        if not done["success"]:
            print(done.get("log", "") + done.get("error", ""), file=sys.stderr)
            return 1
    print(f"wrote the nbgrader course to {args.out}: source/ and release/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
