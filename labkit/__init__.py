"""labkit: the package behind the PyTorch data-parallelism course."""

import re
import sys
import warnings

from . import fonts, i18n
from .i18n import get_lang, t

__all__ = ["CHECKED_TORCH", "TorchVersionWarning", "__version__", "get_lang", "require",
           "set_lang", "t", "torch_note"]

i18n.register({
    "version_too_old": {
        "ja": "labkit {have} が入っていますが、この教材には {need} 以上が必要です。"
        "`make lab` で環境を作り直してください。",
        "en": "labkit {have} is installed but this lesson needs {need} or newer. "
        "Run `make lab` to update the environment.",
    },
    "torch_differs": {
        "ja": "この教材は torch {checked} で確かめてあります。"
        "ここの torch は {have} です。レッスンの数値や torch の振る舞い "
        "(正誤表に書いたことも) が違うことがあります。",
        "en": "This course was checked with torch {checked}; this is torch {have}. "
        "The lessons' figures and torch's behaviour (what the errata says too) may "
        "differ.",
    },
})

__version__ = "0.1.0"
# The torch the course's facts were checked with: the Makefile's pin, and the
# one-click environments' (tests/test_environments.py keeps them equal).
CHECKED_TORCH = "2.13.0"


class TorchVersionWarning(UserWarning):
    """The torch here is not the one the course was checked with."""


def _parse(version: str) -> tuple[int, ...]:
    """(major, minor, micro) of a version: "2.13.0+cpu" and "2.14.0a0+git1" too."""
    return tuple(int(re.match(r"\d*", part).group() or 0)
                 for part in version.split("+")[0].split(".")[:3])


def set_lang(lang: str) -> str:
    """Set the language of plots and messages ("ja" or "en"); returns it.

    matplotlib draws Japanese from the first labkit figure on (plots sets the
    font up), or from now on if matplotlib is already imported.
    """
    i18n.set_lang(lang)
    # Importing matplotlib costs about 0.2 s of CPU, and most processes that set
    # a language draw nothing (every rank torchrun starts runs `python -m labkit`).
    # Where matplotlib is already in use, a figure drawn with it directly or an
    # rc_context entered next must see the font now, as before.
    if "matplotlib" in sys.modules:
        fonts.setup_japanese_font()
    return lang


def torch_note(have: str | None = None) -> str | None:
    """What the lessons say about torch `have` (this one by default): nothing for the
    version the course was checked with (any build of it), else a note that
    figures and behaviour may differ (on Colab, whose torch is its own)."""
    if have is None:
        import torch

        have = torch.__version__
    if _parse(have) == _parse(CHECKED_TORCH):
        return None
    return t("torch_differs", checked=CHECKED_TORCH, have=have)


def require(version: str) -> str:
    """Fail early, in the lesson's language, if labkit is older than `version`;
    warn if torch is not the version the course was checked with."""
    if _parse(__version__) < _parse(version):
        raise RuntimeError(t("version_too_old", have=__version__, need=version))
    note = torch_note()
    if note is not None:
        warnings.warn(note, TorchVersionWarning, stacklevel=2)
    return __version__
