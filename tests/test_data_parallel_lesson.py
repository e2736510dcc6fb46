"""Lesson 02's chart of what DataParallel copies at every training step.

The section "What DataParallel pays at every step" counts, over 3 training steps,
the values `scatter_kwargs`, `replicate` and `gather` copy, draws them per step
and asserts each step copies the batch in, the whole model and the outputs back.
These tests run the lesson's cells, read from the built notebook: as written
they pass; on one device or through `nn.DataParallel` (on a CPU both only call
the model), or on three devices (two copies of the model a step), the cell's
assertions fail.
"""

import pytest
from lesson_cells import finder

import labkit

FIND = finder("02_data_parallel")
SETUP = [FIND("X, y = torch.randn(100, 10), torch.randn(100, 10)"),
         FIND("device_ids = [0, 1]"),
         FIND("def weights(m):")]
PAYS = FIND("def replicate_and_count(")
CALL = "dp.data_parallel(trained, X, device_ids)"


def _run(cell: str) -> dict:
    namespace = {"labkit": labkit}
    for source in [*SETUP, cell]:
        exec(compile(source, "<cell>", "exec"), namespace)
    return namespace


def _fails_at(cell: str, line: str) -> None:
    with pytest.raises(AssertionError) as caught:
        _run(cell)
    where = next(entry for entry in reversed(caught.traceback)
                 if entry.path == "<cell>")
    assert line in cell.splitlines()[where.lineno]


def test_every_step_copies_the_batch_the_model_and_the_outputs():
    namespace = _run(PAYS)
    axes = namespace["fig"].axes
    assert [ax.get_title() for ax in axes] == [f"training step {i}" for i in (1, 2, 3)]
    for ax in axes:
        assert [bar.get_height() for bar in ax.patches] == [1000, 2110, 1000]


def test_fails_on_one_device():
    assert PAYS.count(CALL) == 1
    _fails_at(PAYS.replace(CALL, "dp.data_parallel(trained, X, [0])"),  # the module
              "assert [name for name, _ in copied]")  # called, no step of the four


def test_fails_on_three_devices():
    _fails_at(PAYS.replace(CALL, "dp.data_parallel(trained, X, [0, 1, 2])"),
              'assert [s["replicate"]')  # two copies of the model each step


def test_fails_through_nn_data_parallel_on_a_cpu():
    _fails_at(PAYS.replace(CALL, "nn.DataParallel(trained)(X)"),
              "assert [name for name, _ in copied]")
