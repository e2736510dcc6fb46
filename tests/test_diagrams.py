"""labkit.ring's all-reduce on real ranks, and labkit.diagrams on fixed data: what
each picture draws, its labels in both languages, and colours that stay apart."""

from __future__ import annotations

import json

import matplotlib
import matplotlib.pyplot as plt
import pytest
from conftest import rank_scripts
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from test_plots import APART, closest_pair

import labkit
from labkit import diagrams, plots, ring
from labkit.fonts import MissingGlyphError

_RING = """
import json, sys
import torch.distributed as dist
from labkit import ring
from labkit.cluster import rendezvous
rank, port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rendezvous.init_rank(rank, n, "gloo", port, "ring", timeout_s=60)
print("RECORD " + json.dumps(ring.all_reduce(n_values=int(sys.argv[4]))))
dist.destroy_process_group()
"""


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_the_ring_equals_dist_all_reduce_and_records_what_it_sent():
    n = 4
    done = rank_scripts(_RING, str(n), "10", world_size=n, timeout_s=150)
    assert [p.returncode for p in done] == [0] * n, [p.stdout[-800:] for p in done]
    records = [json.loads(p.stdout.split("RECORD ", 1)[1]) for p in done]
    for r, rec in enumerate(records):
        assert rec["after"] == pytest.approx(rec["expected"], abs=1e-5)
        # start: every chunk holds the rank's own part; end: all n ranks'
        assert rec["counts"][0] == [1] * n and rec["counts"][-1] == [n] * n
        # after the reduce-scatter, rank r alone has chunk r + 1 whole
        assert rec["counts"][n - 1][(r + 1) % n] == n
        assert sum(c == n for c in rec["counts"][n - 1]) == 1
        assert len(rec["sent"]) == 2 * (n - 1)
    # 10 values in 4 chunks (3, 3, 2, 2): each rank sends 2(n - 1) chunks, about
    # 2(n - 1)/n of the tensor, and together they send exactly that
    total = sum(rec["sent_bytes"] for rec in records)
    assert total == 2 * (n - 1) * records[0]["tensor_bytes"]


def test_the_chunk_sent_follows_the_ring():
    n = 4
    for step in range(2 * (n - 1)):
        # each step the ranks send n different chunks, and what rank r sends at a
        # reduce-scatter step is what it received (and added to) at the one before
        assert sorted(ring.chunk_sent(r, step, n) for r in range(n)) == list(range(n))
        if 0 < step < n - 1:
            for r in range(n):
                assert ring.chunk_sent(r, step, n) == ring.chunk_sent(
                    (r - 1) % n, step - 1, n)
    # the all-gather starts with the chunk each rank finished
    assert [ring.chunk_sent(r, n - 1, n) for r in range(n)] == [1, 2, 3, 0]


def _records(n=3):
    """What ring.all_reduce returns on n ranks, made by following chunk_sent."""
    out = []
    for r in range(n):
        counts, holds = [[1] * n], [1] * n
        for step in range(2 * (n - 1)):
            into = ring.chunk_sent((r - 1) % n, step, n)
            holds[into] = holds[into] + 1 if step < n - 1 else n
            counts.append(list(holds))
        out.append({"counts": counts,
                    "sent": [ring.chunk_sent(r, s, n) for s in range(2 * (n - 1))]})
    return out


def _texts(fig):
    return [t.get_text() for t in fig.findobj(Text) if t.get_visible()
            and t.get_text().strip()]


def _small(fig):
    return [(t.get_text(), t.get_fontsize()) for t in fig.findobj(Text)
            if t.get_visible() and t.get_text().strip()
            and t.get_fontsize() < plots.MIN_FONT_PT]


def _figures():
    return {
        "ring": diagrams.ring(_records()),
        "collectives": diagrams.collectives({
            "before": [[1.0, 2.0], [3.0, 4.0]],
            "dist.all_reduce(x)": [[4.0, 6.0], [4.0, 6.0]],
            "dist.reduce_scatter_tensor(y, x)": [[4.0], [6.0]]}),
        "sequences": diagrams.sequences([[(1, "gloo:all_gather"),
                                          (2, "gloo:all_reduce")],
                                         [(1, "gloo:all_gather")]]),
        "micro_batches": diagrams.micro_batches({"DDP": [3, 3, 3, 3],
                                                 "no_sync": [0, 0, 0, 3]}),
        "zero_memory": diagrams.zero_memory(
            {"DDP": {"parameters": 4, "gradients": 4, "optimizer": 8},
             "ZeRO-1": {"parameters": 4, "gradients": 4, "optimizer": 4}},
            ylabel="step_time_ms", formula={"DDP": 16, "ZeRO-1": 12}),
    }


def test_the_ring_draws_each_step_s_counts_and_frames_the_chunk_sent():
    fig = diagrams.ring(_records(3))
    texts = [t.get_text() for t in fig.axes[0].texts]
    # 3 ranks x 5 rows x 3 chunks of counts, and 4 rows with a frame per rank
    assert sum(t in {"1", "2", "3"} for t in texts) == 3 * 5 * 3
    frames = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)
              and not p.get_fill()]
    assert len(frames) == 3 * 4
    assert {"reduce-scatter 2", "all-gather 2"} <= set(texts)
    plt.close(fig)


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_every_diagram_labels_in_the_lesson_s_language_at_a_readable_size(lang):
    labkit.set_lang(lang)
    try:
        figures = _figures()
        for name, fig in figures.items():
            assert _small(fig) == [], name
        assert labkit.t("rank_n", r=1) in _texts(figures["collectives"])
        assert ("ランク 1" in _texts(figures["ring"])) == (lang == "ja")
        legend = [t.get_text() for t in figures["zero_memory"].axes[0]
                  .get_legend().get_texts()]
        assert (labkit.t("held_optimizer") in legend
                and ("オプティマイザ" in legend[-1]) == (lang == "ja"))
    finally:
        plt.close("all")
        labkit.set_lang("en")


def test_the_micro_batches_and_the_memory_draw_their_numbers():
    figures = _figures()
    labels = [t for t in _texts(figures["micro_batches"]) if t.isdigit()]
    assert labels == ["3", "3", "3", "3", "0", "0", "0", "3"]
    bars = [p for p in figures["zero_memory"].axes[0].patches
            if isinstance(p, Rectangle)]
    # stacked: each stage's three parts end at its total
    tops = sorted({round(b.get_y() + b.get_height(), 6) for b in bars})
    assert tops[-2:] == [12.0, 16.0]
    hatches = {b.get_hatch() or "" for b in bars}
    assert len(hatches) == 3  # the parts are told apart without their colour
    plt.close("all")


def test_the_sequences_frame_where_the_ranks_part():
    fig = diagrams.sequences([[(4, "gloo:broadcast"), (5, "gloo:all_reduce"),
                               (6, "gloo:all_reduce")],
                              [(4, "gloo:broadcast"), (5, "gloo:all_gather")]])
    ax = fig.axes[0]
    frames = [p for p in ax.patches if p.get_edgecolor()[:3] == matplotlib.colors
              .to_rgb(plots.VERMILLION)]
    assert len(frames) == 1
    # rows top to bottom are #4, #5, #6: the frame is on #5 (another name), not #6
    rows = {t.get_text(): t.get_position()[1] for t in ax.texts if t.get_text()
            .startswith("#")}
    assert frames[0].get_y() < rows["#5"] < frames[0].get_y() + frames[0].get_height()
    gaps = [t for t in ax.texts if t.get_text() == labkit.t("not_entered")]
    assert len(gaps) == 1  # rank 1 never entered #6
    plt.close(fig)


def test_the_parts_colours_stay_apart_for_colour_blind_readers():
    assert all(d >= APART for d, *_ in closest_pair(plots.PALETTE[:3]).values())


def test_a_missing_glyph_is_still_refused():
    labkit.set_lang("ja")
    try:
        with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
            with pytest.raises(MissingGlyphError):
                diagrams.micro_batches({"DDP": [1, 1]})
    finally:
        plt.close("all")
        labkit.set_lang("en")


def test_a_ring_too_short_for_its_ranks_is_refused_by_name():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="n_values=0: a ring of 1 ranks needs"):
            ring.all_reduce(n_values=0)
        alone = ring.all_reduce(n_values=3)  # one rank: nothing to send
        assert alone["after"] == alone["before"] and alone["sent_bytes"] == 0
    finally:
        dist.destroy_process_group()


# One ZeRO-3 step of 2 layers: each gathered (10 and 30 bytes), then freed; the
# backward gathers layer 2 first.
GATHERED = [("gather", 0, 10), ("free", 0, 0), ("gather", 1, 30), ("free", 1, 0),
            ("gather", 1, 30), ("free", 1, 0), ("gather", 0, 10), ("free", 0, 0)]


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_gathered_draws_each_event_and_shades_the_backward(lang):
    labkit.set_lang(lang)
    try:
        fig = diagrams.gathered(GATHERED, whole=40)
        ax = fig.axes[0]
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert ticks[:2] == [labkit.t("gathered_gather", i=1),
                             labkit.t("gathered_free", i=1)]
        assert ("集める\n層 2" in ticks) == (lang == "ja")
        texts = [t.get_text() for t in ax.texts]
        assert texts.count("30") == 2 and texts.count("10") == 2  # each gather's bytes
        assert labkit.t("gathered_backward") in texts
        assert any(labkit.t("gathered_whole") in t and "40" in t for t in texts)
        # the backward starts at the first layer gathered again: event 4 of 8
        shaded = [p for p in ax.patches if p.get_alpha() == 0.12]
        assert [round(p.get_x(), 6) for p in shaded] == [4.0]
        assert _small(fig) == []
    finally:
        plt.close("all")
        labkit.set_lang("en")


# Two ranks: 5 rows (3 and 2), and 1 row (rank 1 empty).
SHARDS = [[("w", (5, 2), 0, 3), ("b", (1,), 0, 1)],
          [("w", (5, 2), 3, 5), ("b", (1,), 1, 1)]]


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_dim0_shards_cut_each_bar_by_rank_and_name_an_empty_shard(lang):
    labkit.set_lang(lang)
    try:
        fig = diagrams.dim0_shards(SHARDS)
        ax = fig.axes[0]
        bars = [p for p in ax.patches if isinstance(p, Rectangle)]
        # w: two pieces, 3/5 and 2/5 of its rows; b: rank 0's piece only
        assert sorted(round(b.get_width(), 6) for b in bars) == [0.4, 0.6, 1.0]
        assert len({b.get_hatch() or "" for b in bars}) == 2  # ranks told apart in grey
        texts = _texts(fig)
        assert labkit.t("dim0_rows", a=3, b=4, n=2) in texts
        assert labkit.t("dim0_empty", r=1) in texts
        assert ("ランク 1" in texts) == (lang == "ja")
        assert [t.get_text() for t in ax.get_yticklabels()] == ["b (1,)", "w (5, 2)"]
        assert _small(fig) == []
    finally:
        plt.close("all")
        labkit.set_lang("en")


def test_the_gathered_and_shard_diagrams_refuse_a_missing_glyph():
    labkit.set_lang("ja")
    try:
        with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
            with pytest.raises(MissingGlyphError):
                diagrams.gathered(GATHERED)
            with pytest.raises(MissingGlyphError):
                diagrams.dim0_shards(SHARDS)
    finally:
        plt.close("all")
        labkit.set_lang("en")


_GOT_GRAD = [[("body.weight", True), ("aux.weight", False)],
             [("body.weight", True), ("aux.weight", False)]]
_ROUNDS = {"loopback": {"DDP": [30.0, 20.0, 40.0], "fp16": [25.0, 35.0, 30.0]},
           "100 MB/s": {"DDP": [100.0, 110.0, 105.0], "fp16": [60.0, 62.0, 64.0]}}


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_the_gradients_and_the_rounds_label_in_the_lesson_s_language(lang):
    labkit.set_lang(lang)
    try:
        grads = diagrams.gradients(_GOT_GRAD)
        rounds = diagrams.rounds(_ROUNDS, ylabel="step_time_ms", title="round")
        assert _small(grads) == [] and _small(rounds) == []
        assert labkit.t("got_grad") in _texts(grads)
        assert ("勾配あり" in _texts(grads)) == (lang == "ja")
        legend = [t.get_text() for t in rounds.axes[0].get_legend().get_texts()]
        assert legend == ["DDP", "fp16", labkit.t("rounds_median")]
        assert ("中央値" in legend) == (lang == "ja")
    finally:
        plt.close("all")
        labkit.set_lang("en")


def test_the_gradients_frame_the_parameters_without_one():
    fig = diagrams.gradients(_GOT_GRAD)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts if t.get_text() == "None"] == ["None"] * 2
    frames = [p for p in ax.patches if p.get_edgecolor()[:3] == matplotlib.colors
              .to_rgb(plots.VERMILLION)]
    assert len(frames) == 1  # aux.weight's row, the second: the lower one
    rows = {t.get_text(): t.get_position()[1] for t in ax.texts
            if t.get_text().endswith("weight")}
    assert frames[0].get_y() < rows["1  aux.weight"] < rows["0  body.weight"]
    assert "0  body.weight" in rows  # numbered as in model.parameters()
    plt.close(fig)


def test_the_rounds_draw_every_round_and_the_median():
    ax = diagrams.rounds(_ROUNDS, ylabel="step_time_ms", title="round").axes[0]
    marks = [line for line in ax.lines if line.get_marker() not in ("None", "none")]
    assert sorted(y for line in marks for y in line.get_ydata()) == sorted(
        y for values in _ROUNDS.values() for ys in values.values() for y in ys)
    assert len({line.get_marker() for line in marks}) == 2  # a shape per method
    bars = [line for line in ax.lines if line not in marks]
    assert sorted(line.get_ydata()[0] for line in bars) == [30.0, 30.0, 62.0, 105.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(_ROUNDS)
    logged = diagrams.rounds(_ROUNDS, ylabel="step_time_ms", title="round",
                             logy=True).axes[0]
    assert logged.get_yscale() == "log" and ax.get_ylim()[0] == 0
    # plain numbers on the log axis (20, 30, 50, 100), not powers of ten
    labels = {t.get_text() for t in logged.get_yticklabels()} - {""}
    assert {"20", "30", "50", "100"} <= labels
    plt.close("all")


def test_the_rounds_refuse_a_missing_glyph():
    labkit.set_lang("ja")
    try:
        with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
            with pytest.raises(MissingGlyphError):
                diagrams.rounds(_ROUNDS, ylabel="step_time_ms", title="round")
    finally:
        plt.close("all")
        labkit.set_lang("en")


def _draws_or_fails(lesson, lang, marker, key, good, *wrong):
    """Run the lesson's figure cell (found by `marker`) on each rank's `key` faked:
    it draws on `good`, and its assert fails on each of `wrong`."""
    from types import SimpleNamespace

    from lesson_cells import finder

    cell = finder(lesson, lang)(marker)
    labkit.set_lang(lang)
    try:
        for pulled, ok in ((good, True), *((w, False) for w in wrong)):
            ns = {"diagrams": diagrams,
                  "ranks": SimpleNamespace(pull={key: pulled}.__getitem__)}
            if ok:
                exec(cell, ns)
                assert ns["fig"].axes
            else:
                with pytest.raises(AssertionError):
                    exec(cell, ns)
            plt.close("all")
    finally:
        plt.close("all")
        labkit.set_lang("en")


@pytest.mark.parametrize("lesson", ["09_ecosystem", "13_fsdp2"])
@pytest.mark.parametrize("lang", ["en", "ja"])
def test_the_shard_rows_cell_draws_dim0_split_once_or_fails(lesson, lang):
    """Lessons 09 and 13's figure of each rank's rows of dim 0, on fixed shards: it
    draws them when the ranks' rows follow each other and cover dim 0 once, and its
    assert fails when two ranks hold the same rows or a row is held by none."""
    good = [[("w", (5, 3), 0, 3), ("b", (5,), 0, 3)],
            [("w", (5, 3), 3, 5), ("b", (5,), 3, 5)]]
    overlap = [good[0], [("w", (5, 3), 2, 5), ("b", (5,), 3, 5)]]
    short = [good[0], [("w", (5, 3), 3, 4), ("b", (5,), 3, 5)]]
    _draws_or_fails(lesson, lang, 'shards = ranks.pull("shard_rows")', "shard_rows",
                    good, overlap, short)


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_the_batchnorm_statistics_cell_draws_per_rank_means_or_fails(lang):
    """Lesson 08's figure of each rank's BatchNorm statistics against the whole
    batch's, on fixed values: drawn when each rank's mean is far from the whole
    batch's, which both ranks share; its assert fails when the ranks' batches have
    the same mean as the whole (no shift) or the whole batch differs by rank."""
    def stats(means, whole):
        return [[("x.mean(0)", m), ("x.var(0, unbiased=False)", [1.0] * 2),
                 ("whole.mean(0)", w), ("whole.var(0, unbiased=False)", [3.0] * 2)]
                for m, w in zip(means, whole, strict=True)]

    good = stats([[0.0, 0.1], [3.0, 2.9]], [[1.5, 1.5]] * 2)
    no_shift = stats([[1.4, 1.5], [1.6, 1.5]], [[1.5, 1.5]] * 2)
    not_shared = stats([[0.0, 0.1], [3.0, 2.9]], [[1.5, 1.5], [1.4, 1.5]])
    _draws_or_fails("08_training_settings", lang, 'per_rank = ranks.pull("stats")',
                    "stats", good, no_shift, not_shared)
