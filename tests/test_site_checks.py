"""The website's own parts, without building it: the checker of the built site finds
each kind of problem it is for, and the lessons' cell links are made into links the
site resolves. (The built site itself is checked by tests/test_site.py.)"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "website"))

import check_site  # noqa: E402
import labkit_site  # noqa: E402

PAGE = """<html><body><section id="top"><h1>{title}</h1>
<a class="labkit-twin" href="../../{twin}/lessons/{name}.html">twin</a>
{body}</section></body></html>"""


FIGURE = {"output_type": "display_data", "data": {"image/png": "iVBOR"}}


def _site(tmp_path, ja_body="", en_body="", lessons=("01_a",)) -> Path:
    """A built site in miniature (in site/): index pages and lesson pages in both
    languages, each lesson with the one figure its run (in ran/) made."""
    for lang, body in (("ja", ja_body), ("en", en_body)):
        ran = tmp_path / "ran" / lang
        ran.mkdir(parents=True)
        for name in lessons:
            (ran / f"{name}.ipynb").write_text(json.dumps({"cells": [
                {"cell_type": "code", "outputs": [FIGURE]}]}))
        twin = "en" if lang == "ja" else "ja"
        site = tmp_path / "site"
        (site / lang / "lessons").mkdir(parents=True)
        (site / lang / "index.html").write_text(
            f'<a class="labkit-twin" href="../{twin}/index.html">twin</a>'
            + "".join(f'<a href="lessons/{n}.html">{n}</a>' for n in lessons))
        for name in lessons:
            (site / lang / "lessons" / "fig.png").write_bytes(b"png")
            (site / lang / "lessons" / f"{name}.html").write_text(PAGE.format(
                title=name, twin=twin, name=name,
                body='<img src="fig.png">' + body))
    return tmp_path / "site"


def _problems(site: Path) -> list[str]:
    return check_site.problems(site, site.parent / "ran")


def test_a_whole_site_has_no_problems(tmp_path):
    site = _site(tmp_path, ja_body='<a href="01_a.html#top">here</a>')
    assert _problems(site) == []


@pytest.mark.parametrize(("body", "problem"), [
    ('<a href="02_missing.html">x</a>', "link to a missing file: 02_missing.html"),
    ('<a href="01_a.html#no">x</a>', "link to a missing anchor: 01_a.html#no"),
    ('<a href="#nowhere">x</a>', "link to a missing anchor: #nowhere"),
    ('<img src="gone.png">', "missing image: gone.png"),
])
def test_each_broken_link_or_image_is_found(tmp_path, body, problem):
    site = _site(tmp_path, en_body=body)
    assert _problems(site) == [f"en/lessons/01_a.html: {problem}"]


def test_a_page_without_its_twin_and_a_lesson_without_its_figures_are_found(tmp_path):
    site = _site(tmp_path)
    (site / "en" / "lessons" / "01_a.html").write_text(
        '<a href="../../ja/lessons/01_a.html">twin, unmarked</a>')
    (site / "en" / "extra.html").write_text("only in English")
    ran = site.parent / "ran" / "ja"
    two = {"cells": [{"cell_type": "code", "outputs": [FIGURE, FIGURE]}]}
    (ran / "01_a.ipynb").write_text(json.dumps(two))
    assert _problems(site) == [
        "ja/lessons/01_a.html: 1 of its lesson's 2 figures",
        "en/extra.html: no ja twin",
        "en/extra.html: no link to its ja twin",
        "en/lessons/01_a.html: no link to its ja twin",
        "en/lessons/01_a.html: 0 of its lesson's 1 figures",
    ]


ERROR = {"output_type": "error", "ename": "ValueError", "evalue": "", "traceback": []}


@pytest.mark.parametrize(("cells", "metadata", "problem"), [
    ([{"cell_type": "code", "outputs": [FIGURE, ERROR]}], {},
     "code cell 0 raised, untagged"),
    ([{"cell_type": "code", "outputs": [FIGURE],
       "metadata": {"tags": ["raises-exception"]}}], {},
     "code cell 0 is tagged raises-exception and raised nothing"),
    ([{"cell_type": "code", "outputs": [FIGURE]}],
     {"labkit_run": {"passed": False}}, "its run failed"),
])
def test_a_page_showing_a_run_that_went_wrong_is_found(tmp_path, cells, metadata,
                                                       problem):
    """The site shows make test's run: a cell that raised where the lesson does not
    mean it, a failure meant but gone, or a failed run, is a problem of the page."""
    site = _site(tmp_path)
    ran = site.parent / "ran" / "en" / "01_a.ipynb"
    ran.write_text(json.dumps({"cells": cells, "metadata": metadata}))
    assert _problems(site) == [f"en/lessons/01_a.html: {problem}"]
    tagged = {"cell_type": "code", "outputs": [FIGURE, ERROR],
              "metadata": {"tags": ["raises-exception"]}}
    ran.write_text(json.dumps({"cells": [tagged],
                               "metadata": {"labkit_run": {"passed": True}}}))
    assert _problems(site) == []  # a failure meant, and shown: no problem


@pytest.mark.parametrize(("output", "said"), [
    ({"output_type": "stream", "name": "stderr", "text": [
        "[IPKernelApp] WARNING | Kernel is running over TCP without encryption. All"]},
     "[IPKernelApp]"),
    ({"output_type": "stream", "name": "stderr", "text":
      "/x/site-packages/jupyter_client/session.py:721: UserWarning: Message "
      "serialization failed"}, "jupyter_client/session.py:721"),
    ({"output_type": "stream", "name": "stderr", "text":
      "[W 10:02:11 jupyter_client.session] Message serialization failed"},
     "jupyter_client.session"),
    ({"output_type": "stream", "name": "stdout", "text": "2 ranks ready"}, None),
    # a warning a lesson shows on purpose (torch's) is the lesson's
    ({"output_type": "stream", "name": "stderr", "text": "torch/amp/grad_scaler.py:"
      "132: UserWarning: torch.cuda.amp.GradScaler is enabled"}, None),
])
def test_an_output_of_the_notebook_machinery_is_found(tmp_path, output, said):
    """A kernel's or jupyter_client's message about itself, printed into a lesson's
    output, would show on its page."""
    site = _site(tmp_path)
    ran = site.parent / "ran" / "en" / "01_a.ipynb"
    ran.write_text(json.dumps({"cells": [
        {"cell_type": "code", "outputs": [FIGURE, output]}]}))
    assert _problems(site) == ([] if said is None else [
        f"en/lessons/01_a.html: code cell 0 shows the machinery's message: {said}"])


# A solution cell as myst-nb writes it when the site folds it (hide-cell), and the
# check after it, its output folded (hide-output)
FOLDED = ('<div class="cell tag_solution tag_hide-cell docutils container">'
          '<details class="admonition hide above-input"><summary>show</summary>'
          '<div class="cell_input docutils container"><pre>x = 1</pre></div>'
          '<div class="cell_output docutils container"><pre>1</pre></div>'
          '</details></div>')
CHECK = ('<div class="cell tag_hide-output docutils container">'
         '<div class="cell_input docutils container"><pre>grade(x)</pre></div>'
         '<details class="admonition hide below-input"><summary>show</summary>'
         '<div class="cell_output docutils container"><pre>x = 1: right</pre></div>'
         '</details></div>')
SOLUTION = "the solution's {} shows unfolded"
ITS_CHECK = "the check of a solution's {} shows unfolded"


@pytest.mark.parametrize(("body", "problem"), [
    (FOLDED + CHECK, []),
    (FOLDED.replace("<details", "<details open") + CHECK,  # opened as the page loads
     [SOLUTION.format("code"), SOLUTION.format("output")]),
    (FOLDED.replace("details", "div") + CHECK,
     [SOLUTION.format("code"), SOLUTION.format("output")]),
    # folded code, output beside the fold
    (FOLDED.replace('</details></div>', '</div>').replace(
        '</div><div class="cell_output', '</div></details><div class="cell_output')
     + CHECK, [SOLUTION.format("output")]),
    (FOLDED + CHECK.replace("details", "div"), [ITS_CHECK.format("output")]),
    (FOLDED + "<p>text</p>" + CHECK.replace("details", "div"), []),  # not its check
    ("", ["0 solution cells, its lesson has 1"]),  # the solution left out
    (FOLDED + FOLDED, ["2 solution cells, its lesson has 1"]),
])
def test_each_solution_on_a_lesson_page_is_folded(tmp_path, body, problem):
    """A lesson's solution cells are all on its page, each folded, and so is the
    output of the check after each (its verdict on the solution): none of them
    shows until a reader opens it."""
    site = _site(tmp_path, en_body=body)
    ran = site.parent / "ran" / "en" / "01_a.ipynb"
    ran.write_text(json.dumps({"cells": [
        {"cell_type": "code", "outputs": [FIGURE]},
        {"cell_type": "code", "outputs": [], "metadata": {"tags": ["solution"]}}]}))
    assert _problems(site) == [f"en/lessons/01_a.html: {p}" for p in problem]


@pytest.mark.parametrize(("body", "breaks"), [
    ("<p>学習し、最後に比べます。GPU\nで all-reduce\nします。</p>", None),
    ("<p>学習し、\n最後に</p>", "、⏎最"),
    ("<p>平均\nする</p>", "均⏎す"),
    ("<p><strong>強調</strong>\nです</p>", "調⏎で"),  # across inline markup
    ("<p>次に、\n<code>x</code></p>", "、⏎`"),
    ("<p><code>正解です</code>\nと表示</p>", None),  # code is spaced
    ("<p>一段落</p>\n<p>二段落</p>", None),  # two blocks, not one line
    ("<pre>平均\nする</pre>", None),  # code keeps its lines
])
def test_a_japanese_line_break_shown_as_a_space_is_found(tmp_path, body, breaks):
    site = _site(tmp_path, ja_body=body, en_body=body)  # on English pages: allowed
    assert _problems(site) == ([] if breaks is None else [
        f"ja/lessons/01_a.html: Japanese line breaks shown as spaces: {breaks}"])


def _app(lang):
    return SimpleNamespace(config=SimpleNamespace(language=lang))


def test_cell_links_become_links_to_targets_the_site_has():
    notebook = {"cells": [
        {"cell_type": "markdown", "id": "13-errata", "metadata": {}, "source": [
            "# Errata\n", "See [the proof](04_no_sync.ipynb#cell-id=04-equal)."]},
        {"cell_type": "code", "id": "11-001", "metadata": {},
         "source": ["x = '#cell-id=1'"]},
        {"cell_type": "markdown", "id": "11-plain", "metadata": {},
         "source": ["no heading here"]},
    ]}
    source = [json.dumps(notebook)]
    labkit_site.lesson_source(_app("en"), "lessons/16_errata", source)
    cells = json.loads(source[0])["cells"]
    assert cells[0]["source"] == ("(13-errata)=\n# Errata\n"
                                  "See [the proof](04_no_sync.ipynb#04-equal).")
    assert cells[1]["source"] == ["x = '#cell-id=1'"]  # code is left as it is
    assert cells[2]["source"] == "no heading here"  # a target only on a heading
    index = [json.dumps(notebook)]
    labkit_site.lesson_source(_app("en"), "index", index)  # not a lesson: not touched
    assert index == [json.dumps(notebook)]


@pytest.mark.parametrize("lang", ["ja", "en"])
def test_solutions_and_their_checks_fold_with_prompts_in_the_page_language(lang):
    notebook = {"cells": [
        {"cell_type": "code", "id": "02-001", "metadata": {"tags": ["exercise"]},
         "source": "predicted = None"},
        {"cell_type": "code", "id": "02-002", "metadata": {"tags": ["solution"]},
         "source": "predicted = [3, 3, 1]"},
        {"cell_type": "code", "id": "02-003", "metadata": {}, "source": "check()"},
        {"cell_type": "code", "id": "02-004", "metadata": {}, "source": "x = 1"},
    ]}
    source = [json.dumps(notebook)]
    labkit_site.lesson_source(_app(lang), "lessons/02_x", source)
    cells = json.loads(source[0])["cells"]
    assert [c["metadata"].get("tags") for c in cells] == [
        ["exercise"], ["solution", "hide-cell"], ["hide-output"], None]
    assert cells[1]["metadata"]["mystnb"]["code_prompt_show"] == (
        labkit_site.TEXT[lang]["show"])
    assert cells[2]["metadata"]["mystnb"]["code_prompt_show"] == (
        labkit_site.TEXT[lang]["show_check"])


JAPANESE = "勾配を平均\nする。次に、\nGPU\nで all-reduce\nする。"


@pytest.mark.parametrize(("lang", "joined"), [
    ("ja", "勾配を平均する。次に、GPU\nで all-reduce\nする。"),  # GPU で: spaced
    ("en", JAPANESE),
])
def test_japanese_sentences_lose_their_line_breaks_on_the_japanese_site(lang, joined):
    """A break between two Japanese characters, or after 、 or 。, would show as a
    space; one before or after a Latin word stays (the sources space them). The
    same function as the notebooks' build, on a lesson's markdown cells, on a
    Markdown page, and on a file it includes (the README)."""
    fence = "\n```{include} ../../README.ja.md\n:start-after: 平均\nする\n```"
    notebook = {"cells": [
        {"cell_type": "markdown", "id": "03-001", "metadata": {}, "source": JAPANESE},
        {"cell_type": "code", "id": "03-002", "metadata": {}, "source": "# 平均\nする"},
    ]}
    source = [json.dumps(notebook)]
    labkit_site.lesson_source(_app(lang), "lessons/03_x", source)
    cells = json.loads(source[0])["cells"]
    assert cells[0]["source"] == joined
    assert cells[1]["source"] == "# 平均\nする"  # code keeps its lines
    page = [JAPANESE + fence]
    labkit_site.lesson_source(_app(lang), "index", page)
    assert page == [joined + fence]  # the directive's lines are left alone
    included = [JAPANESE]
    labkit_site.japanese_includes(_app(lang), Path("README.ja.md"), "index", included)
    assert included == [joined]
