"""The course as an nbgrader course (tools/nbgrader_course.py), checked with nbgrader.

nbgrader is in the grading extra, which make nbgrader-check (part of make test)
installs before it runs this file. The first tests only write and release the
course. The round trip, which runs every lesson with exercises (about a quarter of
an hour here), runs where LABKIT_NBGRADER=1 (make nbgrader-check): nbgrader validates
the reference answers, autogrades them to full marks, and autogrades a
submission per lesson with one typical mistake, which loses exactly that
exercise's points and gets the check's hint in its feedback.
"""

import html
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import nbgrader_course  # noqa: E402

pytest.importorskip("nbgrader", reason="nbgrader is in the grading extra: "
                    "make nbgrader-check installs it and runs these tests")


def _cell(kind, source, tags=()):
    cell = (nbformat.v4.new_code_cell if kind == "code"
            else nbformat.v4.new_markdown_cell)(source)
    cell.metadata["tags"] = list(tags)
    return cell


def _lesson(*cells):
    return nbformat.v4.new_notebook(cells=list(cells))


def test_an_exercise_its_solution_and_its_check_become_an_answer_and_a_test():
    nb = _lesson(
        _cell("markdown", "## Exercise"),
        _cell("code", "%%px\ndef f(x):\n    return x  # TODO: double it\n",
              ["exercise"]),
        _cell("code", "%%px\ndef f(x):\n    return 2 * x\n", ["solution"]),
        _cell("code", "exercises.grade_f(ranks, f)"),
    )
    out = nbgrader_course.instructor_version(nb, "04").cells
    assert [c.metadata["nbgrader"]["grade_id"] for c in out] == [
        f"04-{nb.cells[0].id}", "04-answer-1", "04-check-1"]
    heading, answer, check = (c.metadata["nbgrader"] for c in out)
    assert heading["locked"] and not heading["grade"] and not heading["solution"]
    assert answer["solution"] and not answer["locked"] and not answer["grade"]
    assert check["grade"] and check["locked"] and check["points"] == 1
    # the cell magic stays first; the exercise, then the solution between markers
    assert out[1].source == ("%%px\ndef f(x):\n    return x  # TODO: double it\n"
                             "### BEGIN SOLUTION\ndef f(x):\n    return 2 * x\n"
                             "### END SOLUTION")


@pytest.mark.parametrize("cells", [
    [_cell("code", "x = 1", ["exercise"]), _cell("code", "x = 2"),
     _cell("code", "exercises.grade_x(x)")],
    [_cell("code", "x = 2", ["solution"])],
])
def test_a_lesson_out_of_the_course_s_shape_is_refused(cells):
    with pytest.raises(ValueError, match="solution"):
        nbgrader_course.instructor_version(_lesson(*cells), "01")


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """The course written and released (every assignment) in a folder of its own."""
    folder = tmp_path_factory.mktemp("nbgrader")
    assert nbgrader_course.main(["--out", str(folder)]) == 0
    return folder


def test_every_lesson_with_exercises_is_released_as_the_student_copies_have_it(course):
    released = sorted(p.name for p in (course / "release").iterdir())
    assert released == sorted(f"{lang}-{p.stem}" for lang in ("ja", "en")
                              for p in (ROOT / "notebooks" / lang).glob("*.ipynb")
                              if p.stem[:2] not in ("00", "11"))
    for assignment in released:
        lang, lesson = assignment.split("-", 1)
        release = nbformat.read(course / "release" / assignment / f"{lesson}.ipynb", 4)
        full = nbformat.read(ROOT / "notebooks" / lang / f"{lesson}.ipynb", 4)
        exercises = [c.source for c in full.cells
                     if "exercise" in c.metadata.get("tags", [])]
        answers = [c.source for c in release.cells
                   if c.metadata["nbgrader"]["solution"]]
        assert [a.rstrip() for a in answers] == [e.rstrip() for e in exercises]
        assert not any("BEGIN SOLUTION" in c.source for c in release.cells)
        # each solution merged into its exercise
        assert len(release.cells) == len(full.cells) - len(exercises)


# --- the round trip ------------------------------------------------------------

# One typical mistake per lesson, in the first exercise's reference answer, as
# (language, text of the solution, what a learner writes instead). The language
# alternates, so that hints in both are seen.
MISTAKES = {
    "01": ("ja", "x = x.flatten(1)", "x = x.view(-1)"),  # the document's own bug
    "02": ("en", "(7, 3): [3, 3, 1]", "(7, 3): [3, 2, 2]"),  # an even split
    "03": ("ja", "        sampler.set_epoch(epoch)", "        pass"),  # no set_epoch
    "04": ("en", "loss = criterion(model(X), y) / K", "loss = criterion(model(X), y)"),
    "05": ("ja", "2 * (8 - 1) / 8 * nbytes / ab.beta", "nbytes / ab.beta"),
    "06": ("en", "        if not self.require_sync:\n            return", ""),
    "07": ("ja", "    model.eval()", "    pass"),  # evaluated in training mode
    "08": ("en", "base_lr * batch_size / base_batch", "base_lr"),  # not scaled
    "09": ("ja", '"RANK": node_rank * nproc_per_node + local_rank',
           '"RANK": local_rank'),  # RANK equal to LOCAL_RANK
    "10": ("en", "if p.grad is None", "if p.grad is not None"),
}
NOT_YET = {"ja": "まだです。", "en": "Not yet. "}

needs_round_trip = pytest.mark.skipif(
    os.environ.get("LABKIT_NBGRADER") != "1",
    reason="the round trip runs every lesson: make nbgrader-check runs it")


def _submit(course, student, assignment, notebook):
    lesson = assignment.split("-", 1)[1]
    folder = course / "submitted" / student / assignment
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, folder / f"{lesson}.ipynb")


def _with_mistake(source_nb, lesson):
    """The reference answers, but the first exercise's with the lesson's mistake."""
    _, right, wrong = MISTAKES[lesson]
    nb = nbformat.from_dict(source_nb)
    answer = next(c for c in nb.cells if c.metadata["nbgrader"]["solution"])
    assert answer.source.count(right) >= 1, f"{lesson}: {right!r} not in its answer"
    answer.source = answer.source.replace(right, wrong)
    return nb


@needs_round_trip
@pytest.mark.timeout(2400)  # every lesson with exercises, run about three times
def test_round_trip_validate_autograde_feedback(course):
    from nbgrader.api import Gradebook

    assignments = sorted(p.name for p in (course / "source").iterdir())
    wrong = {f"{lang}-{path.stem}" for lesson, (lang, _, _) in MISTAKES.items()
             for path in (ROOT / "notebooks" / lang).glob(f"{lesson}_*.ipynb")}
    assert len(wrong) == len(MISTAKES) and wrong <= set(assignments)

    # validate: the reference answers pass every check (one language: the other
    # is autograded below with the same code)
    ja_sources = sorted(str(p) for p in (course / "source").glob("ja-*/*.ipynb"))
    done = nbgrader_course.nbgrader(course, "validate", *ja_sources)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("Success! Your notebook passes all the tests.") == len(
        ja_sources), done.stdout[-3000:]

    for assignment in assignments:
        lesson = assignment.split("-", 1)[1]
        source = nbformat.read(course / "source" / assignment / f"{lesson}.ipynb", 4)
        _submit(course, "reference", assignment, source)
        if assignment in wrong:
            _submit(course, "mistake", assignment, _with_mistake(source, lesson[:2]))
        done = nbgrader_course.nbgrader(course, "autograde", assignment, "--force")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    with Gradebook(f"sqlite:///{course}/gradebook.db") as gradebook:
        scores = {}
        for assignment in assignments:
            reference = gradebook.find_submission(assignment, "reference")
            scores[assignment] = (reference.score, reference.max_score)
            assert reference.score == reference.max_score > 0, assignment
            if assignment not in wrong:
                continue
            mistake = gradebook.find_submission(assignment, "mistake")
            lost = {g.name: g.score for n in mistake.notebooks for g in n.grades
                    if g.score < g.max_score}
            prefix = assignment.split("-", 1)[1][:2]
            assert lost == {f"{prefix}-check-1": 0}, assignment
            assert mistake.score == reference.max_score - nbgrader_course.POINTS
    print("scores of the reference answers:", scores)

    # the hint reaches the student: in the autograded check and in the feedback
    for assignment in sorted(wrong):
        done = nbgrader_course.nbgrader(course, "generate_feedback", assignment,
                                        "--student", "mistake", "--force")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        lang, lesson = assignment.split("-", 1)
        graded = nbformat.read(course / "autograded" / "mistake" / assignment
                               / f"{lesson}.ipynb", 4)
        check = next(c for c in graded.cells
                     if c.metadata["nbgrader"]["grade_id"].endswith("check-1"))
        (error,) = [o for o in check.outputs if o.output_type == "error"]
        assert error.ename == "WrongAnswer", (assignment, error.ename, error.evalue)
        assert error.evalue.startswith(NOT_YET[lang]), (assignment, error.evalue)
        feedback = (course / "feedback" / "mistake" / assignment
                    / f"{lesson}.html").read_text(encoding="utf-8")
        assert html.escape(error.evalue, quote=False)[:60] in feedback, assignment


def test_the_makefile_target_writes_the_release():
    makefile = (ROOT / "Makefile").read_text()
    assert "tools/nbgrader_course.py" in makefile
    assert shutil.which("make")
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), "nbgrader"],
                         capture_output=True, text=True)
    assert dry.returncode == 0 and "nbgrader_course.py" in dry.stdout
