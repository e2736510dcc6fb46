import re
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


# The committed notebooks are checked against course/ by `make check-notebooks`
# (tools/build_notebooks.py --check), the step before the unit tests.

OUTPUT_TAG = re.compile(r"nbval-(ignore|check)-output|NBVAL_(IGNORE|CHECK)_OUTPUT",
                        re.I)


def test_no_lesson_carries_an_output_comparison_tag():
    """nbval runs the lessons with --nbval-lax and the notebooks hold no outputs, so
    a tag asking nbval to ignore or compare a cell's output does nothing; a lesson
    that carries one tells its reader something untrue."""
    found = [f"{path.name}:{n}" for path in sorted((ROOT / "course").glob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if OUTPUT_TAG.search(line)]
    assert found == []
    assert OUTPUT_TAG.search('# %% tags=["nbval-ignore-output"]')  # what it looks for


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


# --- Japanese line breaks -----------------------------------------------------------

def _breaks_shown_as_spaces(markdown: str) -> list[str]:
    """The line breaks in `markdown` that a Markdown renderer shows as a space where
    Japanese has none: a soft break between two Japanese characters, or beside
    Japanese punctuation. Read from markdown-it's tokens, independently of
    join_japanese_lines: code spans count as code (a space beside them is right)."""
    import re

    from markdown_it import MarkdownIt

    def seen(children, i, step):
        j = i + step
        while 0 <= j < len(children) and children[j].type not in (
                "softbreak", "hardbreak"):
            child = children[j]
            if child.type == "text" and child.content:
                return child.content[-1] if step < 0 else child.content[0]
            if child.type in ("code_inline", "html_inline", "image"):
                return "`"
            j += step
        return ""

    japanese = re.compile(f"[{bn.JAPANESE}]")
    punctuation = re.compile(f"[{bn.JAPANESE_PUNCTUATION}]")
    found = []
    for token in MarkdownIt("commonmark").enable("table").parse(markdown):
        for i, child in enumerate(token.children or []):
            if child.type != "softbreak":
                continue
            before, after = seen(token.children, i, -1), seen(token.children, i, 1)
            if (japanese.match(before) and japanese.match(after)
                    or punctuation.match(before) or punctuation.match(after)):
                found.append(before + "⏎" + after)
    return found


def _rendered(markdown: str) -> str:
    """The HTML of `markdown` with the line breaks outside <pre> taken out: equal
    for two texts that differ only in the breaks inside their paragraphs."""
    import re

    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").enable("table").render(markdown)
    parts = re.split(r"(<pre>.*?</pre>)", html, flags=re.DOTALL)
    return "".join(p if p.startswith("<pre>") else p.replace("\n", "") for p in parts)


@pytest.mark.parametrize(("source", "joined"), [
    # between Japanese characters, after 、 and 。, before a full-width bracket
    ("勾配を平均\nする。次に、\nGPU で", "勾配を平均する。次に、GPU で"),
    ("モデル\n（複製）", "モデル（複製）"),
    # beside Latin text, numbers and code the space is right: the break stays
    ("GPU\nで all-reduce\nする", "GPU\nで all-reduce\nする"),
    ("`no_sync`\nを使う", "`no_sync`\nを使う"),
    ("ランク\n2 つ", "ランク\n2 つ"),
    # emphasis and a link's target are markup, not what the reader sees
    ("**強調**\nです", "**強調**です"),
    ("[証明](04_no_sync.ipynb#cell-id=04-x)\nを見ます",
     "[証明](04_no_sync.ipynb#cell-id=04-x)を見ます"),
    ("次の\n**強調**", "次の**強調**"),
    # a list item's lines join, its items stay apart
    ("- 項目の\n  続き\n- 次の\n  項目", "- 項目の続き\n- 次の項目"),
    ("1. 一つ目\n2. 二つ目", "1. 一つ目\n2. 二つ目"),
    # headings, table rows, quotes, a hard break, blank lines
    ("# 見出し\n本文", "# 見出し\n本文"),
    ("本文\n# 見出し", "本文\n# 見出し"),
    ("| 表 | 一 |\n|---|---|\n| 行 | 二 |", "| 表 | 一 |\n|---|---|\n| 行 | 二 |"),
    ("> 引用の\n> 続き\n本文", "> 引用の続き本文"),  # the last line is the quote's
    ("> 引用\n> - 項目", "> 引用\n> - 項目"),
    ("改行  \nです", "改行  \nです"),
    ("段落\n\n段落", "段落\n\n段落"),
    # a fence keeps every line, and the text after it still joins
    ("```python\n# 日本\n# 語\nx = 1\n```\n後\nろ",
     "```python\n# 日本\n# 語\nx = 1\n```\n後ろ"),
    ("~~~\n日本\n語\n~~~", "~~~\n日本\n語\n~~~"),
    ("<details>\n日本\n</details>", "<details>\n日本\n</details>"),
    # English is left as it is
    ("A line\nbreak stays.", "A line\nbreak stays."),
])
def test_japanese_line_breaks_are_joined_where_they_would_show_as_spaces(source,
                                                                          joined):
    assert bn.join_japanese_lines(source) == joined
    assert _breaks_shown_as_spaces(joined) == []
    assert _rendered(joined) == _rendered(source)  # nothing but the breaks changed
    assert bn.join_japanese_lines(joined) == joined


def test_the_check_for_japanese_line_breaks_finds_them():
    """The check the built notebooks are held to finds each kind of break."""
    assert _breaks_shown_as_spaces("学習し、\n最後に") == ["、⏎最"]
    assert _breaks_shown_as_spaces("平均\nする") == ["均⏎す"]
    assert _breaks_shown_as_spaces("**強調**\nです") == ["調⏎で"]
    assert _breaks_shown_as_spaces("- 項目の\n  続き") == ["の⏎続"]
    assert _breaks_shown_as_spaces("GPU\nで `x`\nを") == []
    assert _rendered("日本\n語") != _rendered("日本\n\n語")


def test_built_japanese_notebooks_have_no_line_break_shown_as_a_space():
    """Every Japanese markdown cell of every built notebook (JupyterLab shows a
    break in a paragraph as a space), and the join changed nothing else."""
    import jupytext

    left, cells = [], 0
    for path in sorted((ROOT / "notebooks" / "ja").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                cells += 1
                left += [f"{path.stem} {cell.id}: {b}"
                         for b in _breaks_shown_as_spaces(cell.source)]
    assert cells > 100
    assert left == []
    # what the build writes renders as its source does, but for those breaks
    for path in sorted((ROOT / "course").glob("[0-9][0-9]_*.py")):
        sources = bn.split_languages(jupytext.read(path, fmt="py:percent"),
                                     path.name)["ja"]
        built = nbformat.reads(bn.build(path)["ja"], as_version=4).cells
        for source, cell in zip(sources, built, strict=True):
            if cell.cell_type == "markdown":  # the build adds a section's mark
                marked = bn.mark_section(source.source,
                                         source.metadata.get("tags", []), "ja")
                assert _rendered(cell.source) == _rendered(marked), cell.id


def test_notebooks_hold_what_the_kernel_reports_about_itself():
    """JupyterLab writes the kernel's kernelspec and language_info into a notebook
    as it opens; the lessons hold the same, so that opening one modifies nothing
    (tests/test_browser.py opens one). Only Python's version is the course's own."""
    from ipykernel.ipkernel import IPythonKernel
    from ipykernel.kernelspec import KERNEL_NAME, get_kernel_dict

    reported = {**IPythonKernel.language_info, "version": bn.PYTHON_VERSION}
    assert bn.LANGUAGE_INFO == reported
    spec = get_kernel_dict()
    assert bn.KERNELSPEC == {"name": KERNEL_NAME, "display_name": spec["display_name"],
                             "language": spec["language"]}
    for path in sorted((ROOT / "notebooks").glob("*/*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert (nb.metadata.kernelspec, nb.metadata.language_info) == (
            bn.KERNELSPEC, bn.LANGUAGE_INFO), path
        assert (nb.nbformat, nb.nbformat_minor) == (4, 5), path


def test_a_cell_is_named_by_its_heading_not_by_a_comment_in_its_code_block():
    """A `# comment` inside fenced code is no heading: the cell's id comes from the
    heading after it, the heading tools/links.py lands links on."""
    import links

    cell = nbformat.v4.new_markdown_cell(
        "```python\n# run this first\nx = 1\n```\n\n## Correct `use`\n\nText.")
    plain = nbformat.v4.new_markdown_cell("No heading, only text.")
    assert bn.cell_ids("04", [cell, plain]) == ["04-correct-use", "04-001"]
    assert links._cell_headings(cell.source) == ["Correct-use"]


def test_a_tagged_section_gets_its_mark_under_the_heading_in_each_language():
    src = "## Buckets\n\nEach call pays α."
    assert bn.mark_section(src, ["core"], "en") == (
        "## Buckets\n\n*★ Core path*\n\nEach call pays α.")
    assert "*発展 (中核コースでは飛ばせます)*" in bn.mark_section(
        "## バケット", ["deep-dive"], "ja")
    assert bn.mark_section(src, ["exercise"], "en") == src  # no mark asked for
    with pytest.raises(bn.SourceError, match="one heading"):
        bn.mark_section("no heading here", ["core"], "en")
    with pytest.raises(bn.SourceError, match="one heading"):
        bn.mark_section(src, ["core", "deep-dive"], "en")


def test_a_folded_code_cell_is_built_hidden_and_read_apart(tmp_path):
    """A cell tagged hide-input opens folded in JupyterLab, and its lines leave the
    reading minutes (tools/lesson_time.py counts them in `hid`)."""
    import lesson_time
    body = GOOD + '\n# %% tags=["hide-input"]\nplots.line_chart(x)\nassert x == 2\n'
    course, out = lesson(tmp_path, body), tmp_path / "notebooks"
    assert run(course, out) == 0
    nb = nbformat.read(out / "en" / "00_demo.ipynb", as_version=4)
    folded = [c for c in nb.cells if "hide-input" in c.metadata.get("tags", [])]
    assert [c.metadata.get("jupyter") for c in folded] == [{"source_hidden": True}]
    shown = [c for c in nb.cells if c.cell_type == "code" and c not in folded]
    assert all("jupyter" not in c.metadata for c in shown)
    t = lesson_time.measure(out / "en" / "00_demo.ipynb", "en", run=False)
    assert (t.code_lines, t.hidden_lines, t.figures) == (3, 2, 1)


# What a lesson teaches in its code: a folded cell holding one of these hides it.
TAUGHT = re.compile(r"DDP\(|\bdist\.|no_sync|init_process_group|\boptim\.|"
                    r"%%writefile|fully_shard|register_comm_hook")


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_a_folded_code_cell_only_draws_or_checks(lang):
    problems = []
    for path in sorted((ROOT / "notebooks" / lang).glob("*.ipynb")):
        for n, c in enumerate(nbformat.read(path, as_version=4).cells):
            tags = c.metadata.get("tags", [])
            if c.cell_type != "code" or bn.FOLD_CODE not in tags:
                continue
            where = f"{path.stem} cell {n}"
            if {"exercise", "solution"} & set(tags):
                problems.append(f"{where}: an exercise is never folded")
            if m := TAUGHT.search(c.source):
                problems.append(f"{where}: folds taught code ({m.group()})")
            if not re.search(r"\b(plots|diagrams)\.\w+\(|^\s*assert\b|\bcheck",
                             c.source, re.M):
                problems.append(f"{where}: neither draws nor checks")
    assert problems == []


def test_the_folding_rule_finds_taught_code():
    assert TAUGHT.search("model = DDP(net)\nplots.timeline(t)")
    assert not TAUGHT.search("fig = plots.timeline(t)\nassert len(t) == 3")
