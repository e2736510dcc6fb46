"""Lesson 01's figure of what `x.view(-1)` hands fc1: its cell as written, and broken.

The section "With a batch of one it is silently wrong" records, with a hook on
doc 004's model's own fc1, the length of the vector fc1 receives for batches of
1 to 6 samples, draws it against what fc1 takes, and asserts that it is 10 per
sample (so it fits only a batch of one). These tests run the cell, read from the
built notebook: as written it passes; with the model fixed (each sample
flattened) or with the batches of 5 and 6 samples left out, it fails.
"""

import pytest
import torch
from lesson_cells import finder

import labkit
from labkit import checks, models, plots

CELL = finder("01_models")("received = []  # the length of the vector fc1 receives")


def _run(model: torch.nn.Module, cell: str = CELL) -> dict:
    namespace = {"torch": torch, "labkit": labkit, "checks": checks, "plots": plots,
                 "as_written": model}
    exec(compile(cell, "<cell>", "exec"), namespace)
    return namespace


def _fails_at(model: torch.nn.Module, line: str, cell: str = CELL) -> None:
    with pytest.raises(AssertionError) as caught:
        _run(model, cell)
    where = next(entry for entry in reversed(caught.traceback)
                 if entry.path == "<cell>")
    assert line in cell.splitlines()[where.lineno]


def test_the_vector_grows_with_the_batch_and_fits_only_one_sample():
    namespace = _run(models.MLPAsWritten())
    lines = namespace["fig"].axes[0].get_lines()
    assert [list(line.get_xdata()) for line in lines] == [list(range(1, 7))] * 2
    assert [list(line.get_ydata()) for line in lines] == [
        [10, 20, 30, 40, 50, 60], [10] * 6]


def test_fails_when_each_sample_is_flattened():
    _fails_at(models.MLP(), "assert out.shape == (10,)")  # x.flatten(1): (1, 10)


def test_fails_when_batches_are_left_out():
    assert CELL.count("range(2, 7)") == 1
    _fails_at(models.MLPAsWritten(), "assert received ==",
              CELL.replace("range(2, 7)", "range(2, 5)"))
