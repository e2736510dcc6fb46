"""Lesson 08's BatchNorm cells, run on two ranks as written, and with a line changed.

The lesson writes its BatchNorm experiment in `%%px` cells and asserts what DDP
does to `running_mean`. These tests run those very cells (read from the built
notebook) on the test engines: as written they pass, and with DDP's copy of
rank 0's buffers turned off, the assertion that every rank holds rank 0's
statistics fails, on rank 1.
"""

from pathlib import Path

import nbformat
import pytest
import torch

from labkit import batchnorm, cluster

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "en" / "08_training_settings.ipynb"
TRAINING_DDP = "model = DDP(nn.BatchNorm1d(4))"


def batchnorm_cells() -> list[str]:
    """The `%%px` cells between the BatchNorm heading and the SyncBatchNorm exercise."""
    cells = nbformat.read(LESSON, as_version=4).cells
    start = next(i for i, c in enumerate(cells)
                 if c.source.startswith("## BatchNorm statistics are per replica"))
    end = next(i for i, c in enumerate(cells)
               if i > start and c.source.startswith("## Exercise: SyncBatchNorm"))
    return [c.source.removeprefix("%%px\n") for c in cells[start:end]
            if c.cell_type == "code" and c.source.startswith("%%px\n")]


def run_cells(ranks, cells: list[str]) -> None:
    # What the lesson's earlier %%px cell imported on the engines.
    ranks.execute("import torch\nimport torch.distributed as dist")
    for source in cells:
        ranks.execute(source)


def test_the_lessons_batchnorm_cells_pass_as_written(ranks):
    cells = batchnorm_cells()
    assert len(cells) >= 3 and TRAINING_DDP in cells[0]
    run_cells(ranks, cells)


def test_without_ddps_buffer_copy_the_lessons_assertion_fails(ranks):
    cells = batchnorm_cells()
    unsynced = "model = DDP(nn.BatchNorm1d(4), forward_sync_buffers=False)"
    cells[0] = cells[0].replace(TRAINING_DDP, unsynced)
    with pytest.raises(cluster.RankError) as err:
        run_cells(ranks, cells)
    # Rank 0 holds its own statistics either way; rank 1 no longer holds rank 0's.
    assert sorted(err.value.failures) == [1]
    assert "assert torch.equal(trained, rank0_then_own)" in err.value.failures[1]


def test_the_reference_batchnorm_sees_the_batches_in_order():
    a, b = batchnorm.local_batch(0), batchnorm.local_batch(1)
    assert torch.equal(batchnorm.local_batch(1), b)  # the same data on every call
    assert abs(b.mean().item() - a.mean().item() - 3.0) < 1.0  # shifted by 3 per rank
    after = batchnorm.after_forwards
    assert not torch.allclose(after(a, b), after(b, a))
    # One forward moves the running mean 10 % of the way to the batch's mean.
    assert torch.allclose(after(a), 0.1 * a.mean(0), rtol=0, atol=1e-7)
