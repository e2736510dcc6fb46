import matplotlib
import matplotlib.pyplot as plt
import pytest

import labkit
from labkit import fonts, i18n, plots
from labkit.fonts import MissingGlyphError


@pytest.fixture(scope="module", autouse=True)
def _every_module_imported():
    """Modules register their messages when imported: check them all, not only
    those that earlier tests happened to import."""
    i18n.import_all()


def test_set_lang_switches_messages():
    assert labkit.set_lang("ja") == "ja"
    assert labkit.t("epoch") == "エポック"
    labkit.set_lang("en")
    assert labkit.t("epoch") == "epoch"


def test_unknown_language_is_named():
    with pytest.raises(ValueError, match="unknown language 'fr'"):
        labkit.set_lang("fr")
    assert labkit.get_lang() == "en"  # unchanged by the bad call


def test_every_message_has_every_language():
    for key, entry in i18n.MESSAGES.items():
        assert set(entry) == set(i18n.LANGS), key
        assert all(entry.values()), key


def test_register_refuses_a_missing_language():
    with pytest.raises(ValueError, match="lacks en"):
        i18n.register({"only_ja": {"ja": "日本語だけ"}})


def test_japanese_figure_has_every_glyph():
    """A Japanese-labelled figure must draw every character (no empty boxes)."""
    labkit.set_lang("ja")
    fig = plots.loss_curves({"ランク 0": [1.0, 0.5], "ランク 1": [1.1, 0.4]},
                            references={"下限": 0.3})
    assert fig.axes[0].get_title() == "学習曲線"
    plots.font_check()


def test_every_message_renders_in_the_course_font():
    """All learner-facing texts, in both languages, have glyphs in the font."""
    def build():
        fig, ax = plt.subplots()
        for y, entry in enumerate(i18n.MESSAGES.values()):
            for lang in i18n.LANGS:
                ax.text(0, y, entry[lang])
        return fig

    plots.checked_figure(build)


def test_missing_glyphs_are_reported_and_the_figure_closed():
    """Without a Japanese font the check fails, naming the characters."""
    labkit.set_lang("ja")
    before = plt.get_fignums()
    with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
        with pytest.raises(MissingGlyphError, match="DejaVu Sans") as err:
            plots.font_check()
    assert "勾" in str(err.value)
    assert plt.get_fignums() == before


def test_other_warnings_pass_through():
    with pytest.warns(UserWarning, match="unrelated"):
        with fonts.checked_glyphs():
            import warnings

            warnings.warn("unrelated", UserWarning, stacklevel=1)


@pytest.mark.procs
def test_a_message_of_a_module_not_imported_yet_is_found():
    """A cell run out of order asks for a label before its module is imported."""
    import subprocess
    import sys

    code = ("import sys, labkit\n"
            "assert 'labkit.comm' not in sys.modules\n"
            "labkit.set_lang('ja')\n"
            "print(labkit.t('allreduce_ms'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "all-reduce 1 回の時間 [ミリ秒]"
    with pytest.raises(KeyError, match="no message 'no_such_label' in any labkit"):
        labkit.t("no_such_label")


@pytest.mark.procs
def test_set_lang_leaves_matplotlib_alone_and_plots_draw_japanese():
    """A process that only sets a language (every torchrun rank of `python -m
    labkit`) does not import matplotlib; importing labkit.plots makes the Japanese
    font the default, also for a figure drawn with plt directly."""
    import subprocess
    import sys

    code = ("import sys, warnings, labkit\n"
            "labkit.set_lang('ja')\n"
            "print('after set_lang:', 'matplotlib' in sys.modules)\n"
            "import matplotlib\n"
            "matplotlib.use('Agg')\n"
            "from labkit import plots\n"
            "import matplotlib.pyplot as plt\n"
            "print('family:', matplotlib.rcParams['font.family'][0])\n"
            "fig, ax = plt.subplots()\n"
            "ax.set_title('勾配の同期')\n"
            "with warnings.catch_warnings():\n"
            "    warnings.simplefilter('error')\n"
            "    fig.canvas.draw()  # a missing glyph warns: an error here\n"
            "print('drawn')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "after set_lang: False" in out.stdout
    assert "family: IPAexGothic" in out.stdout and "drawn" in out.stdout
