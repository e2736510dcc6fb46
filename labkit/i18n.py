"""The language of learner-facing text: every message in Japanese and English.

Each module registers the messages it prints or draws, beside the code that
uses them, when it is imported; `t(key)` gives one in the current language. This
module is the bottom of labkit: it imports nothing of it (nor anything beyond the
standard library), so every module can register here. `labkit.set_lang` also sets
matplotlib's font up (labkit.fonts).
"""

from __future__ import annotations

__all__ = ["LANGS", "get_lang", "register", "set_lang", "t"]

LANGS = ("ja", "en")

# One entry per message: key -> {lang: text}. Texts may hold str.format fields.
MESSAGES: dict[str, dict[str, str]] = {}

_state = {"lang": "en"}


def get_lang() -> str:
    """The current language code."""
    return _state["lang"]


def set_lang(lang: str) -> str:
    """Set the language of messages ("ja" or "en"); returns it."""
    if lang not in LANGS:
        raise ValueError(
            f"unknown language {lang!r}: choose one of {', '.join(LANGS)}"
        )
    _state["lang"] = lang
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
    """The message `key` in the current language, formatted with `fields`.

    A module registers its messages when it is imported: a key no imported module
    registered is a KeyError (a typo, or a cell run before the one that imports
    the module using it).
    """
    lang = _state["lang"]
    try:
        entry = MESSAGES[key]
    except KeyError:
        raise KeyError(f"no message {key!r} in {lang!r}: no labkit module imported "
                       "so far registers it") from None
    return entry[lang].format(**fields)
