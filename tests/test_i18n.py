import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pytest

import labkit
from labkit import fonts, i18n, plots
from labkit.fonts import MissingGlyphError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _every_module_imported():
    """Modules register their messages when imported: check them all, not only
    those that earlier tests happened to import."""
    for module in pkgutil.walk_packages(labkit.__path__, "labkit."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)


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


def test_an_unknown_key_is_a_key_error_naming_it_and_the_language():
    labkit.set_lang("ja")
    try:
        with pytest.raises(KeyError, match="no message 'no_such_label' in 'ja'"):
            labkit.t("no_such_label")
    finally:
        labkit.set_lang("en")


@pytest.mark.procs
def test_an_unknown_key_imports_nothing_in_a_core_only_install():
    """Without the `lab` extra (no ipyparallel), a mistyped key is a KeyError, and
    asking for it imports no labkit module (labkit.cluster needs ipyparallel)."""
    code = ("import sys\n"
            "sys.modules['ipyparallel'] = None  # not installed\n"
            "import labkit\n"
            "before = set(sys.modules)\n"
            "try:\n"
            "    labkit.t('allreduce_msx')\n"
            "except KeyError as err:\n"
            "    print('KeyError:', err)\n"
            "print('imported:', sorted(m for m in set(sys.modules) - before\n"
            "                          if m.startswith('labkit')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "KeyError: \"no message 'allreduce_msx' in 'en'" in out.stdout
    assert "imported: []" in out.stdout


def test_i18n_imports_only_the_standard_library():
    """The message registry is labkit's bottom layer: every module imports it, so
    it imports none of them (nor matplotlib, nor anything installed)."""
    tree = ast.parse((ROOT / "labkit" / "i18n.py").read_text(encoding="utf-8"))
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append("." * node.level + (node.module or ""))
    outside = [name for name in imported if name != "__future__"
               and name.split(".")[0] not in sys.stdlib_module_names]
    assert outside == []


def _registered() -> dict[str, str]:
    """{message key: the labkit module that registers it}, read from the source:
    each module registers its messages with a literal dict."""
    found = {}
    for path in sorted((ROOT / "labkit").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and _name(node.func) == "register"
                    and node.args and isinstance(node.args[0], ast.Dict)):
                found |= {k.value: module.removesuffix(".__init__")
                          for k in node.args[0].keys}
    return found


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def _keys_used(tree: ast.AST, known: dict[str, str]) -> set[str]:
    """Message keys `tree` asks for: t("key"), and the keys it hands a plots
    function (its titles and axis labels)."""
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if (_name(node.func) == "t" and node.args
                and isinstance(node.args[0], ast.Constant)):
            used.add(node.args[0].value)
        elif (isinstance(node.func, ast.Attribute)
              and getattr(node.func.value, "id", None) == "plots"):
            args = [*node.args, *(k.value for k in node.keywords)]
            used |= {c.value for a in args for c in ast.walk(a)
                     if isinstance(c, ast.Constant) and c.value in known}
    return used


def _imported(tree: ast.AST, module: str) -> set[str]:
    """The labkit modules `tree` (the source of `module`) imports, anywhere in it."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("labkit")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[:-node.level]
                base = ".".join(package + ([node.module] if node.module else []))
            if base.startswith("labkit"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _closure(modules: set[str], sources: dict[str, ast.AST]) -> set[str]:
    """`modules`, their packages, and every labkit module importing them imports."""
    done, todo = set(), set(modules)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        todo |= {".".join(parts[:i]) for i in range(1, len(parts))} - done
        if name in done or name not in sources:
            continue
        done.add(name)
        todo |= _imported(sources[name], _as_module(name, sources)) - done
    return done


def _as_module(name: str, sources: dict[str, ast.AST]) -> str:
    """`name` as a relative import resolves it: a package's own name counts as one
    level (`from . import x` in labkit/__init__.py is labkit.x)."""
    return name + ".__init__" if _is_package(name) else name


def _is_package(name: str) -> bool:
    return (ROOT / Path(*name.split(".")) / "__init__.py").exists()


def _sources() -> dict[str, ast.AST]:
    sources = {}
    for path in sorted((ROOT / "labkit").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        sources[name.removesuffix(".__init__")] = ast.parse(
            path.read_text(encoding="utf-8"))
    return sources


def test_every_message_is_registered_before_it_is_asked_for():
    """t() finds only what imported modules registered: each labkit module asks
    only for keys of modules it imports, and each lesson cell only for keys of
    modules imported by then, in the kernel or (a %%px cell) on the ranks."""
    known, sources = _registered(), _sources()
    assert set(known) == set(i18n.MESSAGES)  # the reading of the source is whole
    late = []
    for name, tree in sources.items():
        ready = _closure({name}, sources)
        late += [f"{name}: {key}" for key in _keys_used(tree, known)
                 if known.get(key) not in ready]
    for lesson in sorted((ROOT / "course").glob("[0-9][0-9]_*.py")):
        kernel, ranks = set(), _closure({"labkit.cluster.engine"}, sources)
        # a cell starts at a "# %%" line; "# %%px" is the first line of a cell
        for cell in re.split(r"^# %%(?!px).*$", lesson.read_text(encoding="utf-8"),
                             flags=re.MULTILINE)[1:]:
            on_ranks = cell.lstrip().startswith("# %%px")
            # magics and shell lines out; markdown cells are comments only
            code = "\n".join("" if line.lstrip().startswith(("%", "!", "# %%px"))
                             else line for line in cell.splitlines())
            tree = ast.parse(code)
            ready = ranks if on_ranks else kernel
            ready |= _closure(_imported(tree, "__main__"), sources)
            late += [f"{lesson.name}: {key}" for key in _keys_used(tree, known)
                     if known.get(key) not in ready]
    assert late == []


@pytest.mark.procs
def test_set_lang_leaves_matplotlib_alone_and_plots_draw_japanese():
    """A process that only sets a language (every torchrun rank of `python -m
    labkit`) does not import matplotlib; importing labkit.plots makes the Japanese
    font the default, also for a figure drawn with plt directly."""
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


def test_ranks_speak_the_kernels_language(ranks):
    """What labkit prints on a rank (a stall's report, a grader's trial) reads in
    the lesson's language: each rank takes the kernel's when it joins."""
    from labkit import i18n

    assert ranks.run(i18n.get_lang) == ["en", "en"]
    i18n.set_lang("ja")
    try:
        ranks.reset_process_group()  # the ranks join again, as after a repair
        assert ranks.run(i18n.get_lang) == ["ja", "ja"]
    finally:
        i18n.set_lang("en")
        ranks.reset_process_group()
