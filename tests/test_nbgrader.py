"""The course as an nbgrader course (tools/nbgrader_course.py), checked with nbgrader.

nbgrader is in the grading extra, which make nbgrader-check (part of make test)
installs before it runs this file. The first tests only write and release the
course. The round trip runs lessons, so it runs only where LABKIT_NBGRADER is set:
nbgrader validates the Japanese reference answers, autogrades each assignment's
reference answers to full marks and a submission with one typical mistake, which
loses exactly that exercise's points and gets the check's hint in its feedback.
make nbgrader-check (LABKIT_NBGRADER=1) does it for a sample of two assignments
(SAMPLE); make nbgrader-check-all (LABKIT_NBGRADER=all, weekly in CI:
.github/workflows/nbgrader.yml) for every one, about half an hour here.
"""

import html
import os
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import unavailable

import labkit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import nbgrader_course  # noqa: E402

try:
    import nbgrader  # noqa: F401
except ImportError:
    unavailable("nbgrader is in the grading extra: make nbgrader-check installs it "
                "and runs these tests", "LABKIT_NBGRADER", module=True)


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
def _gradebook_without_fsync():
    """SQLite without waiting for the disk at each commit, for this module's
    gradebooks, which are thrown away: writing the course commits once per cell
    (4,308 fdatasync calls by default, counted with strace), slow on a busy disk."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def no_fsync(connection, _):
        connection.execute("PRAGMA synchronous=OFF")

    event.listen(Engine, "connect", no_fsync)
    yield
    event.remove(Engine, "connect", no_fsync)


@pytest.fixture(scope="module")
def course(tmp_path_factory, _gradebook_without_fsync):
    """The course written and released (every assignment) by `make nbgrader`, as
    an instructor makes it, in a folder of its own; with this Python, and the
    set-up of .venv that the target asks for first taken as done (-o)."""
    folder = tmp_path_factory.mktemp("nbgrader")
    done = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT),
         "-o", ".venv/.labkit-installed", "-o", ".venv/.labkit-grading",
         "nbgrader", f"NBGRADER_OUT={folder}", f"BIN={Path(sys.executable).parent}"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder


def test_every_lesson_with_exercises_is_released_as_the_student_copies_have_it(course):
    released = sorted(p.name for p in (course / "release").iterdir())
    assert released == sorted(f"{lang}-{p.stem}" for lang in ("ja", "en")
                              for p in (ROOT / "notebooks" / lang).glob("*.ipynb")
                              # setup and the errata have no exercises
                              if p.stem != "00_setup"
                              and not p.stem.endswith("_errata"))
    for assignment in released:
        lang, lesson = assignment.split("-", 1)
        release = nbformat.read(course / "release" / assignment / f"{lesson}.ipynb", 4)
        full = nbformat.read(ROOT / "notebooks" / lang / f"{lesson}.ipynb", 4)
        exercises = [c.source for c in full.cells
                     if "exercise" in c.metadata.get("tags", [])]
        answers = [c.source for c in release.cells
                   if c.metadata["nbgrader"]["solution"]]
        # a %%writefile exercise is one file: it stays there as comments to start from
        assert [a.rstrip() for a in answers] == [
            nbgrader_course.commented_file(e).rstrip()
            if e.startswith("%%writefile") else e.rstrip() for e in exercises]
        assert not any("BEGIN SOLUTION" in c.source for c in release.cells)
        # each solution merged into its exercise
        assert len(release.cells) == len(full.cells) - len(exercises)


# --- the round trip ------------------------------------------------------------

# One typical mistake per lesson, in the first exercise's reference answer, as
# (language, text of the solution, what a learner writes instead). The languages
# are mixed, so that hints in both are seen, in the sample too.
MISTAKES = {
    "01": ("en", "x = x.flatten(1)", "x = x.view(-1)"),  # the document's own bug
    "02": ("ja", "(7, 3): [3, 3, 1]", "(7, 3): [3, 2, 2]"),  # an even split
    "03": ("ja", "        sampler.set_epoch(epoch)", "        pass"),  # no set_epoch
    "04": ("en", "loss = criterion(model(X), y) / K", "loss = criterion(model(X), y)"),
    "05": ("ja", "2 * (8 - 1) / 8 * nbytes / ab.beta", "nbytes / ab.beta"),
    "06": ("en", "        if not self.require_sync:\n            return", ""),
    "07": ("ja", "    model.eval()", "    pass"),  # evaluated in training mode
    "08": ("en", "base_lr * batch_size / base_batch", "base_lr"),  # not scaled
    "09": ("ja", '"RANK": node_rank * nproc_per_node + local_rank',
           '"RANK": local_rank'),  # RANK equal to LOCAL_RANK
    "10": ("en", "if p.grad is None", "if p.grad is not None"),
    "11": ("ja", "    with Join([model]):", "    if True:"),  # no Join: ranks apart
    "12": ("en", "    return shard / world_size", "    return shard"),  # the sum
    "13": ("ja", "optimizer = 2 * 4 * params", "optimizer = 4 * params"),  # Adam as one
    # the crossover's time difference the wrong way round: a negative bandwidth
    "14": ("ja", "    return (S_ddp - S_fp16) / (t_fp16 - t_ddp)",
           "    return (S_ddp - S_fp16) / (t_ddp - t_fp16)"),
    "15": ("en", "            delta /= world_size  # the ranks' mean\n", ""),  # the sum
}
NOT_YET = {"ja": "まだ正解ではありません。", "en": "Not yet. "}

# The lessons make nbgrader-check autogrades, each in its mistake's language: 02,
# the cheapest lesson with exercises (about 10 s a run here), in Japanese, and 06,
# whose first answer is a %%px cell that runs on the ranks, in English.
SAMPLE = ("02", "06")


def _assignment(lesson):
    """The assignment of `lesson` in its mistake's language: ja-02_data_parallel."""
    lang = MISTAKES[lesson][0]
    (path,) = (ROOT / "notebooks" / lang).glob(f"{lesson}_*.ipynb")
    return f"{lang}-{path.stem}"


# LABKIT_NBGRADER unset (or 0): no round trip; "all": every assignment; any other
# value ("1", make nbgrader-check): the sample.
ROUND_TRIP = os.environ.get("LABKIT_NBGRADER", "")
WITH_MISTAKE = sorted(_assignment(lesson) for lesson in MISTAKES)
GRADED = (sorted(nbgrader_course.assignments(ROOT / "notebooks"))
          if ROUND_TRIP == "all" else sorted(_assignment(n) for n in SAMPLE))
# validate on the Japanese assignments: the English ones run the same code
VALIDATED = [a for a in GRADED if a.startswith("ja-")]

needs_round_trip = pytest.mark.skipif(
    ROUND_TRIP in ("", "0"),
    reason="the round trip runs lessons: make nbgrader-check runs a sample of "
    "it, make nbgrader-check-all all of it")


def _source(course, assignment):
    lesson = assignment.split("-", 1)[1]
    return nbformat.read(course / "source" / assignment / f"{lesson}.ipynb", 4)


def _submit(course, student, assignment, notebook):
    lesson = assignment.split("-", 1)[1]
    folder = course / "submitted" / student / assignment
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, folder / f"{lesson}.ipynb")


def _first_answer(nb):
    return next(c for c in nb.cells if c.metadata["nbgrader"]["solution"])


def _with_mistake(source_nb, lesson):
    """The reference answers, but the first exercise's with the lesson's mistake."""
    _, right, wrong = MISTAKES[lesson]
    nb = nbformat.from_dict(source_nb)
    answer = _first_answer(nb)
    assert answer.source.count(right) >= 1, f"{lesson}: {right!r} not in its answer"
    answer.source = answer.source.replace(right, wrong)
    return nb


def test_every_mistake_still_fits_its_lesson_s_first_answer(course):
    """Also the mistakes of the lessons out of the sample, which only make
    nbgrader-check-all grades: a lesson's answer rewritten fails here first."""
    assert len(WITH_MISTAKE) == len(MISTAKES)
    assert set(WITH_MISTAKE) <= {p.name for p in (course / "source").iterdir()}
    for assignment in WITH_MISTAKE:
        source = _source(course, assignment)
        lesson = assignment.split("-", 1)[1][:2]
        assert (_first_answer(_with_mistake(source, lesson)).source
                != _first_answer(source).source), assignment


def test_the_sample_has_both_languages_and_a_mistake_run_on_the_ranks(course):
    sampled = [_assignment(lesson) for lesson in SAMPLE]
    assert {a.split("-", 1)[0] for a in sampled} == {"ja", "en"}
    assert any(_first_answer(_source(course, a)).source.startswith("%%px\n")
               for a in sampled)


@pytest.fixture(scope="module")
def grader(course):
    """nbgrader's API on the course, in this process."""
    return nbgrader_course.grader(course)


@needs_round_trip
@pytest.mark.parametrize("assignment", VALIDATED)
def test_validate_passes_the_reference_answers(course, grader, assignment):
    lesson = assignment.split("-", 1)[1]
    notebook = course / "source" / assignment / f"{lesson}.ipynb"
    assert nbgrader_course.validate(grader, notebook) == {}


@needs_round_trip
@pytest.mark.timeout(900)  # the lesson run twice; the longest takes about a minute here
# nbgrader's gradebook warns so at a student's first submission, as its command
# line does (nbgrader 0.9.6, SQLAlchemy 2): nothing this test can act on.
@pytest.mark.filterwarnings("ignore:Object of type:sqlalchemy.exc.SAWarning")
@pytest.mark.parametrize("assignment", GRADED)
def test_autograde_gives_the_reference_full_marks_and_the_mistake_its_hint(
        course, grader, assignment):
    lang, lesson = assignment.split("-", 1)
    source = _source(course, assignment)
    students = {"reference": source}
    if assignment in WITH_MISTAKE:
        students["mistake"] = _with_mistake(source, lesson[:2])
    for student, notebook in students.items():
        _submit(course, student, assignment, notebook)
        done = grader.autograde(assignment, student, force=True)
        assert done["success"], done

    with grader.gradebook as gradebook:
        reference = gradebook.find_submission(assignment, "reference")
        assert reference.score == reference.max_score > 0, assignment
        if "mistake" not in students:
            return
        mistake = gradebook.find_submission(assignment, "mistake")
        lost = {g.name: g.score for n in mistake.notebooks for g in n.grades
                if g.score < g.max_score}
        assert lost == {f"{lesson[:2]}-check-1": 0}, assignment
        assert mistake.score == reference.max_score - nbgrader_course.POINTS

    # the hint reaches the student: in the autograded check and in the feedback
    done = grader.generate_feedback(assignment, "mistake", force=True)
    assert done["success"], done
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


def test_make_nbgrader_writes_a_course_nbgrader_reads(course, grader):
    """The folder `make nbgrader` wrote (the course fixture) is an nbgrader course
    rooted there, as nbgrader reads its config, and each lesson with exercises
    has its assignment's source and release."""
    assert grader.coursedir.root == str(course.resolve())
    sources = sorted(p.name for p in (course / "source").iterdir())
    assert sources == sorted(p.name for p in (course / "release").iterdir())
    assert sources == sorted(nbgrader_course.assignments(ROOT / "notebooks"))


def test_the_weekly_workflow_runs_the_whole_round_trip(tmp_path, capsys):
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "nbgrader.yml")
                              .read_text())
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads the key on as true
    assert on["schedule"][0]["cron"] and "workflow_dispatch" in on
    paths = on["push"]["paths"]
    assert {"labkit/exercises/**", "tools/nbgrader_course.py"} <= set(paths)
    assert all(list(ROOT.glob(path)) for path in paths), paths
    (job,) = workflow["jobs"].values()
    assert job["runs-on"].startswith("ubuntu-")
    setup = next(s for s in job["steps"]
                 if s.get("uses", "").startswith("actions/setup-python@"))
    assert setup["with"]["python-version"] == "3.11"
    (command,) = [s["run"] for s in job["steps"] if "run" in s]
    make, target, torch = shlex.split(command)
    assert (make, target) == ("make", "nbgrader-check-all")
    # the CPU build of the checked torch, as on the course's reference machine
    assert torch == (f"TORCH=torch=={labkit.CHECKED_TORCH} "
                     "--index-url https://download.pytorch.org/whl/cpu")
    # make runs tools/course.py's step of the same name, which runs this file's
    # round trip on every assignment
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), target],
                         capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert any("tools/course.py" in line and line.split()[-1] == target
               for line in dry.stdout.splitlines()), dry.stdout
    import course

    course.main([target, "--dry-run", "--venv", str(tmp_path / ".venv")])
    (round_trip,) = [line for line in capsys.readouterr().out.splitlines()
                     if " -m pytest " in line]
    assert round_trip.startswith("LABKIT_NBGRADER=all ")
    assert round_trip.endswith("tests/test_nbgrader.py")


def test_a_writefile_answer_writes_one_program():
    """A `%%writefile` exercise is a whole file: the instructor's answer keeps the
    exercise as comments, or the file would hold the exercise and the solution."""
    answer = nbgrader_course._answer("%%writefile a.py\nx = 1\n\nprint(x)",
                                     "%%writefile a.py\nimport os\nx = 2")
    lines = answer.splitlines()
    assert lines[0] == "%%writefile a.py"
    assert [ln for ln in lines[1:] if ln and not ln.startswith("#")] == [
        "import os", "x = 2"]
    assert "# print(x)" in lines
