"""The claims ledger: each errata row and lesson claim links to a cell that asserts.

The ledger is the tables of 11_errata (ids 000-N, 004-N, L03-N, ...). A row whose
section has no assertion yet must be listed in KNOWN_GAPS, with what is missing;
the list may only shrink: a gap that gets its assertion fails until it is removed.
"""

import json
from pathlib import Path

import ledger
import pytest
import torch

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

# Rows whose linked section asserts nothing today, and the assertion it needs.
KNOWN_GAPS = {
    # A fact about a TensorFlow library the course does not install: lesson 09
    # cites its documentation; no cell here can run it.
    "004-29": "07 TensorFlow Lattice: cited, not demonstrated",
}


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_every_row_links_to_a_cell_that_asserts(lang):
    assert ledger.ledger_problems(NOTEBOOKS / lang, known_gaps=KNOWN_GAPS) == []


def test_both_languages_have_the_same_rows_and_targets():
    ja = ledger.ledger(NOTEBOOKS / "ja" / "11_errata.ipynb")
    en = ledger.ledger(NOTEBOOKS / "en" / "11_errata.ipynb")
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
    _notebook(folder / "11_errata.ipynb", ("markdown", "| id | claim | cell |\n"
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
    errata = NOTEBOOKS / lang / "11_errata.ipynb"
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
