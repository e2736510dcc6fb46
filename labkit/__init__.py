"""labkit: the package behind the PyTorch data-parallelism course."""

from .i18n import get_lang, set_lang, t

__all__ = ["__version__", "get_lang", "require", "set_lang", "t"]

__version__ = "0.1.0"


def _parse(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3])


def require(version: str) -> str:
    """Fail early, in the lesson's language, if labkit is older than `version`."""
    if _parse(__version__) < _parse(version):
        raise RuntimeError(t("version_too_old", have=__version__, need=version))
    return __version__
