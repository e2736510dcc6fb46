"""Lesson 11's figures: the cells that draw them, on data shaped as the lesson's
run hands them, pass; with that data broken one way, their assertions fail.

The cells are read from the built notebook and run in this process: the ranks'
values come from a stand-in for `ranks.pull`, torchrun's results as the dicts the
lesson reads from its JSON files. No process starts (the whole lesson runs under
nbval and in tests/test_windows.py).
"""

import copy
import math

import matplotlib.pyplot as plt
import pytest
from lesson_cells import finder

import labkit
from labkit import diagrams

find = finder("11_uneven_and_restarts")
JOIN_CELL = find('shown = ranks.pull("sent_per_update")')
RESUME_CELL = find('assert b["losses"] == a["losses"][restart:]')

# Per rank, (K, gradient all-reduces of each update): K = 0 is the first cell's run
# without Join (5 batches on rank 0, 4 on rank 1); under Join the last entry holds
# what was sent after the rank's own updates.
SENT = [[(0, [1] * 5), (1, [1] * 5 + [0]), (2, [1] * 3 + [0])],
        [(0, [1] * 4), (1, [1] * 4 + [1]), (2, [1] * 2 + [1])]]
LOSSES = [1.2 - 0.02 * i for i in range(20)]
RUNS = {"a": {"config": {"steps": 20}, "resumed_from": 0, "losses": LOSSES},
        "b": {"config": {"steps": 20}, "resumed_from": 10, "losses": LOSSES[10:]}}


class _Pulled:
    """`ranks` as the figure cell uses it: `pull(name)` of values noted before."""

    def __init__(self, values):
        self.values = values

    def pull(self, name):
        return copy.deepcopy(self.values[name])


def _join(sent):
    namespace = {"ranks": _Pulled({"sent_per_update": sent}), "labkit": labkit,
                 "diagrams": diagrams}
    exec(JOIN_CELL, namespace)
    return namespace


def _resume(a, b):
    namespace = {"a": a, "b": b, "die_at": 12, "labkit": labkit}
    exec(RESUME_CELL, namespace)
    return namespace


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_the_figure_cells_pass_on_the_lessons_data(lang):
    labkit.set_lang(lang)
    join = _join(SENT)
    assert join["framed"] == [(labkit.t("join_k", k=1), 1, 4),
                              (labkit.t("join_k", k=2), 1, 2)]
    assert join["fig"].axes[0].get_title() == labkit.t("join_sent_title")
    resume = _resume(*copy.deepcopy(list(RUNS.values())))
    ax = resume["fig"].axes[0]
    assert [line.get_xdata()[0] for line in ax.get_lines()[2:]] == [10, 12]
    assert labkit.t("restart_mark", s=10) in [
        text.get_text() for text in ax.get_legend().get_texts()]
    plt.close("all")


def _sent(rank, K, counts):
    sent = copy.deepcopy(SENT)
    sent[rank][K] = (K, counts)
    return sent


JOIN_BROKEN = {
    "no shadow: rank 1 sends nothing once its batches are done":
        _sent(1, 1, [1] * 4 + [0]),
    "the backward inside no_sync shadowed too": _sent(1, 2, [1] * 2 + [2]),
    "the shadow counted in rank 1's last update": _sent(1, 1, [1] * 3 + [2]),
    "without Join, both ranks with 5 batches": _sent(1, 0, [1] * 5),
}


@pytest.mark.parametrize("mistake", list(JOIN_BROKEN))
def test_the_join_figure_fails_when_the_all_reduces_do_not_match(mistake):
    with pytest.raises(AssertionError):
        _join(JOIN_BROKEN[mistake])


RESUME_BROKEN = {
    "the restart reads the step but not the weights": [1.2] + LOSSES[11:],
    "the restart begins the data again at step 0": LOSSES[:10],
    "one step differs in its last bit": LOSSES[10:12]
    + [math.nextafter(LOSSES[12], 2.0)] + LOSSES[13:],
}


@pytest.mark.parametrize("mistake", list(RESUME_BROKEN))
def test_the_resume_figure_fails_when_the_restart_goes_another_way(mistake):
    a, b = copy.deepcopy(list(RUNS.values()))
    b["losses"] = RESUME_BROKEN[mistake]
    with pytest.raises(AssertionError):
        _resume(a, b)
