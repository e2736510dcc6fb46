"""Figure cells of lessons 00 and 03 on real ranks: each passes on the lesson's own
code, and its assertion fails when the ranks' data changes (another source rank,
gradients in more than one bucket)."""

import matplotlib.pyplot as plt
import pytest
from lesson_cells import finder

import labkit
from labkit import diagrams

pytestmark = pytest.mark.timeout(300)

# What the lesson's earlier cells give the ranks before the cells under test.
L00 = "import torch\nimport torch.distributed as dist\n"
L03 = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from labkit import comm_counting, data, models
criterion = models.MyLoss()
torch.manual_seed(1)
X, y = torch.randn(64, 10), torch.randn(64, 10)
"""


def draw(cell: str, **names) -> None:
    """Run a figure cell here, as the notebook's kernel does, and close its figure."""
    names.update(labkit=labkit, diagrams=diagrams)
    exec(cell, names)
    plt.close(names["fig"])


@pytest.mark.parametrize("change, holds", [({}, True),
                                           ({"src=0": "src=1"}, False)])
def test_lesson_00_broadcast_figure(ranks, change, holds):
    find = finder("00_setup")
    ranks.execute(L00 + find("x_before = x.tolist()"))
    cell = find("dist.broadcast(x, src=0)  #")
    for old, new in change.items():
        cell = cell.replace(old, new)
    ranks.execute(cell)
    before = ranks.pull("x_before")
    figure = find('ranks.pull("x_broadcast")')
    if holds:
        draw(figure, ranks=ranks, before=before)
    else:
        with pytest.raises(AssertionError):
            draw(figure, ranks=ranks, before=before)


@pytest.mark.parametrize("change, holds", [
    ({}, True),
    ({"DDP(models.MLP())": "DDP(models.MLP(), bucket_cap_mb=0.004)"}, False)])
def test_lesson_03_bytes_per_backward_figure(ranks, change, holds):
    find = finder("03_ddp")
    cell = find("CommCounter(per_step=True)")
    for old, new in change.items():
        assert old in cell
        cell = cell.replace(old, new)
    ranks.execute(L03 + cell)
    figure = find('ranks.pull("log.steps")')
    if holds:
        draw(figure, ranks=ranks)
    else:
        with pytest.raises(AssertionError):
            draw(figure, ranks=ranks)
