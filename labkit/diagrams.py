"""Pictures of the course's ideas, drawn from what a lesson's ranks recorded.

Each function takes values the lesson has just computed (and asserts), never a
drawing made by hand: the ring all-reduce from `labkit.ring`'s record, the
collectives as each rank's values before and after, the all-reduces of each
backward pass of one update, and the memory a rank holds per ZeRO stage. Colours,
fonts and the glyph check are labkit.plots'.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from . import i18n
from .i18n import t
from .plots import HATCHES, PALETTE, VERMILLION, checked_figure

__all__ = ["collectives", "dim0_shards", "gathered", "gradients", "micro_batches",
           "ring", "rounds", "sequences", "zero_memory"]

i18n.register({
    "ring_start": {"ja": "最初", "en": "start"},
    "ring_rs": {"ja": "reduce-scatter {s}", "en": "reduce-scatter {s}"},
    "ring_ag": {"ja": "all-gather {s}", "en": "all-gather {s}"},
    "ring_title": {
        "ja": "{n} ランクのリング all-reduce (送られたテンソルから): "
              "数字 = そのチャンクに足し込まれたランクの数\n"
              "太い枠 = 次のステップで右隣へ送るチャンク",
        "en": "Ring all-reduce on {n} ranks, from the tensors sent: number = ranks "
              "summed into the chunk\nthick frame = the chunk sent to the right "
              "neighbour next",
    },
    "device_n": {"ja": "デバイス {r}", "en": "device {r}"},
    "split_row": {"ja": "{b} サンプルを {n} 台に", "en": "{b} samples on {n}"},
    "splits_title": {"ja": "scatter が各デバイスに渡すサンプル数",
                     "en": "Samples scatter gives each device"},
    "dp_scatter": {"ja": "scatter: サンプル数", "en": "scatter: samples"},
    "dp_replicate": {"ja": "replicate: パラメータ数", "en": "replicate: parameters"},
    "dp_apply": {"ja": "parallel_apply: 出力の行数",
                 "en": "parallel_apply: output rows"},
    "dp_gather": {"ja": "gather: 出力の行数", "en": "gather: output rows"},
    "dp_steps_title": {"ja": "DataParallel の 4 段階: 各デバイスにあるもの",
                       "en": "DataParallel's four steps: what each device holds"},
    "sampler_title": {"ja": "各ランクが受け持つサンプルの番号: 枠 = 水増し",
                      "en": "The samples each rank takes: frame = padding"},
    "node_n": {"ja": "ノード {r}", "en": "node {r}"},
    "torchrun_title": {"ja": "torchrun が各プロセスに渡す番号 (2 ノード × 4 プロセス)",
                       "en": "The numbers torchrun hands each process (2 nodes x 4)"},
    "fsdp_held_title": {"ja": "fully_shard のあと各ランクが持つ値の数",
                        "en": "Values each rank holds after fully_shard"},
    "epoch_set": {"ja": "エポック {e} (set_epoch)", "en": "epoch {e}, set_epoch"},
    "epoch_unset": {"ja": "エポック {e} (set_epoch なし)",
                    "en": "epoch {e}, no set_epoch"},
    "sampler_epochs_title": {"ja": "DistributedSampler が各ランクに渡す添字",
                             "en": "The indices DistributedSampler gives each rank"},
    "not_entered": {"ja": "(入っていない)", "en": "(not entered)"},
    "sequences_title": {"ja": "各ランクが入った集団通信 (Flight Recorder): "
                              "枠 = 食い違う最初の番号",
                        "en": "Collectives each rank entered (Flight Recorder): "
                              "frame = where they part"},
    "collectives_title": {"ja": "各ランクの値: 集団通信の前と後",
                          "en": "Each rank's values, before and after each collective"},
    "backward_n": {"ja": "逆伝播 {k}", "en": "backward {k}"},
    "micro_batches_title": {
        "ja": "1 回の更新 (K = {k}) の逆伝播ごとの all-reduce の回数",
        "en": "All-reduces in each backward pass of one update (K = {k})",
    },
    "bytes_held": {"ja": "1 ランクが持つバイト数", "en": "bytes one rank holds"},
    "zero_held_title": {"ja": "1 ランクが持つモデルの状態 (ZeRO のステージごと)",
                   "en": "Model state one rank holds, per ZeRO stage"},
    "held_parameters": {"ja": "パラメータ", "en": "parameters"},
    "held_gradients": {"ja": "勾配", "en": "gradients"},
    "held_optimizer": {"ja": "オプティマイザの状態", "en": "optimizer state"},
    "by_formula_mark": {"ja": "式による合計", "en": "total by the formula"},
    "join_without": {"ja": "Join なし", "en": "no Join"},
    "join_k": {"ja": "Join, K = {k}", "en": "Join, K = {k}"},
    "join_sent_title": {"ja": "各ランクが更新ごとに呼ぶ勾配の all-reduce: "
                              "枠 = バッチを使い切ったあと (0 の勾配)",
                        "en": "Gradient all-reduces each rank calls per update: "
                              "frame = after its batches ran out (zeros)"},
    "gathered_bytes": {"ja": "集めたパラメータのバイト数",
                       "en": "gathered parameter bytes"},
    "gathered_title": {"ja": "ZeRO-3 の 1 ステップ: 1 ランクが集めて持つパラメータ",
                       "en": "One ZeRO-3 step: the parameters one rank holds gathered"},
    "gathered_gather": {"ja": "集める\n層 {i}", "en": "gather\nlayer {i}"},
    "gathered_free": {"ja": "解放\n層 {i}", "en": "free\nlayer {i}"},
    "gathered_forward": {"ja": "順伝播", "en": "forward"},
    "gathered_backward": {"ja": "逆伝播", "en": "backward"},
    "gathered_whole": {"ja": "モデル全体 (DDP はずっと持つ)",
                       "en": "the whole model (DDP holds it throughout)"},
    "dim0_title": {"ja": "fully_shard: 各ランクが持つ 0 番目の次元の行 (torch.chunk)",
                   "en": "fully_shard: the rows of dim 0 each rank holds "
                         "(torch.chunk)"},
    "dim0_rows": {"ja": "行 {a}〜{b} ({n} 行)", "en": "rows {a}-{b} ({n})"},
    "dim0_row": {"ja": "行 {a}", "en": "row {a}"},
    "dim0_empty": {"ja": "ランク {r}: 空 (0 行)", "en": "rank {r}: empty (0 rows)"},
    "dim0_share": {"ja": "0 番目の次元の行 (全体に対する割合)",
                   "en": "share of the rows of dim 0"},
    "got_grad": {"ja": "勾配あり", "en": "gradient"},
    "gradients_title": {"ja": "最初の逆伝播で勾配ができたパラメータ "
                              "(各ランクの .grad): 枠 = 勾配なし",
                        "en": "Parameters with a gradient after the first backward "
                              "(each rank's .grad): frame = no gradient"},
    "rounds_median": {"ja": "中央値", "en": "median"},
    "ddp_bytes_title": {"ja": "DDP の逆伝播ごとの all-reduce\n箱 = 1 回の呼び出し\n"
                              "数字 = 送ったバイト数",
                        "en": "DDP's all-reduces in each backward\n"
                              "(one box = one call, number = bytes sent)"},
    "values_before": {"ja": "呼ぶ前", "en": "before"},
    "bn_stats_title": {"ja": "BatchNorm が正規化に使う特徴ごとの統計: "
                             "自分のバッチと全体のバッチ",
                       "en": "Per-feature statistics BatchNorm normalizes with: "
                             "own batch, whole batch"},
})

_PARTS = ("parameters", "gradients", "optimizer")


def _boxes(ax, x0: float, y: float, values: Sequence[float], vmax: float,
           fmt: str = "{:.2g}") -> None:
    """One row of boxes, a value each, shaded by its size (one hue: any reader);
    `vmax` 0: all light."""
    cmap = plt.get_cmap("Blues")
    for i, v in enumerate(values):
        shade = 0.15 + 0.75 * min(1.0, abs(v) / vmax) if vmax else 0.15
        ax.add_patch(Rectangle((x0 + i, y), 0.92, 0.72, color=cmap(shade)))
        ax.text(x0 + i + 0.46, y + 0.36, fmt.format(v), ha="center", va="center",
                fontsize=11, color="white" if shade > 0.55 else "black")


def ring(records: Sequence[Mapping]) -> plt.Figure:
    """The ring all-reduce of `labkit.ring.all_reduce`, one record per rank.

    Rows are the steps (start, reduce-scatter 1 .. n-1, all-gather 1 .. n-1),
    columns the ranks; each chunk shows how many ranks' parts it holds, and the
    chunk a rank sends next is framed.
    """
    n = len(records)
    steps = len(records[0]["counts"])

    def build():
        fig, ax = plt.subplots(figsize=(max(7.0, 2.4 * n + 2.5), 0.75 * steps + 1.6))
        for s in range(steps):
            y = steps - 1 - s
            label = (t("ring_start") if s == 0 else t("ring_rs", s=s) if s <= n - 1
                     else t("ring_ag", s=s - (n - 1)))
            ax.text(-0.4, y + 0.36, label, ha="right", va="center", fontsize=11)
            for r, record in enumerate(records):
                x0 = r * (n + 1)
                _boxes(ax, x0, y, record["counts"][s], n, "{:.0f}")
                if s < steps - 1:
                    c = record["sent"][s]
                    ax.add_patch(Rectangle((x0 + c, y), 0.92, 0.72, fill=False,
                                           ec=VERMILLION, lw=2.5))
        for r in range(n):
            ax.text(r * (n + 1) + n / 2, steps + 0.1, t("rank_n", r=r), ha="center",
                    fontsize=12)
        ax.set_xlim(-3.6, n * (n + 1))
        ax.set_ylim(-0.3, steps + 0.6)
        ax.axis("off")
        ax.set_title(t("ring_title", n=n), fontsize=12)
        fig.tight_layout()
        return fig

    return checked_figure(build)


def collectives(rows: Mapping[str, Sequence[Sequence[float]]], *,
                column: str = "rank_n", title: str = "collectives_title",
                fmt: str = "{:.2g}", shade: bool = True,
                framed: Collection[tuple[str, int, int]] = ()) -> plt.Figure:
    """Each rank's values in each row: `rows` maps a label (what ran, such as
    "dist.all_reduce(x)") to one list of values per rank (per device, with
    `column="device_n"`); `column` and `title` are message keys. `shade=False`
    for values that are names (indices), not sizes; `framed` frames the boxes
    (row label, rank, position) the text points at."""
    n = max(len(ranks) for ranks in rows.values())
    width = max(len(v) for ranks in rows.values() for v in ranks)
    vmax = max((abs(x) for ranks in rows.values() for v in ranks for x in v),
               default=1.0) if shade else 0.0

    unit_in = 0.7  # inches per box
    label_in = 0.1 * max(len(label) for label in rows)  # monospace, 11 pt

    def build():
        fig, ax = plt.subplots(figsize=(label_in + 0.5 + n * (width + 1) * unit_in,
                                        0.8 * len(rows) + 1.4))
        for i, (label, ranks) in enumerate(rows.items()):
            y = len(rows) - 1 - i
            ax.text(-0.4, y + 0.36, label, ha="right", va="center", fontsize=11,
                    family="monospace" if label.isascii() else None)  # code: mono
            for r, values in enumerate(ranks):
                _boxes(ax, r * (width + 1), y, values, vmax, fmt)
        for label, r, i in framed:
            y = len(rows) - 1 - list(rows).index(label)
            ax.add_patch(Rectangle((r * (width + 1) + i, y), 0.92, 0.72, fill=False,
                                   ec=VERMILLION, lw=2.5))
        for r in range(n):
            ax.text(r * (width + 1) + width / 2, len(rows) + 0.1, t(column, r=r),
                    ha="center", fontsize=12)
        ax.set_xlim(-(label_in + 0.4) / unit_in, n * (width + 1))
        ax.set_ylim(-0.3, len(rows) + 0.6)
        ax.axis("off")
        ax.set_title(t(title))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def sequences(per_rank: Sequence[Sequence[tuple[int, str]]]) -> plt.Figure:
    """The collectives each rank entered, side by side: `per_rank` holds each
    rank's (sequence number, name) pairs, as its Flight Recorder keeps them. A rank
    without an entry for a number shows a hatched gap, and the first number where
    the ranks part (a gap or another name) is framed."""
    seqs = sorted({seq for entries in per_rank for seq, _ in entries})
    names = [dict(entries) for entries in per_rank]
    parted = next((seq for seq in seqs
                   if len({table.get(seq) for table in names}) > 1), None)

    def build():
        n = len(per_rank)
        fig, ax = plt.subplots(figsize=(2.0 + 3.0 * n, 0.7 * len(seqs) + 1.6))
        for row, seq in enumerate(seqs):
            y = len(seqs) - 1 - row
            ax.text(-0.15, y + 0.35, f"#{seq}", ha="right", va="center", fontsize=11)
            for r, table in enumerate(names):
                x = r * 3.0
                if seq in table:
                    ax.add_patch(Rectangle((x, y), 2.8, 0.7, color=PALETTE[4],
                                           alpha=0.35))
                    ax.text(x + 1.4, y + 0.35, table[seq], ha="center", va="center",
                            fontsize=11, family="monospace")
                else:
                    ax.add_patch(Rectangle((x, y), 2.8, 0.7, fill=False,
                                           hatch="//", ec="gray"))
                    ax.text(x + 1.4, y + 0.35, t("not_entered"), ha="center",
                            va="center", fontsize=11,
                            bbox={"facecolor": "white", "edgecolor": "none"})
            if seq == parted:
                ax.add_patch(Rectangle((-0.1, y - 0.08), 3.0 * n - 0.1, 0.86,
                                       fill=False, ec=VERMILLION, lw=2.5))
        for r in range(n):
            ax.text(r * 3.0 + 1.4, len(seqs) + 0.1, t("rank_n", r=r), ha="center",
                    fontsize=12)
        ax.set_xlim(-1.2, 3.0 * n)
        ax.set_ylim(-0.3, len(seqs) + 0.6)
        ax.axis("off")
        ax.set_title(t("sequences_title"))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def micro_batches(counts: Mapping[str, Sequence[int]]) -> plt.Figure:
    """All-reduces in each backward pass of one update: `counts` maps a way of
    accumulating ("DDP", "no_sync") to the count of each of its K backwards."""
    k = max(len(c) for c in counts.values())

    def build():
        fig, axes = plt.subplots(len(counts), 1, figsize=(7, 1.3 * len(counts) + 1),
                                 sharex=True, squeeze=False)
        top = max(max(c) for c in counts.values()) or 1
        for i, (ax, (label, row)) in enumerate(zip(axes[:, 0], counts.items(),
                                                   strict=True)):
            bars = ax.bar(range(1, len(row) + 1), row, color=PALETTE[i % len(PALETTE)],
                          hatch=HATCHES[i % len(HATCHES)], edgecolor="black")
            ax.bar_label(bars, fontsize=11)
            ax.set_ylim(0, top * 1.35)
            ax.set_ylabel(label, rotation=0, ha="right", va="center")
            ax.set_yticks([])
        axes[-1, 0].set_xticks(range(1, k + 1),
                               [t("backward_n", k=j) for j in range(1, k + 1)])
        fig.suptitle(t("micro_batches_title", k=k))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def zero_memory(held: Mapping[str, Mapping[str, float]], *, ylabel: str,
                formula: Mapping[str, float] | None = None) -> plt.Figure:
    """Stacked bars of what one rank holds per stage: `held` maps a stage ("DDP",
    "ZeRO-1", ...) to its "parameters", "gradients" and "optimizer" (one unit,
    named by `ylabel`, a message key); `formula` marks each stage's total by the
    formula."""

    def build():
        fig, ax = plt.subplots(figsize=(8.5, 4.5))
        stages = list(held)
        bottom = [0.0] * len(stages)
        for i, part in enumerate(_PARTS):
            heights = [held[s].get(part, 0.0) for s in stages]
            ax.bar(stages, heights, bottom=bottom, color=PALETTE[i], hatch=HATCHES[i],
                   edgecolor="black", label=t(f"held_{part}"))
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        if formula:
            # beside the bar, pointing at its level: the formula is usually met
            xs = [stages.index(s) + 0.47 for s in formula]
            ax.scatter(xs, list(formula.values()), marker="<", s=120, color="black",
                       zorder=3, label=t("by_formula_mark"))
        ax.set_ylabel(t(ylabel))
        ax.set_title(t("zero_held_title"))
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def gathered(trace: Sequence[tuple[str, int, float]], *,
             whole: float | None = None) -> plt.Figure:
    """The gathered parameter bytes one rank holds through a ZeRO-3 step: `trace`
    lists, in order, each "gather" or "free", the layer it was for (0 first) and
    the bytes held gathered just after it. A layer gathered a second time starts
    the backward pass (shaded); `whole` marks the whole model's bytes."""
    seen: set[int] = set()
    backward = len(trace)
    for i, (what, layer, _) in enumerate(trace):
        if what == "gather" and layer in seen:
            backward = min(backward, i)
        seen.add(layer)

    def build():
        n = len(trace)
        fig, ax = plt.subplots(figsize=(max(7.0, 0.85 * n + 1.5), 4.4))
        held = [b for _, _, b in trace]
        ax.stairs(held, range(n + 1), fill=True, color=PALETTE[0], alpha=0.35)
        ax.stairs(held, range(n + 1), color=PALETTE[0], lw=2)
        for i, b in enumerate(held):
            if b:
                ax.text(i + 0.5, b, f"{b:,.0f}", ha="center", va="bottom", fontsize=11)
        if whole:
            ax.axhline(whole, ls="--", color=VERMILLION, lw=1.5)
            ax.text(0.1, whole * 1.015, f"{t('gathered_whole')}: {whole:,.0f}",
                    ha="left", va="bottom", fontsize=11, color=VERMILLION)
        top = max([*held, whole or 0, 1]) * 1.3
        ax.axvspan(backward, n, color="gray", alpha=0.12, lw=0)
        for x0, x1, key in ((0, backward, "gathered_forward"),
                            (backward, n, "gathered_backward")):
            if x1 > x0:
                ax.text((x0 + x1) / 2, top * 0.97, t(key), ha="center", va="top",
                        fontsize=12)
        ax.set_xticks([i + 0.5 for i in range(n)],
                      [t(f"gathered_{what}", i=layer + 1) for what, layer, _ in trace])
        ax.set_xlim(0, n)
        ax.set_ylim(0, top)
        ax.set_ylabel(t("gathered_bytes"))
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_title(t("gathered_title"))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def dim0_shards(per_rank: Sequence[Sequence[tuple[str, Sequence[int], int, int]]]
                ) -> plt.Figure:
    """The rows of dim 0 each rank holds of each parameter: `per_rank` holds each
    rank's (parameter name, whole shape, first row, row after its last) in the same
    order. Each parameter is one bar, its rows cut into the ranks' pieces; a rank
    with no rows is named beside the bar."""
    names = [(name, tuple(shape)) for name, shape, _, _ in per_rank[0]]

    def build():
        fig, ax = plt.subplots(figsize=(9.5, 0.62 * len(names) + 1.9))
        labelled = set()
        for i, (_, shape) in enumerate(names):
            y, rows = len(names) - 1 - i, shape[0] or 1  # no rows: nothing to cut
            empty = []
            for r, shards in enumerate(per_rank):
                _, _, start, stop = shards[i]
                if stop == start:
                    empty.append(t("dim0_empty", r=r))
                    continue
                ax.barh(y, (stop - start) / rows, left=start / rows, height=0.7,
                        color=PALETTE[r % len(PALETTE)],
                        hatch=HATCHES[r % len(HATCHES)], edgecolor="black",
                        label=None if r in labelled else t("rank_n", r=r))
                labelled.add(r)
                span = (t("dim0_row", a=start) if stop - start == 1 else
                        t("dim0_rows", a=start, b=stop - 1, n=stop - start))
                ax.text((start + stop) / 2 / rows, y, span,
                        ha="center", va="center", fontsize=11,
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})
            if empty:
                ax.text(1.02, y, ", ".join(empty), ha="left", va="center", fontsize=11,
                        color=VERMILLION)
        ax.set_yticks(range(len(names)),
                      [f"{name} {shape}" for name, shape in reversed(names)],
                      family="monospace")
        ax.set_xlim(0, 1.4)
        ax.set_xticks([0, 0.5, 1], ["0", "1/2", "1"])
        ax.set_xlabel(t("dim0_share"))
        ax.set_title(t("dim0_title"))
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles, labels, loc="upper right")
        fig.tight_layout()
        return fig

    return checked_figure(build)


def gradients(per_rank: Sequence[Sequence[tuple[str, bool]]], *,
              title: str = "gradients_title") -> plt.Figure:
    """Which parameters got a gradient on each rank: `per_rank` holds each rank's
    (parameter name, got a gradient) pairs in `model.parameters()` order. Rows are
    the parameters, numbered as DDP's errors number them; a parameter without a
    gradient shows a hatched `None`, and its row is framed where any rank has one."""
    names = [name for name, _ in per_rank[0]]

    def build():
        n = len(per_rank)
        fig, ax = plt.subplots(figsize=(2.6 + 2.4 * n, 0.6 * len(names) + 1.5))
        for i, name in enumerate(names):
            y = len(names) - 1 - i
            ax.text(-0.15, y + 0.35, f"{i}  {name}", ha="right", va="center",
                    fontsize=11, family="monospace")
            for r, pairs in enumerate(per_rank):
                x, got = r * 2.4, dict(pairs)[name]
                if got:
                    ax.add_patch(Rectangle((x, y), 2.2, 0.7, color=PALETTE[4],
                                           alpha=0.35))
                else:
                    ax.add_patch(Rectangle((x, y), 2.2, 0.7, fill=False,
                                           hatch="//", ec="gray"))
                ax.text(x + 1.1, y + 0.35, t("got_grad") if got else "None",
                        ha="center", va="center", fontsize=11,
                        family=None if got else "monospace",
                        bbox=None if got else {"facecolor": "white",
                                               "edgecolor": "none"})
            if not all(dict(pairs)[name] for pairs in per_rank):
                ax.add_patch(Rectangle((-0.1, y - 0.08), 2.4 * n - 0.0, 0.86,
                                       fill=False, ec=VERMILLION, lw=2.5))
        for r in range(n):
            ax.text(r * 2.4 + 1.1, len(names) + 0.1, t("rank_n", r=r), ha="center",
                    fontsize=12)
        ax.set_xlim(-2.4, 2.4 * n)
        ax.set_ylim(-0.3, len(names) + 0.6)
        ax.axis("off")
        ax.set_title(t(title))
        fig.tight_layout()
        return fig

    return checked_figure(build)


def rounds(groups: Mapping[str, Mapping[str, Sequence[float]]], *, ylabel: str,
           title: str, logy: bool = False) -> plt.Figure:
    """Every timed round, not only the median: `groups` maps a setting (a link,
    say) to {series (a method): its rounds}. Each round is a marker, in the
    series' colour and shape, beside the other series of its setting; a black
    bar marks the series' median. `ylabel` and `title` are message keys."""
    import statistics

    from matplotlib.lines import Line2D

    from .plots import MARKERS

    series = list(dict.fromkeys(s for values in groups.values() for s in values))
    width = 0.8 / len(series)

    def build():
        fig, ax = plt.subplots(figsize=(1.2 * len(groups) + 3.2, 4.2))
        for g, values in enumerate(groups.values()):
            for label, ys in values.items():
                j = series.index(label)
                x = g - 0.4 + width * (j + 0.5)
                spread = [x + width * 0.5 * (k / max(1, len(ys) - 1) - 0.5)
                          for k in range(len(ys))]
                ax.plot(spread, list(ys), linestyle="none",
                        marker=MARKERS[j % len(MARKERS)], markersize=5,
                        color=PALETTE[j % len(PALETTE)], alpha=0.8)
                mid = statistics.median(ys)
                ax.plot([x - width * 0.4, x + width * 0.4], [mid, mid], color="black",
                        linewidth=2.5, linestyle="-", marker="none")
        handles = [Line2D([], [], linestyle="none", marker=MARKERS[j % len(MARKERS)],
                          color=PALETTE[j % len(PALETTE)], label=label)
                   for j, label in enumerate(series)]
        handles.append(Line2D([], [], color="black", linewidth=2.5, linestyle="-",
                              label=t("rounds_median")))
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_ylabel(t(ylabel))
        if logy:  # a busy moment's round stays on the chart without flattening it
            from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y")
        ax.set_title(t(title))
        ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        return fig

    return checked_figure(build)
