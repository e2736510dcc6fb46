"""The language of learner-facing text: every message in Japanese and English.

Each module registers the messages it prints or draws, beside the code that
uses them; `t(key)` gives one in the current language. labkit.fonts makes
matplotlib draw Japanese.
"""

from __future__ import annotations

import sys

__all__ = ["LANGS", "get_lang", "import_all", "register", "set_lang", "t"]

LANGS = ("ja", "en")

# One entry per message: key -> {lang: text}. Texts may hold str.format fields.
MESSAGES: dict[str, dict[str, str]] = {}

_state = {"lang": "en"}


def get_lang() -> str:
    """The current language code."""
    return _state["lang"]


def set_lang(lang: str) -> str:
    """Set the language of plots and messages ("ja" or "en"); returns it.

    matplotlib draws Japanese from the first labkit figure on (plots sets the
    font up), or from now on if matplotlib is already imported.
    """
    if lang not in LANGS:
        raise ValueError(
            f"unknown language {lang!r}: choose one of {', '.join(LANGS)}"
        )
    _state["lang"] = lang
    # Importing matplotlib costs about 0.2 s of CPU, and most processes that set
    # a language draw nothing (every rank torchrun starts runs `python -m labkit`).
    # Where matplotlib is already in use, a figure drawn with it directly or an
    # rc_context entered next must see the font now, as before.
    if "matplotlib" in sys.modules:
        from .fonts import setup_japanese_font  # fonts imports this module

        setup_japanese_font()
    return lang


def register(messages: dict[str, dict[str, str]]) -> None:
    """Add a module's messages; each needs a text for every language."""
    for key, entry in messages.items():
        missing = [lang for lang in LANGS if lang not in entry]
        if missing:
            raise ValueError(f"message {key!r} lacks {', '.join(missing)}")
        if key in MESSAGES and MESSAGES[key] != entry:
            raise ValueError(f"message {key!r} is already registered differently")
        MESSAGES[key] = entry


def t(key: str, **fields: object) -> str:
    """The message `key` in the current language, formatted with `fields`."""
    if key not in MESSAGES:
        # Registered by a module not imported yet (a cell run out of order).
        import_all()
    try:
        entry = MESSAGES[key]
    except KeyError:
        raise KeyError(f"no message {key!r} in any labkit module") from None
    return entry[_state["lang"]].format(**fields)


def import_all() -> None:
    """Import every labkit module, so that every message is registered."""
    import importlib
    import pkgutil

    import labkit

    for module in pkgutil.walk_packages(labkit.__path__, "labkit."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
