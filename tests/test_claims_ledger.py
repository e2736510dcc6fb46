"""The claims ledger: each errata row and lesson claim links to a cell that asserts.

The ledger is the tables of 16_errata (ids 000-N, 004-N, L03-N, ...). A row whose
section has no assertion yet must be listed in KNOWN_GAPS, with what is missing;
the list may only shrink: a gap that gets its assertion fails until it is removed.
"""

import json
from pathlib import Path

import ledger
import links
import pytest
import torch
from conftest import unavailable

import course

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"

# Rows whose linked section asserts nothing today, and the assertion it needs.
KNOWN_GAPS = {
    # A fact about a TensorFlow library the course does not install: lesson 09
    # cites its documentation; no cell here can run it.
    "004-29": "07 TensorFlow Lattice: cited, not demonstrated",
}

# Rows whose section asserts only where the ecosystem extra (Lightning and
# Accelerate) is installed: lesson 09's cell skips a framework it cannot import,
# so the lessons' run in .venv asserts nothing there. make ecosystem-check, a step
# of make test, installs the extra and runs these sections
# (test_sections_asserted_only_with_the_ecosystem_extra_assert_there).
ECOSYSTEM_ROWS = {"004-14", "004-30"}


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_every_row_links_to_a_cell_that_asserts(lang):
    assert ledger.ledger_problems(NOTEBOOKS / lang, known_gaps=KNOWN_GAPS) == []


def _asserts_only_if_installed(code: list[str]) -> bool:
    """Whether a section's assertions run only where an optional package is:
    a cell that asserts also asks labkit.doctor whether a package is installed."""
    return any(ledger.asserts(c) and "doctor.version(" in c for c in code)


def _sections(lang: str, ids) -> list[tuple[str, str, list[str]]]:
    """(notebook, fragment, code cells) of the sections the rows `ids` link to."""
    rows = ledger.ledger(NOTEBOOKS / lang / "16_errata.ipynb")
    targets = sorted({(t, f) for i, t, f in rows if i in ids and t is not None})
    return [(t, f, links.section_code(NOTEBOOKS / lang / t, f)) for t, f in targets]


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_rows_that_assert_only_with_an_extra_are_the_ecosystem_check_s(lang):
    """A row counted as asserted whose section asserts only where an optional
    package is installed must be one that make ecosystem-check runs."""
    rows = ledger.ledger(NOTEBOOKS / lang / "16_errata.ipynb")
    optional = {i for i, target, fragment in rows if target is not None
                and _asserts_only_if_installed(
                    links.section_code(NOTEBOOKS / lang / target, fragment) or [])}
    assert optional == ECOSYSTEM_ROWS


@pytest.mark.parametrize(("code", "optional"), [
    (["if doctor.version('x'):\n    assert x.works()"], True),
    (["installed = doctor.version('x')", "assert installed is None"], False),
    (["assert 1 + 1 == 2"], False),
])
def test_what_counts_as_asserting_only_if_installed(code, optional):
    assert _asserts_only_if_installed(code) is optional


def test_make_test_runs_the_ecosystem_rows_and_requires_the_frameworks(
        tmp_path, capsys):
    """make test's steps (tools/course.py's, which make runs) include
    ecosystem-check, which runs the test below with a missing framework made a
    failure, in a venv with the ecosystem extra."""
    assert "ecosystem-check" in course.TEST_STEPS and "unit" in course.TEST_STEPS
    plan = course.Course(tmp_path / ".venv", dry_run=True)  # prints, runs nothing
    plan.ecosystem_check()
    shown = capsys.readouterr().out.splitlines()
    (pytest_line,) = [line for line in shown if " -m pytest " in line]
    assert pytest_line.startswith("LABKIT_REQUIRE_ECOSYSTEM=1 ")
    assert "ecosystem-venv" in pytest_line.split(" -m pytest ")[0]
    assert ("tests/test_claims_ledger.py::"
            "test_sections_asserted_only_with_the_ecosystem_extra_assert_there"
            in pytest_line)
    assert any("ecosystem-venv" in line and " -m pip install " in line
               and ".[ecosystem]" in line for line in shown), shown


@pytest.mark.procs
@pytest.mark.timeout(600)  # each framework trains on two ranks under torchrun
def test_sections_asserted_only_with_the_ecosystem_extra_assert_there(
        monkeypatch, capsys):
    """The cells of the ECOSYSTEM_ROWS' sections, run as the lesson runs them:
    each framework accumulates under DDP, entering no_sync() between updates."""
    import labkit
    from labkit import doctor, ecosystem

    missing = [name for name in ecosystem.FRAMEWORKS if doctor.version(name) is None]
    if missing:
        unavailable(f"{', '.join(missing)} not installed: pyproject's ecosystem extra "
                    "(make ecosystem-check installs it in build/ecosystem-venv)",
                    "LABKIT_REQUIRE_ECOSYSTEM")
    runs = []  # each run_counted call's results, as the cell got them
    real = ecosystem.run_counted
    monkeypatch.setattr(ecosystem, "run_counted",
                        lambda name, **kw: runs.append(real(name, **kw)) or runs[-1])
    (section,) = _sections("en", ECOSYSTEM_ROWS)  # the code is shared by ja and en
    target, fragment, code = section
    assert any(map(ledger.asserts, code)), section
    for n, source in enumerate(code):
        exec(compile(source, f"{target}#{fragment} code cell {n}", "exec"),
             {"labkit": labkit, "doctor": doctor, "ecosystem": ecosystem})
    shown = capsys.readouterr().out
    assert labkit.t("frameworks_checked", checked=", ".join(ecosystem.FRAMEWORKS),
                    skipped="-") in shown, shown
    assert [[r["framework"] for r in run] for run in runs] == [
        [name, name] for name in ecosystem.FRAMEWORKS]  # both ranks of each
    for r in (r for run in runs for r in run):
        assert r["wrapped_in"] == "DistributedDataParallel"
        assert (r["batches"], r["accum_steps"]) == (8, 4)
        assert r["optimizer_steps"] == 2 and r["no_sync_entries"] == 6


def test_both_languages_have_the_same_rows_and_targets():
    ja = ledger.ledger(NOTEBOOKS / "ja" / "16_errata.ipynb")
    en = ledger.ledger(NOTEBOOKS / "en" / "16_errata.ipynb")
    assert len(en) >= 70
    assert [(i, target) for i, target, _ in ja] == [(i, target) for i, target, _ in en]


@pytest.mark.parametrize(
    ("source", "proves"),
    [
        ("assert x == 1", True),
        ("torch.testing.assert_close(a, b)", True),
        ("exercises.grade_train_step(train_step)", True),
        ("with checks.expect_error(ValueError):\n    f()", True),
        ("checks.grads_match(got, want)", True),
        ("diff = compare.max_abs_diff(got, want)", False),  # measures, never raises
        ("other.grads_match(got, want)", False),
        ("%%px\nassert replica_diff == 0.0", True),
        ("mock_obj.assert_called_once_with(1)", True),
        ("print(x)  # assert nothing", False),
        ("msg = 'assert x'", False),
        ("fig = plots.loss_curves(curves)", False),
        ("this is not python (", False),
    ],
)
def test_what_counts_as_an_assertion(source, proves):
    assert ledger.asserts(source) is proves


def test_the_checks_counted_as_assertions_raise_on_a_false_claim():
    from labkit import checks

    assert checks.RAISING <= set(checks.__all__)
    with pytest.raises(AssertionError):
        checks.grads_match([torch.ones(2)], [torch.zeros(2)])
    with pytest.raises(AssertionError):
        checks.allreduce_calls(4, 1)
    with pytest.raises(AssertionError):
        checks.replicas_equal(0.5)


def _notebook(path, *cells):
    """Write a notebook of (cell type, source) pairs; cell n has the id "c{n}"."""
    code = {"outputs": [], "execution_count": None}
    path.write_text(json.dumps({
        "cells": [{"cell_type": kind, "id": f"c{n}", "metadata": {}, "source": source,
                   **(code if kind == "code" else {})}
                  for n, (kind, source) in enumerate(cells)],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}), encoding="utf-8")


def _pair(folder, lesson_cells, rows):
    _notebook(folder / "03_lesson.ipynb", *lesson_cells)
    _notebook(folder / "16_errata.ipynb", ("markdown", "| id | claim | cell |\n"
                                           "|---|---|---|\n" + "\n".join(rows)))


PROVED = ("markdown", "## Proved"), ("code", "assert 1 + 1 == 2")
UNPROVED = ("markdown", "## Unproved"), ("code", "print('trust me')")


def test_a_section_without_an_assertion_fails(tmp_path):
    _pair(tmp_path, [*PROVED, *UNPROVED],
          ["| 000-1 | ok | [x](03_lesson.ipynb#Proved) |",
           "| 000-2 | no proof | [x](03_lesson.ipynb#Unproved) |"])
    assert ledger.ledger_problems(tmp_path) == [
        "000-2: no assertion under 03_lesson.ipynb#Unproved"]


def test_a_link_to_a_heading_cell_names_its_section(tmp_path):
    # Cells c0-c1 prove, c2-c3 do not: the links land by cell id.
    _pair(tmp_path, [*PROVED, *UNPROVED],
          ["| 000-1 | ok | [x](03_lesson.ipynb#cell-id=c0) |",
           "| 000-2 | no proof | [x](03_lesson.ipynb#cell-id=c2) |",
           "| 000-3 | not a heading | [x](03_lesson.ipynb#cell-id=c1) |"])
    assert ledger.ledger_problems(tmp_path) == [
        "000-2: no assertion under 03_lesson.ipynb#cell-id=c2",
        "000-3: 03_lesson.ipynb has no heading #cell-id=c1"]


def test_the_section_ends_at_the_next_heading(tmp_path):
    # The assertion belongs to the next heading, not to "Unproved".
    _pair(tmp_path, [UNPROVED[0], ("markdown", "### Below"), PROVED[1]],
          ["| L03-1 | claim | [x](03_lesson.ipynb#Unproved) |"])
    assert ledger.ledger_problems(tmp_path) == [
        "L03-1: no assertion under 03_lesson.ipynb#Unproved"]


def test_missing_links_headings_and_repeated_ids_fail(tmp_path):
    _pair(tmp_path, PROVED,
          ["| 004-1 | no link | — |",
           "| 004-2 | gone | [x](03_lesson.ipynb#No-such-heading) |",
           "| 004-3 | first | [x](03_lesson.ipynb#Proved) |",
           "| 004-3 | again | [x](03_lesson.ipynb#Proved) |",
           "| 04-4 | mistyped id | [x](03_lesson.ipynb#Proved) |"])
    assert sorted(ledger.ledger_problems(tmp_path)) == [
        "004-1: no link to the cell that proves it",
        "004-2: 03_lesson.ipynb has no heading #No-such-heading",
        "004-3: id used 2 times",
        "a table row without an id: "
        "| 04-4 | mistyped id | [x](03_lesson.ipynb#Proved) |",
    ]


def test_known_gaps_are_visible_and_must_shrink(tmp_path):
    _pair(tmp_path, [*PROVED, *UNPROVED],
          ["| 000-1 | ok | [x](03_lesson.ipynb#Proved) |",
           "| 000-2 | no proof | [x](03_lesson.ipynb#Unproved) |"])
    assert ledger.ledger_problems(tmp_path, known_gaps={"000-2": "todo"}) == []
    assert ledger.ledger_problems(tmp_path, known_gaps={"000-1": "x", "000-2": "x",
                                                       "000-9": "x"}) == [
        "000-1: 03_lesson.ipynb#Proved asserts now; remove it from the known gaps",
        "000-9: a known gap that no row has",
    ]


VERDICTS = {"ja": ("正しい", "誤り", "誤解を招く", "古い"),
            "en": ("correct", "wrong", "misleading", "outdated")}


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_the_errata_tables_are_well_formed(lang):
    """Every row about the documents has one of the four verdicts; each
    document's ids run from 1 without a gap or a repeat; every row links."""
    errata = NOTEBOOKS / lang / "16_errata.ipynb"
    nb = json.loads(errata.read_text(encoding="utf-8"))
    doc_rows = [line.split("|") for cell in nb["cells"]
                if cell["cell_type"] == "markdown"
                for line in "".join(cell["source"]).splitlines()
                if line.startswith("| ") and line.split("|")[1].strip()[:1].isdigit()]
    verdicts = [row[3].strip() for row in doc_rows]
    assert len(doc_rows) >= 55
    assert set(verdicts) <= set(VERDICTS[lang]), set(verdicts) - set(VERDICTS[lang])
    rows = ledger.ledger(errata)
    ids = [id_ for id_, _, _ in rows]
    for doc in ("000", "004", "L03", "L04", "L05", "L06", "L10"):
        numbers = [int(i.split("-")[1]) for i in ids if i.startswith(doc + "-")]
        assert numbers == list(range(1, len(numbers) + 1)), (doc, numbers)
    assert len(ids) == len(set(ids))  # no id twice
    assert sum(not i.startswith("L") for i in ids) == len(doc_rows)
    assert all(target is not None for _, target, _ in rows)  # every row links
