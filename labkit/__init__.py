"""labkit: the package behind the PyTorch data-parallelism course."""

from . import i18n
from .i18n import get_lang, set_lang, t

__all__ = ["__version__", "get_lang", "require", "set_lang", "t"]

i18n.register({
    "version_too_old": {
        "ja": "labkit {have} が入っていますが、この教材には {need} 以上が必要です。"
        "`make lab` で環境を作り直してください。",
        "en": "labkit {have} is installed but this lesson needs {need} or newer. "
        "Run `make lab` to update the environment.",
    },
})

__version__ = "0.1.0"


def _parse(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3])


def require(version: str) -> str:
    """Fail early, in the lesson's language, if labkit is older than `version`."""
    if _parse(__version__) < _parse(version):
        raise RuntimeError(t("version_too_old", have=__version__, need=version))
    return __version__
