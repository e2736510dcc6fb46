"""Student copies: no solution left, every exercise kept, for every lesson."""

import ast
from pathlib import Path

import nbformat
import pytest
import student_copies

ROOT = Path(__file__).resolve().parent.parent

NOTEBOOKS = ROOT / "notebooks"
# Every lesson between the setup (00) and the errata (16) has at least one.
LESSONS_WITH_EXERCISES = tuple(f"{n:02d}" for n in range(1, 16))


def tags(cell):
    return cell.get("metadata", {}).get("tags", [])


def lessons(lang):
    return sorted((NOTEBOOKS / lang).glob("*.ipynb"))


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    assert student_copies.main(["--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_every_lesson_without_solutions_with_every_exercise(student, lang):
    assert [p.name for p in sorted((student / lang).glob("*.ipynb"))] == [
        p.name for p in lessons(lang)]
    for path in lessons(lang):
        full = nbformat.read(path, as_version=4)
        copy = nbformat.read(student / lang / path.name, as_version=4)
        nbformat.validate(copy)
        assert not [c for c in copy.cells if "solution" in tags(c)], path.name
        kept = [(c.id, c.source) for c in full.cells if "solution" not in tags(c)]
        assert [(c.id, c.source) for c in copy.cells] == kept, path.name
        exercises = [c.id for c in full.cells if "exercise" in tags(c)]
        assert [c.id for c in copy.cells if "exercise" in tags(c)] == exercises
        assert all(c.get("outputs", []) == [] for c in copy.cells)
        assert copy.metadata["labkit"]["lang"] == lang


@pytest.mark.parametrize("lang", ["ja", "en"])
@pytest.mark.parametrize("lesson", LESSONS_WITH_EXERCISES)
def test_each_exercise_has_a_solution_then_a_check(lang, lesson):
    (path,) = (NOTEBOOKS / lang).glob(f"{lesson}_*.ipynb")
    cells = nbformat.read(path, as_version=4).cells
    starts = [i for i, c in enumerate(cells) if "exercise" in tags(c)]
    assert len(starts) >= 1
    for i in starts:
        solution, check = cells[i + 1], cells[i + 2]
        assert "solution" in tags(solution), f"{path.name}: cell {i + 2}"
        assert check.cell_type == "code" and "exercises.grade_" in check.source
    assert sum("solution" in tags(c) for c in cells) == len(starts)


def test_a_rerun_removes_lessons_that_are_gone(tmp_path):
    stale = tmp_path / "en" / "99_gone.ipynb"
    stale.parent.mkdir()
    stale.write_text("{}", encoding="utf-8")
    assert student_copies.main(["--out", str(tmp_path)]) == 0
    assert not stale.exists()


def test_cell_tags_are_read_from_the_notebook_and_from_plain_json():
    import nbcells

    solution = nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["solution"]})
    exercise = {"cell_type": "code", "metadata": {"tags": ["exercise", "other"]}}
    assert nbcells.tags(exercise) == ["exercise", "other"]
    assert nbcells.is_solution(solution) and not nbcells.is_exercise(solution)
    assert nbcells.is_exercise(exercise) and not nbcells.is_solution(exercise)
    # untagged, and a tag that only looks alike
    assert nbcells.tags({"cell_type": "code"}) == []
    assert not nbcells.is_solution({"metadata": {"tags": ["solutions"]}})


# The cells that build on an exercise's answer, by lesson: they fail in a student
# copy until the exercise passes, as docs/instructor.md says. Any other use of an
# answer after its check is a cell a learner cannot run past the exercise.
BUILDS_ON_ANSWERS = {
    "06_beyond_no_sync": {"ScratchDDP"},
    "09_ecosystem": {"torchrun_env"},
    "12_zero_by_hand": {"shard_of_mean_gradient", "Zero3"},
    "14_slow_link": {"fp16_crossover"},
}


def _code(cell) -> str:
    return "\n".join(line for line in cell.source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))


def _defined(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def answers_used_later(path: Path) -> set[str]:
    """Names only an exercise defines that a cell after its check reads."""
    cells = [c for c in nbformat.read(path, as_version=4).cells
             if c.cell_type == "code"]
    others = set().union(*(_defined(_code(c)) for c in cells
                           if not {"exercise", "solution"} & set(tags(c))))
    used = set()
    for i, cell in enumerate(cells):
        if "exercise" not in tags(cell):
            continue
        answer = _defined(_code(cell)) - others
        after = i + 1
        while after < len(cells) and "solution" in tags(cells[after]):
            after += 1
        for later in cells[after + 1:]:  # past the check cell
            nodes = list(ast.walk(ast.parse(_code(later))))  # a loop's own K is not it
            bound = ({n.id for n in nodes if isinstance(n, ast.Name)
                      and not isinstance(n.ctx, ast.Load)}
                     | {n.arg for n in nodes if isinstance(n, ast.arg)})
            read = {n.id for n in nodes if isinstance(n, ast.Name)
                    and isinstance(n.ctx, ast.Load)}
            # an answer the cell first asks about (`f(...) is None`: still as
            # handed out) is one it can do without
            asked = {n.left.func.id for n in nodes if isinstance(n, ast.Compare)
                     and isinstance(n.ops[0], (ast.Is, ast.IsNot))
                     and isinstance(n.left, ast.Call)
                     and isinstance(n.left.func, ast.Name)}
            used |= answer & (read - bound - asked)
    return used


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_only_the_cells_the_guide_names_build_on_an_answer(lang):
    found = {p.stem: used for p in lessons(lang) if (used := answers_used_later(p))}
    assert found == BUILDS_ON_ANSWERS


def test_a_cell_that_reads_an_answer_after_its_check_is_found(tmp_path):
    cells = [nbformat.v4.new_code_cell("def step(x):\n    return None",
                                       metadata={"tags": ["exercise"]}),
             nbformat.v4.new_code_cell("def step(x):\n    return x",
                                       metadata={"tags": ["solution"]}),
             nbformat.v4.new_code_cell("check(step)"),
             nbformat.v4.new_code_cell("%%px\nhistory = [step(1)]")]
    path = tmp_path / "99_x.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    assert answers_used_later(path) == {"step"}
    cells[3].source = "def step(x):\n    return x\nhistory = [step(1)]"  # its own
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    assert answers_used_later(path) == set()
    cells[3].source = "if step(1) is not None:\n    history = [step(1)]"  # asked first
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    assert answers_used_later(path) == set()
