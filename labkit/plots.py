"""Plots with labels in the lesson's language, checked for missing glyphs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt

from .i18n import MissingGlyphError, checked_glyphs, setup_japanese_font, t

__all__ = ["checked_figure", "font_check", "loss_curves"]


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


def loss_curves(curves: Mapping[str, Sequence[float]], *, xlabel: str = "step",
                title: str = "loss_curve_title", logy: bool = False,
                references: Mapping[str, float] | None = None):
    """Plot one loss curve per label; `xlabel` and `title` are message keys.

    `references` draws labelled dashed horizontal lines (e.g. a loss floor).
    """

    def build():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, ys in curves.items():
            ax.plot(range(1, len(ys) + 1), ys, label=label, marker=".")
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
