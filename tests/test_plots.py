"""Each plotting function on fixed data: what it draws, its labels in both
languages, text a projector shows, and colours a colour-blind reader tells apart."""

from __future__ import annotations

import itertools
import math

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.text import Text

import labkit
import labkit.buckets  # noqa: F401  (registers the DDP step's titles)
from labkit import plots
from labkit.fonts import MissingGlyphError

# Machado, Oliveira and Fernandes (2009), severity 1: each dichromacy as a matrix on
# linear RGB.
CVD = {
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216),
                   (-0.003882, -0.048116, 1.051998)),
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413),
                     (-0.011820, 0.042940, 0.968881)),
    "tritanopia": ((1.255528, -0.076749, -0.178779), (-0.078411, 0.930809, 0.147602),
                   (0.004733, 0.691367, 0.303900)),
}
# CIELAB distance below which two colours of a figure's key read as one; about a
# "just noticeable" 2.3 times five, for thin lines and small markers.
APART = 12.0
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")  # matplotlib's default, first 4


def _lab(color: str, matrix=None) -> tuple[float, float, float]:
    """`color` in CIELAB (D65), as a reader with `matrix`'s dichromacy sees it."""
    srgb = matplotlib.colors.to_rgb(color)
    rgb = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in srgb]
    if matrix is not None:
        rgb = [min(1.0, max(0.0, sum(m * c for m, c in zip(row, rgb, strict=True))))
               for row in matrix]
    r, g, b = rgb
    xyz = (0.4124564 * r + 0.3575761 * g + 0.1804375 * b,
           0.2126729 * r + 0.7151522 * g + 0.0721750 * b,
           0.0193339 * r + 0.1191920 * g + 0.9503041 * b)
    white = (0.95047, 1.0, 1.08883)
    d = 6 / 29
    fx, fy, fz = (t ** (1 / 3) if t > d ** 3 else t / (3 * d * d) + 4 / 29
                  for t in (v / n for v, n in zip(xyz, white, strict=True)))
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def closest_pair(colors) -> dict[str, tuple[float, str, str]]:
    """For normal vision and each dichromacy, the two of `colors` that come closest."""
    out = {}
    for name, matrix in {"normal": None, **CVD}.items():
        out[name] = min((math.dist(_lab(a, matrix), _lab(b, matrix)), a, b)
                        for a, b in itertools.combinations(colors, 2))
    return out


def test_the_palette_stays_apart_under_each_colour_vision_deficiency():
    worst = closest_pair(plots.PALETTE)
    assert all(d >= APART for d, _, _ in worst.values()), worst


def test_the_check_of_colours_fails_on_matplotlib_s_default_cycle():
    """What the palette replaced: orange and green nearly meet under protanopia,
    green and red under deuteranopia."""
    worst = closest_pair(TAB10)
    assert worst["protanopia"][0] < APART and worst["deuteranopia"][0] < APART
    assert worst["normal"][0] > 30  # apart for a reader without a deficiency


def _texts(fig) -> list[Text]:
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


# One bucket for the whole model: its all-reduce after the last gradient.
_ONE_BUCKET = {"events": [(0.0052, 0.011)], "grad_end": 0.005, "backward_end": 0.0112,
               "hidden_s": 0.0, "exposed_s": 0.0058}


# A whole training step (buckets.Timeline.train_step): forward, gradients, two
# buckets, backward's return, the optimizer's step.
_TRAIN_STEP = {"forward_end": 0.002, "grad_times": [0.003, 0.004, 0.006],
               "grad_end": 0.006, "events": [(0.0041, 0.005), (0.0061, 0.0075)],
               "backward_end": 0.008, "end": 0.009, "hidden_s": 0.0009,
               "exposed_s": 0.0014}


def _figures():
    """One figure from each plotting function, on fixed data."""
    step = {"events": [(0.001, 0.004), (0.003, 0.009)], "grad_end": 0.005,
            "backward_end": 0.0095, "hidden_s": 0.004, "exposed_s": 0.004}
    series = {"DDP": ([1, 2, 4], [3.0, 2.0, 1.5]), "no_sync": ([1, 2, 4], [3, 1, .5])}
    return {
        "loss_curves": plots.loss_curves({"a": [1.0, 0.5, 0.3], "b": [1.1, 0.4, 0.2]},
                                         references={"floor": 0.1}),
        "line_chart": plots.line_chart(series, xlabel="world_size",
                                       ylabel="step_time_ms", title="loss_vs_steps",
                                       logx=True),
        "bar_chart": plots.bar_chart({"p1": {"x": 1.0, "y": 2.0}, "p2": {"x": 3.0}},
                                     ylabel="step_time_ms", title="loss_vs_steps"),
        "methods_chart": plots.methods_chart(
            {"step_time_ms": {"DDP": 2.0, "fp16": 1.0}}, title="loss_vs_steps"),
        "convergence": plots.convergence({"a": [1.0, 0.5]}, {"a": ([0.1, 0.2],
                                                                   [1.0, 0.5])}),
        "timeline": plots.timeline([step, step], title="overlap_steps_title"),
        "timelines": plots.timelines(
            {"bucket_cap_mb=1": step, "bucket_cap_mb=25": _ONE_BUCKET},
            title="overlap_steps_title"),
        "ddp_step": plots.timelines({"rank 0": _TRAIN_STEP, "rank 1": _TRAIN_STEP},
                                    title="ddp_step_title"),
        "measured_vs_model": plots.measured_vs_model(
            series, series, xlabel="world_size", ylabel="step_time_ms",
            title="loss_vs_steps"),
        "memory_vs_world_size": plots.memory_vs_world_size(
            series, {"DDP": (2, 2.0)}, ylabel="step_time_ms", title="loss_vs_steps"),
        "font_check": plots.font_check(),
    }


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_every_plot_labels_in_the_lesson_s_language_at_a_readable_size(lang):
    labkit.set_lang(lang)
    try:
        figures = _figures()
        for name, fig in figures.items():
            texts = _texts(fig)
            small = [(t.get_text(), t.get_fontsize()) for t in texts
                     if t.get_fontsize() < plots.MIN_FONT_PT]
            assert small == [], (name, small)
        words = {t.get_text() for t in _texts(figures["timeline"])}
        hidden = labkit.t("comm_hidden")
        assert hidden in words and ("隠れた" in hidden) == (lang == "ja")
        title = figures["loss_curves"].axes[0].get_title()
        assert title == labkit.t("loss_curve_title")
    finally:
        plt.close("all")
        labkit.set_lang("en")


def test_a_series_is_told_by_marker_and_line_style_not_colour_alone():
    fig = plots.line_chart({"a": ([1, 2], [1, 2]), "b": ([1, 2], [2, 3]),
                            "c": ([1, 2], [3, 4])}, xlabel="world_size",
                           ylabel="step_time_ms", title="loss_vs_steps")
    lines = fig.axes[0].get_lines()
    assert len({ln.get_marker() for ln in lines}) == 3
    assert len({str(ln.get_linestyle()) for ln in lines}) == 3
    assert len({ln.get_color() for ln in lines}) == 3
    plt.close(fig)


def test_the_timeline_hatches_the_exposed_communication():
    step = {"events": [(0.001, 0.004), (0.003, 0.009)], "grad_end": 0.005,
            "backward_end": 0.0095, "hidden_s": 0.004, "exposed_s": 0.004}
    fig = plots.timeline([step], title="overlap_steps_title")
    top = fig.axes[0]
    colours = {matplotlib.colors.to_hex(p.get_facecolor()): p.get_hatch()
               for p in top.patches}
    assert colours[plots.VERMILLION.lower()] == "//"  # exposed: colour and hatching
    assert not colours[plots.GREEN.lower()]  # hidden: its colour alone
    assert closest_pair([plots.BLUE, plots.GREEN, plots.VERMILLION])[
        "deuteranopia"][0] >= APART
    plt.close(fig)


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_timelines_draws_one_panel_a_step_on_one_time_axis(lang):
    labkit.set_lang(lang)
    try:
        step = {"events": [(0.001, 0.004), (0.003, 0.009)], "grad_end": 0.005,
                "backward_end": 0.0095, "hidden_s": 0.004, "exposed_s": 0.004}
        fig = plots.timelines({"cap 1": step, "cap 25": _ONE_BUCKET},
                              title="overlap_steps_title")
        top, bottom = fig.axes
        assert [top.get_title(loc="left"), bottom.get_title(loc="left")] == [
            "cap 1", "cap 25"]
        assert top.get_shared_x_axes().joined(top, bottom)  # the same time axis
        # the axis holds every panel's last bar, the first panel's or not
        ends = [max(b for _, b in s["events"]) * 1e3 for s in (step, _ONE_BUCKET)]
        assert bottom.get_xlim()[0] == 0 and bottom.get_xlim()[1] >= max(ends)
        # a bar for the computation and each all-reduce's parts; one bucket: one bar
        assert [len(ax.get_yticks()) for ax in fig.axes] == [3, 2]
        colours = {matplotlib.colors.to_hex(p.get_facecolor()): p.get_hatch()
                   for p in bottom.patches}
        assert set(colours) == {plots.BLUE.lower(), plots.VERMILLION.lower()}
        assert colours[plots.VERMILLION.lower()] == "//"  # exposed, hatched
        legend = fig.legends[0]
        texts = [x.get_text() for x in legend.get_texts()]
        assert texts == [labkit.t("grad_compute"), labkit.t("comm_hidden"),
                         labkit.t("comm_exposed"), labkit.t("backward_returns")]
        assert fig._suptitle.get_text() == labkit.t("overlap_steps_title")
        # nothing overlaps: the panels' tick labels stay apart from each other
        fig.canvas.draw()
        boxes = [label.get_window_extent() for ax in fig.axes
                 for label in ax.get_yticklabels()]
        assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    finally:
        plt.close("all")
        labkit.set_lang("en")


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_a_training_step_draws_forward_gradients_and_the_optimizer(lang):
    labkit.set_lang(lang)
    try:
        fig = plots.timelines({"rank 0": _TRAIN_STEP, "rank 1": _TRAIN_STEP},
                              title="ddp_step_title")
        ax = fig.axes[0]
        bars = {matplotlib.colors.to_hex(p.get_facecolor()): (p.get_x(), p.get_width())
                for p in ax.patches}
        # the forward to 2 ms, the backward to the last gradient, the step after
        assert bars[plots.SKY.lower()] == pytest.approx((0.0, 2.0))
        assert bars[plots.BLUE.lower()] == pytest.approx((2.0, 4.0))
        assert bars[plots.ORANGE.lower()] == pytest.approx((8.0, 1.0))
        ticks = [ln for ln in ax.get_lines() if ln.get_marker() == "|"]
        assert list(ticks[0].get_xdata()) == pytest.approx([3.0, 4.0, 6.0])
        assert ax.get_yticklabels()[0].get_text() == labkit.t("compute_row")
        assert fig.axes[1].get_xlim()[1] >= 9.0  # the optimizer's end inside
        texts = [x.get_text() for x in fig.legends[0].get_texts()]
        assert texts == [labkit.t(k) for k in (
            "forward_pass", "grad_compute", "grad_written", "comm_hidden",
            "comm_exposed", "backward_returns", "optimizer_step")]
        assert ("順伝播" in texts[0]) == (lang == "ja")
        # the step's five colours apart for every reader
        assert closest_pair([plots.SKY, plots.BLUE, plots.ORANGE, plots.GREEN,
                             plots.VERMILLION])["deuteranopia"][0] >= APART
    finally:
        plt.close("all")
        labkit.set_lang("en")


def test_a_missing_glyph_is_still_refused():
    labkit.set_lang("ja")
    try:
        with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
            with pytest.raises(MissingGlyphError):
                plots.line_chart({"ランク": ([1, 2], [1, 2])}, xlabel="world_size",
                                 ylabel="step_time_ms", title="loss_vs_steps")
    finally:
        labkit.set_lang("en")


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_a_line_chart_marks_where_a_run_stopped_beside_its_legend(lang):
    labkit.set_lang(lang)
    try:
        marks = {labkit.t("restart_mark", s=10): 10, labkit.t("death_mark", r=1): 12}
        fig = plots.line_chart({labkit.t("run_uninterrupted"): ([1, 2, 3], [3, 2, 1])},
                               xlabel="step", ylabel="loss", title="resume_title",
                               marks=marks)
        ax = fig.axes[0]
        verticals = ax.get_lines()[1:]
        assert [list(v.get_xdata()) for v in verticals] == [[10, 10], [12, 12]]
        assert len({str(v.get_linestyle()) for v in verticals}) == 2
        legend = ax.get_legend()
        assert [x.get_text() for x in legend.get_texts()] == [
            labkit.t("run_uninterrupted"), *marks]
        # beside the plot: the legend starts right of the axes
        fig.canvas.draw()
        assert legend.get_window_extent().x0 > ax.get_window_extent().x1
        assert ax.get_title() == labkit.t("resume_title")
    finally:
        plt.close("all")
        labkit.set_lang("en")


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_rounds_draws_every_round_and_their_median(lang):
    labkit.set_lang(lang)
    try:
        measured = labkit.t("measured")
        fig = plots.rounds({measured: ([1024, 4096], [[1, 3, 2], [5, 4, 9]])},
                           xlabel="round", ylabel="allreduce_ms",
                           title="allreduce_rounds_title", logx=True, x_bytes=True,
                           lines={"model": ([1024, 4096], [2, 4])})
        ax = fig.axes[0]
        points, median, model = ax.get_lines()
        assert list(points.get_xdata()) == [1024] * 3 + [4096] * 3  # every round
        assert list(points.get_ydata()) == [1, 3, 2, 5, 4, 9]
        assert points.get_linestyle() == "None"
        assert list(median.get_ydata()) == [2, 5]  # medians, not means
        assert list(model.get_ydata()) == [2, 4] and model.get_linestyle() == "--"
        assert [x.get_text() for x in ax.get_legend().get_texts()] == [
            labkit.t("every_round", label=labkit.t("measured")),
            labkit.t("median_of_rounds", label=labkit.t("measured")), "model"]
        assert ax.get_title() == labkit.t("allreduce_rounds_title")
        assert [x.get_text() for x in ax.get_xticklabels()] == ["1 KiB", "4 KiB"]
        # names on a category axis too
        fig = plots.rounds({"step": (["plain", "checkpointed"], [[1, 2], [3, 4]])},
                           xlabel="", ylabel="step_time_ms", title="ckpt_time_title")
        assert list(fig.axes[0].get_lines()[1].get_ydata()) == [1.5, 3.5]
    finally:
        plt.close("all")
        labkit.set_lang("en")
