"""A Japanese font for matplotlib, and a check that a figure draws every glyph.

Without a font that has Japanese glyphs, matplotlib draws each Japanese
character as an empty box and only warns once. labkit turns that warning into
MissingGlyphError, so a figure a learner cannot read fails instead.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from . import i18n
from .i18n import t

__all__ = ["MissingGlyphError", "check_glyphs", "checked_glyphs",
           "setup_japanese_font"]

i18n.register({
    "missing_glyphs": {
        "ja": "フォント {fonts} に無い文字があり、四角で表示されます: {chars}",
        "en": "Font(s) {fonts} lack these characters, drawn as empty boxes: {chars}",
    },
})

_font: dict[str, str] = {}


def setup_japanese_font() -> str:
    """Make matplotlib's default sans-serif font one with Japanese glyphs.

    matplotlib-fontja registers IPAexGothic (which also covers Latin text) and
    puts it first in matplotlib's font family. Returns the family name.
    """
    if "family" not in _font:
        import matplotlib
        import matplotlib_fontja

        matplotlib_fontja.japanize()
        # IPAexGothic has U+2212 MINUS SIGN, so the default unicode minus is kept.
        _font["family"] = matplotlib.rcParams["font.family"][0]
    return _font["family"]


_GLYPH_WARNING = re.compile(r"Glyph (\d+) .*missing from font\(s\) (.+)\.")


class MissingGlyphError(RuntimeError):
    """A figure holds characters that its font cannot draw."""


@contextmanager
def checked_glyphs() -> Iterator[None]:
    """Raise MissingGlyphError if text drawn in the block lacks a glyph.

    matplotlib warns about a missing glyph once, when it first lays out the
    text (often in `tight_layout`), so the whole figure is built in the block.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    chars: list[str] = []
    fonts: set[str] = set()
    for w in caught:
        m = _GLYPH_WARNING.search(str(w.message))
        if m:
            chars.append(chr(int(m.group(1))))
            fonts.add(m.group(2))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if chars:
        raise MissingGlyphError(
            t(
                "missing_glyphs",
                fonts=", ".join(sorted(fonts)),
                chars="".join(dict.fromkeys(chars)),
            )
        )


def check_glyphs(fig) -> None:
    """Draw a freshly built `fig`; raise MissingGlyphError if a glyph is missing."""
    with checked_glyphs():
        fig.canvas.draw()
