import subprocess
import sys
from pathlib import Path

import build_notebooks as bn
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent

HEADER = "# ---\n# jupyter:\n#   jupytext:\n#     formats: py:percent\n# ---\n\n"


def lesson(tmp_path, body):
    course = tmp_path / "course"
    course.mkdir(exist_ok=True)
    (course / "00_demo.py").write_text(HEADER + body, encoding="utf-8")
    return course


GOOD = '''# %% [markdown] lang="ja"
# # こんにちは

# %% [markdown] lang="en"
# # Hello

# %%
import labkit
labkit.set_lang("ja")

# %% tags=["exercise"]
x = 1 + 1
'''


def run(course, out, *extra):
    return bn.main(["--course", str(course), "--out", str(out), *extra])


def test_build_writes_both_languages_with_shared_code(tmp_path):
    course, out = lesson(tmp_path, GOOD), tmp_path / "notebooks"
    assert run(course, out) == 0
    ja = nbformat.read(out / "ja" / "00_demo.ipynb", as_version=4)
    en = nbformat.read(out / "en" / "00_demo.ipynb", as_version=4)
    assert ja["cells"][0]["source"] == "# こんにちは"
    assert en["cells"][0]["source"] == "# Hello"
    assert ja["cells"][1]["source"].endswith('set_lang("ja")')
    assert en["cells"][1]["source"].endswith('set_lang("en")')
    assert ja["cells"][2]["source"] == en["cells"][2]["source"] == "x = 1 + 1"
    # Tags travel to both languages: student copies and the nbgrader build read
    # them from each notebook.
    assert ja["cells"][2]["metadata"] == {"tags": ["exercise"]}
    assert en["cells"][2]["metadata"] == {"tags": ["exercise"]}
    assert [c["id"] for c in ja["cells"]] == [c["id"] for c in en["cells"]]
    assert all(c.get("outputs", []) == [] for c in ja["cells"])
    assert run(course, out, "--check") == 0


def test_check_fails_on_a_stale_or_missing_notebook(tmp_path, capsys):
    course, out = lesson(tmp_path, GOOD), tmp_path / "notebooks"
    assert run(course, out, "--check") == 1
    assert "missing" in capsys.readouterr().err
    run(course, out)
    nb = out / "en" / "00_demo.ipynb"
    nb.write_text(nb.read_text(encoding="utf-8").replace("Hello", "Hi"), "utf-8")
    assert run(course, out, "--check") == 1
    assert "en/00_demo.ipynb: differs from its source" in capsys.readouterr().err
    (out / "ja" / "99_orphan.ipynb").write_text("{}", "utf-8")
    run(course, out)
    assert run(course, out, "--check") == 1
    assert "99_orphan.ipynb: has no source" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('# %% [markdown] lang="ja"\n# ただ一つ\n\n# %%\nx = 1\n',
         'lacks its lang="en" twin'),
        ("# %% [markdown]\n# no language\n", "markdown cell without lang"),
        ('# %% [markdown] lang="en"\n# English first\n', "must follow its lang=\"ja\""),
        ('# %% lang="ja"\nlabkit.set_lang("ja")\n\n# %% lang="en"\n'
         'labkit.set_lang("en")\n', "code cells are shared, not per language"),
        ('# %% [markdown] lang="ja"\n# 説明\n\n# %% lang="en"\nx = 1\n',
         "its twin is a code cell"),
    ],
)
def test_broken_twins_are_named(tmp_path, capsys, body, problem):
    course, out = lesson(tmp_path, body), tmp_path / "notebooks"
    assert run(course, out) == 1
    assert problem in capsys.readouterr().err


def test_committed_notebooks_are_in_sync():
    """The repository's own notebooks match what course/ builds."""
    result = subprocess.run([sys.executable, str(ROOT / "tools/build_notebooks.py"),
                             "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_heading_cells_are_named_after_their_english_heading(tmp_path):
    course = lesson(tmp_path, GOOD + '''
# %% [markdown] lang="ja"
# ## 正しい使い方 (`no_sync`)

# %% [markdown] lang="en"
# ## Correct use (`no_sync`)

# %% [markdown] lang="ja"
# 見出しのないセル

# %% [markdown] lang="en"
# A cell without a heading
''')
    built = bn.build(course / "00_demo.py")
    ids = {lang: [c.id for c in nbformat.reads(text, as_version=4).cells]
           for lang, text in built.items()}
    assert ids["ja"] == ids["en"] == ["00-hello", "00-001", "00-002",
                                      "00-correct-use-no-sync", "00-004"]
    # A cell added above a heading moves the positions, not the heading's id.
    course = lesson(tmp_path, GOOD.replace("x = 1 + 1\n", "x = 1 + 1\n\n# %%\ny = 2\n")
                    + '# %% [markdown] lang="ja"\n# ## 正しい使い方\n\n'
                    '# %% [markdown] lang="en"\n# ## Correct use\n')
    moved = nbformat.reads(bn.build(course / "00_demo.py")["en"], as_version=4)
    assert [c.id for c in moved.cells][-1] == "00-correct-use"
