"""The built website, checked as files and in a real browser.

`make site-check` builds the site and then runs this file with LABKIT_SITE set to
it (build/site); elsewhere these tests are skipped, saying so. The browser is
Debian's chromium driven by Playwright, as in tests/test_browser.py. Screenshots of
one lesson page per language are kept in build/e2e/.
"""

import functools
import http.server
import os
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import netns_missing, unavailable

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("LABKIT_SITE"):
    pytest.skip("the built site is checked by make site-check, after make site",
                allow_module_level=True)
SITE = Path(os.environ["LABKIT_SITE"]).resolve()
# the lessons as nbval ran them (tools/executed.py)
EXECUTED = ROOT / "build" / "executed"
ARTIFACTS = ROOT / "build" / "e2e"
LANGS = ("ja", "en")
sys.path.insert(0, str(ROOT / "website"))

import check_site  # noqa: E402
import executed  # noqa: E402
import labkit_site  # noqa: E402


def _lessons(lang):
    return sorted(p.name for p in (SITE / lang / "lessons").glob("*.html"))


def test_the_site_has_every_lesson_in_both_languages_and_no_broken_link():
    notebooks = {lang: sorted(p.with_suffix(".html").name
                              for p in (ROOT / "notebooks" / lang).glob("*.ipynb"))
                 for lang in LANGS}
    assert _lessons("ja") == _lessons("en") == notebooks["ja"] == notebooks["en"]
    assert check_site.problems(SITE, EXECUTED) == []


@pytest.mark.parametrize("lang", LANGS)
def test_each_lesson_page_shows_the_run_that_was_tested_and_says_which(lang):
    """A lesson page says the commit and the time of the run it shows, which is
    fresh and passed (check_site counts that run's figures on the page)."""
    import html

    for notebook in (ROOT / "notebooks" / lang).glob("*.ipynb"):
        copy = executed.copy_of(notebook)
        ran = executed.facts(copy)
        assert ran and ran["passed"] and executed.why_stale(notebook) is None, notebook
        assert ran["kernels_started"] == 1, notebook
        page = (SITE / lang / "lessons" / notebook.with_suffix(".html").name
                ).read_text(encoding="utf-8")
        said = labkit_site.TEXT[lang]["ran"].format(
            commit=ran["commit"], when=ran["executed_at"], seconds=ran["seconds"])
        assert said in html.unescape(page), notebook


def test_pages_load_nothing_from_the_network():
    """Scripts, styles, images and fonts all come with the site (offline reading)."""
    outside = []
    for path in SITE.rglob("*.html"):
        page = check_site.read(path)
        outside += [f"{path.relative_to(SITE)}: {src}" for src in page.resources
                    if urlsplit(src).scheme in ("http", "https")
                    or src.startswith("//")]
    assert outside == []


@pytest.mark.parametrize("lang", LANGS)
def test_sliders_are_a_note_and_progress_bars_are_left_out(lang):
    """Lesson 00's sliders and lesson 05's explorer need a kernel: their place says
    so, in the page's language. The progress bars of starting ranks and of %%px
    cells (lessons 03 to 06) are left out. Nothing tries to draw a widget."""
    note = labkit_site.TEXT[lang]["widget"]
    for name in _lessons(lang):
        html = (SITE / lang / "lessons" / name).read_text(encoding="utf-8")
        assert labkit_site.WIDGET_MIME not in html, name
        assert "engine/s" not in html and "tasks/s" not in html, name
        assert (note in html) == (name in ("00_setup.html", "05_communication.html"))


# --- in the browser ------------------------------------------------------------

class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no line per request in the test's output
        pass


@pytest.fixture(scope="module")
def served():
    """The site over HTTP on 127.0.0.1, as a reader gets it."""
    handler = functools.partial(_Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def page(served):
    browser_test = pytest.importorskip("test_browser")
    playwright = browser_test.playwright
    with playwright.sync_playwright() as p:
        browser = browser_test._chromium(p)
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900})
        finally:
            browser.close()


IMAGES = """() => [...document.querySelectorAll('article img')]
    .map(img => [img.getAttribute('src'), img.complete && img.naturalWidth > 0])"""
ON_SCREEN = """id => {
    const el = document.getElementById(id);
    if (!el) return 'missing';
    const box = el.getBoundingClientRect();
    return box.top >= 0 && box.top < window.innerHeight ? 'on screen' : `at ${box.top}`;
}"""


@pytest.mark.parametrize("lang", LANGS)
def test_every_lesson_page_shows_its_figures(served, page, lang):
    broken, shown = [], 0
    for name in _lessons(lang):
        page.goto(f"{served}/{lang}/lessons/{name}")
        images = page.evaluate(IMAGES)
        shown += len(images)
        broken += [f"{name}: {src}" for src, loaded in images if not loaded]
        if name.startswith("05_"):
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"site-{lang}-{name}.png"))
    assert broken == []
    assert shown > 20  # the lessons' plots, all of them loaded


@pytest.mark.parametrize("lang", LANGS)
def test_errata_links_land_on_their_cell(served, page, lang):
    """Links deep into lessons 04 and 08: after the click the linked heading is on
    screen (and at the page's top it was not)."""
    errata = f"{served}/{lang}/lessons/16_errata.html"
    page.goto(errata)
    links = page.evaluate("""() => [...document.querySelectorAll('article a')]
        .map(a => a.getAttribute('href'))
        .filter(h => /^0[48]_.*\\.html#/.test(h))""")
    deepest = {}
    for href in links:  # the last link to each lesson is one of its deepest
        deepest[href.split("#")[0]] = href
    chosen = sorted(set(list(deepest.values()) + links[:1]))
    assert len(chosen) >= 3, links
    missed = []
    for href in chosen:
        page.goto(errata)
        page.locator(f'article a[href="{href}"]').first.click()
        page.wait_for_load_state()
        target = href.split("#")[1]
        page.wait_for_timeout(300)
        place = page.evaluate(ON_SCREEN, target)
        if place != "on screen":
            missed.append(f"{href}: {place}")
        page.evaluate("window.scrollTo(0, 0)")
        if page.evaluate(ON_SCREEN, target) == "on screen":
            missed.append(f"{href}: on screen at the top too: the check proves nothing")
    assert missed == []


def test_switching_language_keeps_the_page(served, page):
    page.goto(f"{served}/ja/lessons/04_no_sync.html")
    assert page.evaluate("document.documentElement.lang") == "ja"
    page.locator("a.labkit-twin").first.click()
    page.wait_for_load_state()
    assert page.url.endswith("/en/lessons/04_no_sync.html")
    assert page.evaluate("document.documentElement.lang") == "en"
    page.locator("a.labkit-twin").first.click()
    page.wait_for_load_state()
    assert page.url.endswith("/ja/lessons/04_no_sync.html")


@pytest.mark.parametrize(("lang", "word"), [("ja", "勾配"), ("en", "gradient")])
def test_search_finds_lessons_by_a_word(served, page, lang, word):
    page.goto(f"{served}/{lang}/search.html?q={word}")
    page.wait_for_function(
        "() => document.querySelectorAll('#search-results li').length > 0",
        timeout=30_000)
    hits = page.evaluate("""() => [...document.querySelectorAll('#search-results li a')]
        .map(a => a.getAttribute('href'))""")
    assert any("lessons/04_no_sync" in h for h in hits), hits


def test_the_site_builds_without_a_network(tmp_path):
    """Sphinx, the theme and the extensions fetch nothing: the English site built
    again in a network namespace that has only loopback (the lessons come
    executed, from build/executed: the site runs none)."""
    import subprocess

    if not sys.platform.startswith("linux"):
        # Network namespaces are Linux's; netns_missing's hints (root, apt-get)
        # would mislead on macOS, and os.geteuid is not on Windows.
        unavailable("the offline build needs Linux's network namespaces (unshare "
                    f"-n); this system is {sys.platform}", "LABKIT_REQUIRE_NETNS")
    if missing := netns_missing():
        unavailable("the offline build needs " + ", ".join(missing),
                    "LABKIT_REQUIRE_NETNS")
    build = (f"ip link set lo up && {sys.executable} -m sphinx -W --keep-going -q -E "
             f"-b html -d {tmp_path}/doctrees website/en {tmp_path}/html")
    done = subprocess.run(["unshare", "-n", "sh", "-c", build], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "html" / "lessons" / "04_no_sync.html").exists()


SEARCH_BOXES = """() => [...document.querySelectorAll(
        '.search-button__button, input[type=search], form.bd-search')]
    .filter(e => e.offsetParent !== null && e.getBoundingClientRect().width > 0)
    .map(e => e.className)"""


@pytest.mark.parametrize("lang", LANGS)
def test_each_page_has_one_search_box(served, page, lang):
    """One search box on a wide screen (the sidebar's) and on a narrow one (the
    header's button, the sidebar folded away), on the home page and a lesson."""
    shown = {}
    try:
        for width in (1280, 600):
            page.set_viewport_size({"width": width, "height": 900})
            for name in ("index.html", "lessons/04_no_sync.html"):
                page.goto(f"{served}/{lang}/{name}")
                shown[(width, name)] = page.evaluate(SEARCH_BOXES)
    finally:
        page.set_viewport_size({"width": 1280, "height": 900})
    assert all(len(boxes) == 1 for boxes in shown.values()), shown


@pytest.mark.parametrize("lang", LANGS)
def test_a_solution_shows_only_when_asked_for(served, page, lang):
    """Lesson 02's first exercise: the page shows the exercise and the check's
    code; the solution and the check's verdict on it show after a click on their
    prompts, in the page's language."""
    page.goto(f"{served}/{lang}/lessons/02_data_parallel.html")
    solution = page.locator("div.tag_solution").first
    code = solution.locator("div.cell_input")
    assert not code.is_visible()
    verdict = page.locator("div.tag_solution + div.cell div.cell_output").first
    assert not verdict.is_visible()
    assert page.locator("p.labkit-solutions").inner_text() == (
        labkit_site.TEXT[lang]["solutions"])
    solution.get_by_text(labkit_site.TEXT[lang]["show"]).click()
    assert code.is_visible() and "[3, 3, 1]" in code.inner_text()
    page.locator("div.tag_solution + div.cell").first.get_by_text(
        labkit_site.TEXT[lang]["show_check"]).click()
    assert verdict.is_visible()


@pytest.mark.parametrize("lang", LANGS)
def test_a_folded_cell_shows_its_figure_and_its_code_on_request(served, page, lang):
    """Lesson 00's font check, folded in the lesson (hide-input): the page shows its
    figure, and its code after a click on the prompt in the page's language."""
    page.goto(f"{served}/{lang}/lessons/00_setup.html")
    cell = page.locator("div.tag_hide-input").filter(
        has_text=labkit_site.TEXT[lang]["show_code"]).first
    code = cell.locator("div.cell_input")
    assert cell.locator("div.cell_output img").count() >= 1
    assert not code.is_visible()
    cell.get_by_text(labkit_site.TEXT[lang]["show_code"]).click()
    assert code.is_visible() and "plots" in code.inner_text()
