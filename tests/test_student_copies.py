"""Student copies: no solution left, every exercise kept, for every lesson."""

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
