"""labkit: the package behind the PyTorch data-parallelism course."""

import re
import sys
import warnings

from . import fonts, i18n
from .i18n import get_lang, t

__all__ = ["CHECKED_TORCH", "CHECKED_TORCH_VERSIONS", "TorchVersionWarning",
           "__version__", "get_lang", "require", "set_lang", "t", "torch_note"]

i18n.register({
    "version_too_old": {
        "ja": "labkit {have} が入っていますが、この教材には {need} 以上が必要です。"
        "`python3 tools/course.py lab` (Windows では `py tools\\course.py lab`) "
        "で環境を作り直してください。",
        "en": "labkit {have} is installed but this lesson needs {need} or newer. "
        "Run `python3 tools/course.py lab` (on Windows, `py tools\\course.py lab`) "
        "to update the environment.",
    },
    "torch_differs": {
        "ja": "この教材は torch {checked} で確かめてあります。"
        "ここの torch は {have} です。レッスンの数値や torch の振る舞い "
        "(正誤表に書いたことも) が違うことがあります。",
        "en": "This course was checked with torch {checked}; this is torch {have}. "
        "The lessons' figures and torch's behaviour (what the errata says too) may "
        "differ.",
    },
    # How the message above lists the checked versions: "2.12.0, 2.13.0 and 2.14.1"
    "torch_list_sep": {"ja": "、", "en": ", "},
    "torch_and": {"ja": " と ", "en": " and "},
})

__version__ = "0.1.0"
# The torch versions the course's facts were checked with: the unit tests and
# every lesson of both languages ran under each. The first is the pin: the
# Makefile's and the one-click environments' (tests/test_environments.py keeps
# them equal). 2.14.1 ran as the CUDA 13.0 build PyPI installs on Linux, on a
# machine without a GPU; where a lesson's fact differs between versions, the
# lesson says which shows what.
CHECKED_TORCH_VERSIONS = ("2.13.0", "2.14.1")
CHECKED_TORCH = CHECKED_TORCH_VERSIONS[0]


class TorchVersionWarning(UserWarning):
    """The torch here is none of those the course was checked with."""


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
    """What the lessons say about torch `have` (this one by default): nothing for a
    version the course was checked with (any build of it), else a note naming
    them, that figures and behaviour may differ (on Colab, whose torch is its own)."""
    if have is None:
        import torch

        have = torch.__version__
    if _parse(have) in {_parse(checked) for checked in CHECKED_TORCH_VERSIONS}:
        return None
    *others, last = CHECKED_TORCH_VERSIONS
    checked = t("torch_and").join(
        [t("torch_list_sep").join(others), last] if others else [last])
    return t("torch_differs", checked=checked, have=have)


def require(version: str) -> str:
    """Fail early, in the lesson's language, if labkit is older than `version`;
    warn if torch is none of the versions the course was checked with."""
    if _parse(__version__) < _parse(version):
        raise RuntimeError(t("version_too_old", have=__version__, need=version))
    note = torch_note()
    if note is not None:
        warnings.warn(note, TorchVersionWarning, stacklevel=2)
    return __version__
