"""Plots with labels in the lesson's language, checked for missing glyphs."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt
from cycler import cycler
from matplotlib.ticker import FuncFormatter, MaxNLocator

from . import i18n
from .fonts import MissingGlyphError, checked_glyphs, setup_japanese_font
from .i18n import t

# Importing plots means drawing: Japanese from here on, also in figures a lesson
# draws with plt directly (labkit.set_lang leaves matplotlib alone in processes that
# never import it).
setup_japanese_font()

# Okabe and Ito's colours for colour-blind readers (Color Universal Design, 2008):
# blue, orange, bluish green, vermillion, sky blue, reddish purple, black. Under
# simulated protanopia, deuteranopia and tritanopia any two stay apart, where
# matplotlib's default orange and green nearly meet (tests/test_plots.py). Their
# yellow is left out: too pale for a line on white.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7",
           "#000000")
BLUE, ORANGE, GREEN, VERMILLION, SKY = PALETTE[:5]
# A marker and a line style per series too, so that no series is told by its colour
# alone (and a grey print keeps them apart).
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo")
LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)),
              (0, (1, 2)))
# Read on a projector: no text under 11 pt.
MIN_FONT_PT = 11
plt.rcParams.update({
    "axes.prop_cycle": (cycler(color=PALETTE) + cycler(marker=MARKERS)
                        + cycler(linestyle=LINESTYLES)),
    "lines.markersize": 5,
    "font.size": 12,
    "axes.titlesize": 13,
    "axes.labelsize": 12,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "figure.titlesize": 13,
    "hatch.linewidth": 1.0,
})


def _sharp_in_notebooks() -> None:
    """Figures at twice the resolution in a notebook (sharp on a retina screen and
    on the site, which shows the notebook's images); elsewhere nothing."""
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return
    if get_ipython() is not None:
        set_matplotlib_formats("retina")


_sharp_in_notebooks()

__all__ = [
    "PALETTE",
    "bar_chart",
    "checked_figure",
    "convergence",
    "font_check",
    "line_chart",
    "loss_curves",
    "measured_vs_model",
    "memory_vs_world_size",
    "methods_chart",
    "rounds",
    "timeline",
    "timelines",
]

# The axes and titles the plots below draw, and those lessons' cells pass them.
i18n.register({
    "step": {"ja": "ステップ", "en": "step"},
    "epoch": {"ja": "エポック", "en": "epoch"},
    "loss": {"ja": "損失 (MSE)", "en": "loss (MSE)"},
    "loss_curve_title": {"ja": "学習曲線", "en": "Training loss"},
    "optimizer_step": {"ja": "オプティマイザのステップ", "en": "optimizer step"},
    "seconds": {"ja": "経過時間 [秒]", "en": "elapsed time [s]"},
    "loss_vs_steps": {"ja": "ステップ数に対する損失", "en": "Loss vs optimizer steps"},
    "loss_vs_time": {"ja": "経過時間に対する損失", "en": "Loss vs wall-clock time"},
    "step_time_ms": {"ja": "1 ステップの時間 [ミリ秒]", "en": "time per step [ms]"},
    "measured": {"ja": "実測", "en": "measured"},
    "grad_compute": {"ja": "勾配の計算", "en": "gradient computation"},
    "forward_pass": {"ja": "順伝播", "en": "forward"},
    "grad_written": {"ja": "1 つのパラメータの勾配ができた",
                     "en": "one parameter's gradient written"},
    "compute_row": {"ja": "計算", "en": "computation"},
    "comm_hidden": {"ja": "隠れた通信 (計算と重なる)",
                    "en": "hidden (overlaps the computation)"},
    "comm_exposed": {"ja": "表に出た通信 (計算のあと)",
                     "en": "exposed (after the computation)"},
    "backward_returns": {"ja": "backward() が戻る", "en": "backward() returns"},
    "bucket_n": {"ja": "バケット {i}", "en": "bucket {i}"},
    "overlap_steps_title": {
        "ja": "ステップごとの通信: 隠れた分と表に出た分",
        "en": "Communication per step: hidden and exposed",
    },
    "world_size": {"ja": "ランクの数 (world size)", "en": "ranks (world size)"},
    "rank_n": {"ja": "ランク {r}", "en": "rank {r}"},
    "backward_calls": {"ja": "backward() の回数", "en": "backward() calls"},
    "grad_norm": {"ja": "fc1.weight.grad のノルム", "en": "norm of fc1.weight.grad"},
    "zero_grad_title": {"ja": "zero_grad() がなければ勾配は積み上がる",
                        "en": "Without zero_grad() the gradients pile up"},
    "bytes": {"ja": "バイト", "en": "bytes"},
    "held_between": {"ja": "順伝播と逆伝播のあいだに持つ",
                     "en": "held between forward and backward"},
    "gathered_in_backward": {"ja": "逆伝播で all-gather する",
                             "en": "all-gathered in the backward"},
    "reshard_title": {"ja": "reshard_after_forward = True / False: メモリと通信の交換",
                      "en": "reshard_after_forward = True / False: memory for traffic"},
    "bytes_per_step": {"ja": "1 ステップに送るバイト数", "en": "bytes sent per step"},
    "methods_bytes_title": {"ja": "方法ごとに送るバイト数 (この実行の大きな MLP)",
                            "en": "What each method sends (this run's large MLP)"},
    "one_node": {"ja": "1 台 × 2 プロセス", "en": "1 machine x 2"},
    "two_nodes": {"ja": "2 台 × 1 プロセス", "en": "2 machines x 1"},
    "allreduces_per_step": {"ja": "1 ステップの all-reduce",
                            "en": "all-reduces per step"},
    "nodes_title": {"ja": "1 ステップの all-reduce: 1 台でも 2 台でも同じ",
                    "en": "All-reduces per step: the same on one machine and two"},
    "round": {"ja": "回", "en": "round"},
    "allreduce_ms": {"ja": "all-reduce 1 回の時間 [ミリ秒]",
                     "en": "one all-reduce [ms]"},
    "rounds_title": {"ja": "同じ all-reduce の 5 回: 時間だけが変わる",
                     "en": "The same all-reduce five times: only the time moves"},
    "by_formula": {"ja": "線: 式", "en": "lines: formula"},
    "measured_on_ranks": {"ja": "印: {n} ランクで実測",
                          "en": "markers: measured on {n} ranks"},
    "font_check_title": {
        "ja": "日本語フォントの確認: 勾配の同期とランク",
        "en": "Font check: gradient synchronization and ranks",
    },
    "fc1_batch": {"ja": "バッチのサンプル数", "en": "samples in the batch"},
    "fc1_len": {"ja": "fc1 に入るベクトルの長さ", "en": "length of fc1's input"},
    "fc1_takes": {"ja": "fc1 = Linear(10, 100) が受け取れる長さ",
                  "en": "what fc1 = Linear(10, 100) takes"},
    "fc1_fits_title": {"ja": "x.view(-1) の長さが fc1 に合うのはバッチが 1 のときだけ",
                       "en": "x.view(-1) fits fc1 only with a batch of one"},
    "train_step_n": {"ja": "学習ステップ {i}", "en": "training step {i}"},
    "values_copied": {"ja": "コピーする値の数", "en": "values copied"},
    "dp_pays_title": {"ja": "DataParallel が学習の各ステップでコピーする値の数",
                      "en": "Values DataParallel copies at every training step"},
    "run_uninterrupted": {"ja": "止まらなかった学習",
                          "en": "the run that never stopped"},
    "run_restarted": {"ja": "起動し直した学習 (2 回目の起動)",
                      "en": "the restarted run (second attempt)"},
    "restart_mark": {"ja": "再起動: ステップ {s} のチェックポイントから",
                     "en": "restart: from the checkpoint of step {s}"},
    "death_mark": {"ja": "ランク {r} が死ぬ (1 回目の起動)",
                   "en": "rank {r} dies (first attempt)"},
    "resume_title": {"ja": "ランク 0 の損失: 起動し直した学習も同じ値をたどる",
                     "en": "Rank 0's loss: the restarted run goes on with the same "
                           "values"},
    "distance_from_mean": {"ja": "ランクの平均からの距離 (L2)",
                           "en": "distance from the ranks' mean (L2)"},
    "local_sgd_drift_title": {"ja": "ローカル SGD: 平均のたびにレプリカが揃う",
                              "en": "Local SGD: the replicas meet at each average"},
    "link_rule_delay": {"ja": "規則の遅延 α + バイト数 / β",
                        "en": "the rule's delay α + bytes / β"},
    "link_held": {"ja": "リンクが止めた時間", "en": "held by the link"},
    "link_call_n": {"ja": "リンクを通した all-reduce (1: 同期、2 と 3: async_op=True)",
                    "en": "all-reduce over the link "
                          "(1: blocking, 2 and 3: async_op=True)"},
    "link_ms": {"ja": "時間 [ミリ秒]", "en": "time [ms]"},
    "link_calls_title": {"ja": "4 MiB の all-reduce 3 回: 回線は 1 本",
                         "en": "Three 4 MiB all-reduces: one wire"},
    "run_resumed": {"ja": "チェックポイントから再開した学習",
                    "en": "resumed from the checkpoint"},
    "resume_fit_title": {"ja": "再開した学習は、止まらなかった学習と同じ損失をたどる",
                         "en": "The resumed run follows the uninterrupted run"},
    "ef_off": {"ja": "誤差のフィードバックなし", "en": "without error feedback"},
    "ef_on": {"ja": "誤差のフィードバックあり", "en": "with error feedback"},
    "steps_k": {"ja": "ウォームアップのあとのステップ数 k",
                "en": "steps k after the warm-up"},
    "sum_rel_error": {"ja": "和の相対誤差", "en": "relative error of the sum"},
    "ef_title": {"ja": "PowerSGD (r = 1) で使われた勾配の和と本当の和 k C",
                 "en": "PowerSGD at r = 1: the applied gradients' sum against k C"},
    "every_round": {"ja": "{label}: 各回", "en": "{label}: every round"},
    "median_of_rounds": {"ja": "{label}: 中央値", "en": "{label}: median"},
    "allreduce_rounds_title": {
        "ja": "all-reduce の時間: 測った各回と中央値",
        "en": "All-reduce times: every timed round and the median"},
    "ckpt_time_title": {"ja": "1 ステップの時間: チェックポイントなしとあり",
                        "en": "Time per step, without and with checkpointing"},
    "fwd_bwd_ms": {"ja": "順伝播と逆伝播 1 回 [ミリ秒]",
                   "en": "one forward + backward [ms]"},
    "first_backward": {"ja": "1 つ目 (勾配を書き込む)",
                       "en": "first (writes the gradients)"},
    "second_backward": {"ja": "2 つ目 (勾配に足し込む)", "en": "second (adds to them)"},
    "first_vs_second_title": {"ja": "更新の 1 つ目と 2 つ目のマイクロバッチ",
                              "en": "An update's first and second micro-batch"},
})


def checked_figure(build: Callable[[], plt.Figure]) -> plt.Figure:
    """Build and draw a figure; if a glyph is missing, close it and raise.

    Closing matters in a notebook: a figure left open would still be shown,
    full of empty boxes, under the error.
    """
    setup_japanese_font()
    fig = None
    try:
        with checked_glyphs():
            fig = build()
            fig.canvas.draw()
    except MissingGlyphError:
        if fig is not None:
            plt.close(fig)
        raise
    return fig


def _every(ys: Sequence[float]) -> int:
    """A marker every so many points: about a dozen on a long curve."""
    return max(1, len(ys) // 12)


def loss_curves(curves: Mapping[str, Sequence[float]], *, xlabel: str = "step",
                title: str = "loss_curve_title", logy: bool = False,
                references: Mapping[str, float] | None = None):
    """Plot one loss curve per label; `xlabel` and `title` are message keys.

    `references` draws labelled dashed horizontal lines (e.g. a loss floor).
    """

    def build():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, ys in curves.items():
            ax.plot(range(1, len(ys) + 1), ys, label=label, markevery=_every(ys))
        for label, y in (references or {}).items():
            ax.axhline(y, linestyle="--", color="gray", linewidth=1, label=label)
        ax.set_xlabel(t(xlabel))
        ax.set_ylabel(t("loss"))
        ax.set_title(t(title))
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        return fig

    return checked_figure(build)


def font_check():
    """A small figure with Japanese and English text; raises if a glyph is missing."""

    def build():
        fig, ax = plt.subplots(figsize=(6, 2.5))
        ax.plot([-1, 0, 1], [1, -0.5, 0.25], marker="o")
        ax.set_title(t("font_check_title"))
        ax.set_xlabel("ランク (rank) −1, 0, 1")
        ax.set_ylabel("勾配 / gradient")
        fig.tight_layout()
        return fig

    return checked_figure(build)


def _size_label(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def line_chart(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
               xlabel: str, ylabel: str, title: str, logx: bool = False,
               logy: bool = False, from_zero: bool = False, x_bytes: bool = False,
               marks: Mapping[str, float] | None = None):
    """One line per label from (xs, ys); labels and title are message keys.

    `marks` draws labelled vertical lines at x (where a run stopped, say), each
    in its own line style; its labels are shown as given, and the legend goes
    beside the plot, off the lines.
    """

    def build():
        fig, ax = plt.subplots(figsize=(9.5, 3.8) if marks else (6, 3.5))
        for label, (xs, ys) in series.items():
            ax.plot(list(xs), list(ys), label=label)
        for i, (label, x) in enumerate((marks or {}).items()):
            ax.axvline(x, color="black", linestyle=(":", "--", "-.")[i % 3],
                       linewidth=1.2, label=label)
        _decorate(ax, xlabel, ylabel, title, logx, logy)
        if logx:  # label the measured x values (1, 2, 4, 8), not powers of two
            ticks = sorted({x for xs, _ in series.values() for x in xs})
            ax.set_xticks(ticks, [_size_label(x) if x_bytes else f"{x:g}"
                                  for x in ticks])
            ax.xaxis.set_minor_locator(plt.NullLocator())
            if x_bytes:
                ax.tick_params(axis="x", labelrotation=45)
        elif all(float(x).is_integer() for xs, _ in series.values() for x in xs):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 1.5
        if from_zero:
            ax.set_ylim(bottom=0)
        if marks:
            ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def bar_chart(groups: Mapping[str, Mapping[str, float]], *, ylabel: str, title: str,
              fmt: str = "{:.3g}"):
    """One panel of bars per group, each with its own scale; values on top.

    `groups` maps a panel title to {bar label: value}; bars with the same label
    have the same colour in every panel.
    """

    def build():
        fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups) + 0.6, 3.5),
                                 squeeze=False)
        labels = list(dict.fromkeys(k for g in groups.values() for k in g))
        for ax, (name, values) in zip(axes[0], groups.items(), strict=True):
            bars = ax.bar(list(values), list(values.values()),
                          color=[PALETTE[labels.index(k) % len(PALETTE)]
                                 for k in values],
                          hatch=[HATCHES[labels.index(k) % len(HATCHES)]
                                 for k in values], edgecolor="white")
            ax.bar_label(bars, labels=[fmt.format(v) for v in values.values()])
            ax.set_title(name)
            ax.margins(y=0.15)
            ax.grid(alpha=0.3, axis="y")
            # plain numbers: an offset such as "1e6" lands on the panel's title
            ax.yaxis.set_major_formatter(FuncFormatter(
                lambda v, _: f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"))
        axes[0][0].set_ylabel(t(ylabel))
        fig.suptitle(t(title))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def methods_chart(panels: Mapping[str, Mapping[str, float]], *, title: str,
                  logx: Sequence[str] = (), fmt: str = "{:.3g}"):
    """Methods side by side: one panel of horizontal bars per measure.

    `panels` maps a measure's message key to {method: value}; the methods are
    the rows, in the same order in every panel. Panels named in `logx` get a
    logarithmic axis. `title` is a message key.
    """

    def build():
        methods = list(dict.fromkeys(m for values in panels.values() for m in values))
        fig, axes = plt.subplots(1, len(panels), sharey=True, squeeze=False,
                                 figsize=(2.9 * len(panels) + 2.2,
                                          0.38 * len(methods) + 1.6))
        for ax, (key, values) in zip(axes[0], panels.items(), strict=True):
            rows = [methods.index(m) for m in values]
            bars = ax.barh(rows, list(values.values()), color=BLUE)
            ax.bar_label(bars, labels=[fmt.format(v) for v in values.values()],
                         padding=2)
            ax.set_title(t(key))
            if key in logx:
                ax.set_xscale("log")
            ax.margins(x=0.35)
            ax.grid(alpha=0.3, axis="x")
        axes[0][0].set_yticks(range(len(methods)), methods)
        axes[0][0].invert_yaxis()
        fig.suptitle(t(title))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def convergence(by_step: Mapping[str, Sequence[float]],
                by_time: Mapping[str, tuple[Sequence[float], Sequence[float]]]):
    """Loss against optimizer steps (left) and against wall-clock seconds (right)."""

    def build():
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
        for label, ys in by_step.items():
            left.plot(range(1, len(ys) + 1), ys, label=label, markevery=_every(ys))
        for label, (xs, ys) in by_time.items():
            right.plot(xs, ys, label=label, markevery=_every(ys))
        _decorate(left, "optimizer_step", "loss", "loss_vs_steps", False, True)
        _decorate(right, "seconds", None, "loss_vs_time", False, True)
        fig.tight_layout()
        return fig

    return checked_figure(build)


def _decorate(ax, xlabel, ylabel, title, logx, logy):
    if xlabel:
        ax.set_xlabel(t(xlabel))
    if ylabel:
        ax.set_ylabel(t(ylabel))
    ax.set_title(t(title))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


# Green and vermillion stay apart for colour-blind readers; the exposed part is
# hatched too, so that it reads without its colour.
_HIDDEN_C, _EXPOSED_C, _EXPOSED_H = GREEN, VERMILLION, "//"


def _step_bars(ax, step: Mapping, end_label: str) -> None:
    """One step of a buckets.Timeline on `ax`: the gradient computation, then one
    bar per all-reduce, hidden part green, exposed part hatched vermillion. A
    whole training step (Timeline.train_step) also draws its forward before the
    backward, a tick where each gradient is written, and the optimizer's step."""
    spans = [(a * 1e3, b * 1e3) for a, b in step["events"]]
    grad_end, returned = step["grad_end"] * 1e3, step["backward_end"] * 1e3
    forward = step.get("forward_end", 0.0) * 1e3
    if forward:
        ax.barh(0, forward, height=0.6, color=SKY, hatch="..", edgecolor="white",
                label=t("forward_pass"))
    ax.barh(0, grad_end - forward, left=forward, height=0.6, color=BLUE,
            label=t("grad_compute"))
    if forward:  # the backward layer by layer, and the step after it
        ticks = [g * 1e3 for g in step["grad_times"]]
        ax.plot(ticks, [0] * len(ticks), linestyle="none", marker="|",
                markersize=16, color="black", label=t("grad_written"))
        ax.barh(0, step["end"] * 1e3 - returned, left=returned, height=0.6,
                color=ORANGE, hatch="xx", edgecolor="white", label=t("optimizer_step"))
    hidden_done = exposed_done = False  # one legend entry each
    for i, (start, stop) in enumerate(spans, start=1):
        if start < grad_end:
            ax.barh(i, min(stop, grad_end) - start, left=start, height=0.6,
                    color=_HIDDEN_C,
                    label=None if hidden_done else t("comm_hidden"))
            hidden_done = True
        if stop > grad_end:
            ax.barh(i, stop - max(start, grad_end), left=max(start, grad_end),
                    height=0.6, color=_EXPOSED_C, hatch=_EXPOSED_H,
                    edgecolor="white",
                    label=None if exposed_done else t("comm_exposed"))
            exposed_done = True
    ax.axvline(grad_end, color=BLUE, linestyle="--", linewidth=1)
    ax.axvline(returned, color="black", linestyle=":", linewidth=1,
               label=t(end_label))
    buckets = [t("bucket_n", i=i) for i in range(len(spans))]
    ax.set_yticks(range(len(spans) + 1),
                  [t("compute_row" if forward else "grad_compute"), *buckets])
    ax.set_xlim(left=0)
    ax.invert_yaxis()
    ax.grid(alpha=0.3)


def timeline(steps: Sequence[Mapping], *, show: int = -1, title: str,
             end_label: str = "backward_returns"):
    """Communication against the gradient computation, from buckets.Timeline records.

    Top: step `show`, one bar per all-reduce, green where it ran before the
    last gradient (hidden), red after it (exposed), and a dotted line where the
    step's gradients are synchronized (`end_label`, a message key). Bottom:
    hidden and exposed milliseconds of every step. `title` is a message key.
    """
    def build():
        step = steps[show]
        n = len(step["events"])
        fig, (ax, ax2) = plt.subplots(
            2, 1, figsize=(8.5, 0.4 * n + 4.5),
            gridspec_kw={"height_ratios": [n + 2, 3]})
        _step_bars(ax, step, end_label)
        ax.set_xlabel("ms")
        number = show + 1 if show >= 0 else len(steps) + show + 1
        ax.set_title(f"{t(title)} ({t('step')} {number})")
        ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
        numbers = range(1, len(steps) + 1)
        hidden = [s["hidden_s"] * 1e3 for s in steps]
        exposed = [s["exposed_s"] * 1e3 for s in steps]
        ax2.bar(numbers, hidden, color=_HIDDEN_C, label=t("comm_hidden"))
        ax2.bar(numbers, exposed, bottom=hidden, color=_EXPOSED_C, hatch=_EXPOSED_H,
                edgecolor="white", label=t("comm_exposed"))
        ax2.set_xticks(list(numbers))
        _decorate(ax2, "step", None, "overlap_steps_title", False, False)
        ax2.set_ylabel("ms")
        ax2.legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def timelines(panels: Mapping[str, Mapping], *, title: str,
              end_label: str = "backward_returns"):
    """Small multiples: one buckets.Timeline step a panel, stacked on one time axis.

    `panels` maps a panel's heading (already in the lesson's language) to a step
    record; each panel draws it as `timeline`'s top does, with the same x axis, so
    that where the communication starts compares at a glance. `title` is a
    message key.
    """
    def build():
        sizes = [len(step["events"]) + 1 for step in panels.values()]
        fig, axes = plt.subplots(
            len(panels), 1, sharex=True, squeeze=False,
            figsize=(8.5, 0.4 * sum(sizes) + 1.0 * len(panels) + 1.0),
            gridspec_kw={"height_ratios": [n + 1.5 for n in sizes]})
        axes = axes[:, 0]
        for ax, (heading, step) in zip(axes, panels.items(), strict=True):
            _step_bars(ax, step, end_label)
            ax.set_title(heading, loc="left", fontsize=12)
        # every panel's bars and its backward's return inside the one shared axis
        # (each panel's set_xlim(left=0) froze the right end at the first's data)
        right = max(max([stop for _, stop in step["events"]]
                        + [step["backward_end"], step.get("end", 0.0)])
                    for step in panels.values()) * 1e3
        axes[0].set_xlim(0, 1.02 * right)
        axes[-1].set_xlabel("ms")
        handles = {}
        for ax in axes:  # every entry once, whichever panel drew it
            for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, h)
        order = [t(k) for k in ("forward_pass", "grad_compute", "grad_written",
                                "comm_hidden", "comm_exposed", end_label,
                                "optimizer_step")]
        labels = [label for label in order if label in handles]
        fig.legend([handles[k] for k in labels], labels, loc="upper center",
                   bbox_to_anchor=(0.5, 0.0), ncol=2)
        fig.suptitle(t(title))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def measured_vs_model(measured: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                      model: Mapping[str, tuple[Sequence[float], Sequence[float]]], *,
                      xlabel: str, ylabel: str, title: str):
    """Markers for measurements, dashed lines for the model, one colour and one
    marker per label."""

    def build():
        fig, ax = plt.subplots(figsize=(7.5, 4))
        for i, (label, (xs, ys)) in enumerate(measured.items()):
            color, marker = PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]
            ax.plot(list(xs), list(ys), marker=marker, linestyle="none", color=color,
                    label=label)
            if label in model:
                mx, my = model[label]
                ax.plot(list(mx), list(my), linestyle="--", marker="none",
                        color=color)
        _decorate(ax, xlabel, ylabel, title, True, True)
        ticks = sorted({x for xs, _ in measured.values() for x in xs})
        ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def memory_vs_world_size(formula: Mapping[str, tuple[Sequence[int], Sequence[float]]],
                         measured: Mapping[str, tuple[int, float]], *, ylabel: str,
                         title: str, budget: tuple[float, str] | None = None):
    """Memory per rank against world size: lines by formula, markers measured.

    `formula` maps a stage to (world sizes, values); `measured` a stage to its
    (world size, value) measured on the ranks, drawn as a large marker of the
    stage's colour; the legend says which is which. `budget` = (value, label)
    draws a dashed horizontal line. `ylabel` and `title` are message keys. The
    x axis is logarithmic, labelled at the world sizes that are powers of 2.
    """
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    def build():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        handles = []
        for i, (stage, (xs, ys)) in enumerate(formula.items()):
            color = PALETTE[i % len(PALETTE)]
            handles += ax.plot(list(xs), list(ys), color=color, marker="none",
                               linestyle=LINESTYLES[i % len(LINESTYLES)], label=stage)
            if stage in measured:
                x, y = measured[stage]
                ax.plot([x], [y], marker=MARKERS[i % len(MARKERS)], color=color,
                        markersize=11, fillstyle="none", markeredgewidth=2)
        if budget is not None:
            handles.append(ax.axhline(budget[0], color="black", linestyle="--",
                                      linewidth=1, label=budget[1]))
        sizes = {x for x, _ in measured.values()}
        handles += [Line2D([], [], color="gray", label=t("by_formula")),
                    Line2D([], [], color="gray", marker="o", linestyle="none",
                           fillstyle="none", markersize=9, markeredgewidth=2,
                           label=t("measured_on_ranks",
                                   n=", ".join(f"{n:g}" for n in sorted(sizes))))]
        _decorate(ax, "world_size", ylabel, title, True, True)
        ticks = sorted({x for xs, _ in formula.values() for x in xs
                        if x >= 1 and int(x) & (int(x) - 1) == 0 and x == int(x)})
        ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        # Bottom left stays empty: every line starts at the top left.
        ax.legend(handles=handles, loc="lower left")
        fig.tight_layout()
        return fig

    return checked_figure(build)


def rounds(series: Mapping[str, tuple[Sequence, Sequence[Sequence[float]]]], *,
           xlabel: str, ylabel: str, title: str, logx: bool = False,
           logy: bool = False, x_bytes: bool = False,
           lines: Mapping[str, tuple[Sequence, Sequence[float]]] | None = None):
    """Every timed round as a point, and the rounds' median as a line, per label.

    `series` maps a label to (xs, rounds): rounds[i] holds every time measured
    at xs[i] (numbers, or names for a category axis). `lines` adds dashed lines
    without markers (a model's), labelled as given. Axis keys as line_chart's.
    """

    def build():
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for i, (label, (xs, rs)) in enumerate(series.items()):
            color, marker = PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)]
            ax.plot([x for x, r in zip(xs, rs, strict=True) for _ in r],
                    [v for r in rs for v in r], linestyle="none", marker=marker,
                    fillstyle="none", alpha=0.7, color=color,
                    label=t("every_round", label=label))
            ax.plot(list(xs), [statistics.median(r) for r in rs], color=color,
                    marker="_", markersize=16, markeredgewidth=2, linestyle="-",
                    label=t("median_of_rounds", label=label))
        for j, (label, (xs, ys)) in enumerate((lines or {}).items()):
            ax.plot(list(xs), list(ys), color=PALETTE[(len(series) + j) % len(PALETTE)],
                    marker="none", linestyle="--", label=label)
        _decorate(ax, xlabel, ylabel, title, logx, logy)
        if logx:  # label the measured x values, not powers of two
            ticks = sorted({x for xs, _ in series.values() for x in xs})
            ax.set_xticks(ticks, [_size_label(x) if x_bytes else f"{x:g}"
                                  for x in ticks])
            ax.xaxis.set_minor_locator(plt.NullLocator())
            if x_bytes:
                ax.tick_params(axis="x", labelrotation=45)
        if any(isinstance(x, str) for xs, _ in series.values() for x in xs):
            ax.margins(x=0.25)  # names: the points and their labels off the frame
        fig.tight_layout()
        return fig

    return checked_figure(build)
