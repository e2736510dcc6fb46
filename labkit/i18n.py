"""Language of learner-facing text, and a Japanese font for matplotlib."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "LANGS",
    "MissingGlyphError",
    "check_glyphs",
    "checked_glyphs",
    "get_lang",
    "register",
    "set_lang",
    "setup_japanese_font",
    "t",
]

LANGS = ("ja", "en")

# One entry per message: key -> {lang: text}. Texts may hold str.format fields.
MESSAGES: dict[str, dict[str, str]] = {
    # plots
    "step": {"ja": "ステップ", "en": "step"},
    "epoch": {"ja": "エポック", "en": "epoch"},
    "loss": {"ja": "損失 (MSE)", "en": "loss (MSE)"},
    "loss_curve_title": {"ja": "学習曲線", "en": "Training loss"},
    "optimizer_step": {"ja": "オプティマイザのステップ", "en": "optimizer step"},
    "seconds": {"ja": "経過時間 [秒]", "en": "elapsed time [s]"},
    "loss_vs_steps": {"ja": "ステップ数に対する損失", "en": "Loss vs optimizer steps"},
    "loss_vs_time": {"ja": "経過時間に対する損失", "en": "Loss vs wall-clock time"},
    "step_time_s": {"ja": "1 ステップの時間 [秒]", "en": "time per step [s]"},
    "step_time_ms": {"ja": "1 ステップの時間 [ミリ秒]", "en": "time per step [ms]"},
    "step_time_vs_world": {
        "ja": "world size ごとの 1 ステップの時間 (全体バッチ 1024)",
        "en": "Step time by world size (global batch 1024)",
    },
    "accum_k": {"ja": "K (1 ステップのマイクロバッチ数)",
                "en": "K (micro-batches per step)"},
    "step_time_vs_k": {
        "ja": "K ごとの 1 回の更新の時間 (2 ランク)",
        "en": "Time per update by K (2 ranks)",
    },
    "param_diff": {"ja": "ランク間のパラメータの最大差",
                   "en": "max parameter difference between ranks"},
    "misuse_then_sync": {
        "ja": "1〜15: no_sync の中で step、16〜30: 正しく同期",
        "en": "1-15: step inside no_sync, 16-30: synchronized",
    },
    "message_bytes": {"ja": "メッセージの大きさ [バイト]",
                      "en": "message size [bytes]"},
    "allreduce_ms": {"ja": "all-reduce 1 回の時間 [ミリ秒]",
                     "en": "one all-reduce [ms]"},
    "measured": {"ja": "実測", "en": "measured"},
    "no_torch_xla": {
        "ja": "torch_xla はインストールされていません。"
              "PyTorch で TPU を使うには torch_xla が必要です",
        "en": "torch_xla is not installed; PyTorch needs it to use a TPU",
    },
    "alpha_beta_model": {"ja": "α–β モデル", "en": "alpha-beta model"},
    "allreduce_title": {
        "ja": "all-reduce の時間: 実測と α–β モデル (2 ランク)",
        "en": "All-reduce time: measured and the alpha-beta model (2 ranks)",
    },
    "grad_compute": {"ja": "勾配の計算", "en": "gradient computation"},
    "comm_hidden": {"ja": "隠れた通信 (計算と重なる)",
                    "en": "hidden (overlaps the computation)"},
    "comm_exposed": {"ja": "表に出た通信 (計算のあと)",
                     "en": "exposed (after the computation)"},
    "backward_returns": {"ja": "backward() が戻る", "en": "backward() returns"},
    "bucket_n": {"ja": "バケット {i}", "en": "bucket {i}"},
    "overlap_title": {
        "ja": "勾配の計算とバケットの all-reduce",
        "en": "Gradient computation and the buckets' all-reduces",
    },
    "overlap_steps_title": {
        "ja": "ステップごとの通信: 隠れた分と表に出た分",
        "en": "Communication per step: hidden and exposed",
    },
    "model_vs_measured": {
        "ja": "1 回の更新の時間: 実測 (点) とモデル (破線、K = 1, 2, 4 から)",
        "en": "Time per update: measured (dots), model (dashed, fitted on K = 1, 2, 4)",
    },
    "world_size_n": {"ja": "ランク数 (GPU 数)", "en": "ranks (GPUs)"},
    "speedup": {"ja": "1 ランクと比べた速度向上 (倍)", "en": "speed-up over one rank"},
    "explorer_title": {
        "ja": "モデルによる予測 (測定ではありません)",
        "en": "Predicted by the model (not a measurement)",
    },
    "divergence_title": {
        "ja": "no_sync の中で step するとレプリカがずれる",
        "en": "Stepping inside no_sync: replicas drift apart",
    },
    "target_variance": {
        "ja": "目標の分散 (MyDataset で届く最小値)",
        "en": "variance of the targets (the best MyDataset allows)",
    },
    "font_check_title": {
        "ja": "日本語フォントの確認: 勾配の同期とランク",
        "en": "Font check: gradient synchronization and ranks",
    },
    # checks
    "raised_as_expected": {
        "ja": "想定どおりの例外: {name}: {msg}",
        "en": "Raised as expected: {name}: {msg}",
    },
    "did_not_raise": {
        "ja": "{name} が発生するはずでしたが、何も起きませんでした",
        "en": "Expected {name}, but nothing was raised",
    },
    "wrong_message": {
        "ja": "{name} は発生しましたが、メッセージに {pattern!r} がありません: {msg}",
        "en": "{name} was raised, but its message lacks {pattern!r}: {msg}",
    },
    "missing_glyphs": {
        "ja": "フォント {fonts} に無い文字があり、四角で表示されます: {chars}",
        "en": "Font(s) {fonts} lack these characters, drawn as empty boxes: {chars}",
    },
    "version_too_old": {
        "ja": "labkit {have} が入っていますが、この教材には {need} 以上が必要です。"
        "`make lab` で環境を作り直してください。",
        "en": "labkit {have} is installed but this lesson needs {need} or newer. "
        "Run `make lab` to update the environment.",
    },
}

_state = {"lang": "en", "font": None}


def get_lang() -> str:
    """The current language code."""
    return _state["lang"]


def set_lang(lang: str) -> str:
    """Set the language of plots and messages ("ja" or "en"); returns it.

    Also makes matplotlib draw Japanese, so that either language renders.
    """
    if lang not in LANGS:
        raise ValueError(
            f"unknown language {lang!r}: choose one of {', '.join(LANGS)}"
        )
    _state["lang"] = lang
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
    try:
        entry = MESSAGES[key]
    except KeyError:
        raise KeyError(f"no message {key!r} in labkit.i18n.MESSAGES") from None
    return entry[_state["lang"]].format(**fields)


def setup_japanese_font() -> str:
    """Make matplotlib's default sans-serif font one with Japanese glyphs.

    matplotlib-fontja registers IPAexGothic (which also covers Latin text) and
    puts it first in matplotlib's font family. Returns the family name.
    """
    if _state["font"] is None:
        import matplotlib
        import matplotlib_fontja

        matplotlib_fontja.japanize()
        # IPAexGothic has U+2212 MINUS SIGN, so the default unicode minus is kept.
        _state["font"] = matplotlib.rcParams["font.family"][0]
    return _state["font"]


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
