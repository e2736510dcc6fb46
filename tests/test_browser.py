"""A real browser: JupyterLab serves the lessons, headless Chromium runs cells as a
learner does (lesson 00's plot and slider; Run All past a failure meant) and
follows the errata's links to the cells that prove them. Whole lessons are run
once per `make test`, by nbval: these tests run a few of their cells only.

Uses Debian's chromium (/usr/bin/chromium) driven by Playwright; no browser is
downloaded. Skipped, saying why, where chromium or playwright is missing, unless
LABKIT_REQUIRE_BROWSER=1 (.ci/run sets it) makes that a failure. Screenshots (the
lesson run, and each link that misses) are kept in build/e2e/ as artifacts.
"""

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import unavailable

ROOT = Path(__file__).resolve().parent.parent
# Found on PATH, as a learner's shell finds it (Debian puts it in /usr/bin).
CHROMIUM = shutil.which("chromium")
ARTIFACTS = ROOT / "build" / "e2e"

if CHROMIUM is None:
    unavailable("the browser tests need Debian's chromium on PATH "
                "(apt-get install chromium; .ci/run installs it as root)",
                "LABKIT_REQUIRE_BROWSER", module=True)
try:
    from playwright import sync_api as playwright
except ImportError:
    unavailable("the browser tests need playwright (the dev extra: make setup)",
                "LABKIT_REQUIRE_BROWSER", module=True)


KERNEL_IDLE = """() => {
    const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = w && w.sessionContext && w.sessionContext.session
        && w.sessionContext.session.kernel;
    return Boolean(kernel) && kernel.status === 'idle'
        && document.querySelectorAll('.jp-Notebook .jp-Cell').length > 0;
}"""
# Read from each cell's model: a folded cell (hide-input) shows no input prompt.
ALL_RAN = r"""() => window.jupyterapp.shell.currentWidget.content.widgets
    .filter(cell => cell.model.type === 'code')
    .every(cell => Number.isInteger(cell.model.executionCount))"""
# The cells (by index) of the notebook on screen whose outputs hold an error, read
# from the notebook's model: JupyterLab renders an error with the stderr mime
# type, so the page's output elements cannot tell an error from a warning.
# The code cells (index, first line, execution count) that have not run yet.
NOT_RAN = r"""() => window.jupyterapp.shell.currentWidget.content.widgets
    .map((cell, i) => [i, cell])
    .filter(([, cell]) => cell.model.type === 'code'
        && !Number.isInteger(cell.model.executionCount))
    .map(([i, cell]) => [i, cell.model.sharedModel.getSource().split('\n')[0],
        String(cell.model.executionCount)])"""
FAILED_CELLS = """() => window.jupyterapp.shell.currentWidget.content.widgets
    .map((cell, i) => [i, cell.model.type === 'code'
        && cell.model.outputs.toJSON().some(o => o.output_type === 'error')])
    .filter(([, failed]) => failed).map(([i]) => i)"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_lab(tmp_path, settings, *args):
    """JupyterLab on 127.0.0.1 over a copy of the notebooks (outputs stay there),
    with `settings` ({"plugin-extension/plugin": json text}) as the user's and
    `args` added to its command line."""
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks")
    for name, value in settings.items():
        path = tmp_path / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value)
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={tmp_path / 'notebooks'}",
           f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
           "--LabApp.expose_app_in_browser=True", *args]  # window.jupyterapp: commands
    if getattr(os, "geteuid", lambda: -1)() == 0:  # none on Windows
        cmd.append("--allow-root")
    env = os.environ | {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
                        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("JupyterLab did not start") from None
                time.sleep(0.3)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


NO_NEWS = {"apputils-extension/notification": '{"fetchNews": "false"}'}


@pytest.fixture
def lab(tmp_path):
    """JupyterLab that renders every cell (not only those on screen)."""
    yield from _serve_lab(tmp_path, NO_NEWS | {
        "notebook-extension/tracker": '{"windowingMode": "none"}'})


@pytest.fixture
def lab_as_shipped(tmp_path):
    """JupyterLab with the course's defaults, as `make lab` opens it."""
    yield from _serve_lab(tmp_path, NO_NEWS,
                          f"--LabApp.app_settings_dir={ROOT / 'jupyterlab-settings'}")


@pytest.fixture
def lab_first_start(tmp_path):
    """JupyterLab as `make lab` opens it the first time: the course's defaults, and
    no setting of the learner's own."""
    yield from _serve_lab(tmp_path, {},
                          f"--LabApp.app_settings_dir={ROOT / 'jupyterlab-settings'}")


def _chromium(p):
    return p.chromium.launch(
        executable_path=CHROMIUM,
        args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update",
              "--disable-sync"])


def _run_all(lab, path: str, wait_for=(), timeout_ms: int = 180_000, done=ALL_RAN):
    """Open `path` in JupyterLab, "Run All Cells", wait until `done` (by default:
    every cell ran) and the kernel is idle.

    `wait_for`: selectors that must appear on the way. Returns the notebook's
    text, the indices of the cells that hold an error, and the code cells not
    run. A screenshot goes to the artifacts: NAME.png, or NAME-failed.png when the
    run did not end.
    """
    base, token = lab
    name = Path(path).stem
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{base}/lab/tree/{path}?token={token}")
            try:
                # The notebook's kernel is up and idle: only then run every cell.
                page.wait_for_function(KERNEL_IDLE, timeout=timeout_ms)
                # What the Run menu's "Run All Cells" does.
                page.evaluate(
                    "window.jupyterapp.commands.execute('notebook:run-all-cells')")
                for selector in wait_for:
                    page.wait_for_selector(selector, state="attached",
                                           timeout=timeout_ms)
                # Every code cell has run once its prompt shows a number.
                page.wait_for_function(done, timeout=timeout_ms)
                page.wait_for_function(KERNEL_IDLE, timeout=timeout_ms)
            except Exception as err:
                page.screenshot(path=str(ARTIFACTS / f"{name}-failed.png"))
                not_ran, failed = page.evaluate(NOT_RAN), page.evaluate(FAILED_CELLS)
                raise AssertionError(f"{path}: cells not run {not_ran}, with errors "
                                     f"{failed}") from err
            if wait_for:
                page.locator(wait_for[0]).first.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / f"{name}.png"))
            return (page.inner_text(".jp-Notebook"), page.evaluate(FAILED_CELLS),
                    [i for i, _, _ in page.evaluate(NOT_RAN)])
        finally:
            browser.close()


def _notebook(lab_dir, path: str, cells) -> None:
    """Write a notebook of code `cells` (sources, (source, tags), or a lesson's own
    cells, metadata and all) at `path` in the folder JupyterLab serves."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    for cell in cells:
        if isinstance(cell, dict):  # a lesson's cell, as the lesson holds it
            nb.cells.append(nbformat.v4.new_code_cell(
                cell["source"], metadata=dict(cell["metadata"])))
            continue
        source, tags = cell if isinstance(cell, tuple) else (cell, [])
        nb.cells.append(nbformat.v4.new_code_cell(source))
        nb.cells[-1].metadata["tags"] = list(tags)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, lab_dir / "notebooks" / path)


def test_lesson_cells_show_a_plot_and_a_slider_in_a_browser(lab, tmp_path):
    """Lesson 00's first cell, its Japanese figure and its slider, run in JupyterLab
    as installed: the figure is drawn, the slider appears and answers (ipywidgets'
    JupyterLab extension works), no widget fails to display. The figure's cell is
    folded (tagged hide-input): its code shows collapsed, its figure in full."""
    import nbformat

    lesson = nbformat.read(ROOT / "notebooks" / "ja" / "00_setup.ipynb", as_version=4)

    def cell(marker):
        (found,) = [c for c in lesson.cells
                    if c.cell_type == "code" and marker in c.source]
        return found

    figure = cell("fig = plots.font_check()")
    assert "hide-input" in figure.metadata["tags"]
    _notebook(tmp_path, "ja/plot_and_slider.ipynb",
              [cell("labkit.require"), figure, cell("widgets.interact(")])
    text, failed, _ = _run_all(lab, "ja/plot_and_slider.ipynb", wait_for=(
        ".jp-OutputArea-output img", ".jp-OutputArea-output .widget-slider"))
    assert "Error displaying widget" not in text
    assert "plots.font_check()" not in text  # the folded code is not on the page
    assert failed == [], f"cells {failed} failed in the browser"
    assert "world_size=2: 32 samples per rank" in text  # the slider's function ran


def test_run_all_goes_past_the_cells_that_fail_on_purpose(lab, tmp_path):
    """Lessons tag the cells that fail on purpose `raises-exception` (lesson 10 has
    8 or more: tests/test_troubleshooting.py; nbval checks each raises): "Run All
    Cells" in JupyterLab runs on past them, and stops at a failure not tagged."""
    _notebook(tmp_path, "en/run_all.ipynb", [
        "x = 1",
        ("raise ValueError('a failure shown on purpose')", ["raises-exception"]),
        "print('ran past the tagged cell')",
        "raise RuntimeError('a failure not meant')",
        "print('never runs')",
    ])
    stopped = """() => window.jupyterapp.shell.currentWidget.content.widgets
        .some((cell, i) => i === 3 && cell.model.outputs.toJSON()
              .some(o => o.output_type === 'error'))"""
    text, failed, not_ran = _run_all(lab, "en/run_all.ipynb", done=stopped)
    assert failed == [1, 3], failed
    assert "ran past the tagged cell" in text
    assert not_ran == [4]  # Run All stopped at the untagged failure


# Where the heading (one of `anchors`, its ids) is in the notebook open at
# `path`: on screen when that notebook's tab is in front and the heading lies
# wholly inside both the notebook's scrolled area and the window.
HEADING_PLACE = r"""([path, anchors]) => {
    const shell = window.jupyterapp.shell;
    const w = shell.currentWidget;
    if (!w || !w.context || w.context.path !== path) {
        const open = [...shell.widgets('main')]
            .some(o => o.context && o.context.path === path);
        return open ? 'open in a tab behind ' + (w && w.context
            ? w.context.path : 'another') : 'not open';
    }
    const h = [...w.content.node.querySelectorAll('h1, h2, h3, h4, h5, h6')]
        .find(h => anchors.includes(h.getAttribute('data-jupyter-id') || h.id));
    if (!h) return 'not rendered';
    const r = h.getBoundingClientRect();
    const area = (w.content.outerNode || w.content.node).getBoundingClientRect();
    const on = r.height > 0 && r.top >= area.top && r.bottom <= area.bottom
        && r.top >= 0 && r.bottom <= window.innerHeight;
    return on ? 'on screen' : `off screen (top ${Math.round(r.top)})`;
}"""
TO_TOP = """() => { const n = window.jupyterapp.shell.currentWidget.content;
    (n.outerNode || n.node).scrollTop = 0; }"""
# Marks the link to `path#fragment` in the notebook on screen, for Playwright.
MARK_LINK = r"""([path, fragment]) => {
    const w = window.jupyterapp.shell.currentWidget;
    const a = w && [...w.node.querySelectorAll('.jp-Notebook a[href]')].find(a => {
        const href = decodeURIComponent(a.getAttribute('href'));
        return href.includes('/' + path) && href.endsWith('#' + fragment);
    });
    if (a) a.setAttribute('data-labkit-probe', path + '#' + fragment);
    return Boolean(a);
}"""


def _click(link):
    """Click `link` in a notebook, which may still scroll while it settles."""
    for _ in range(10):
        # Off screen, a cell may not be laid out yet (notebook windowing), and
        # Playwright finds nothing visible to click: show it first.
        link.evaluate("a => a.scrollIntoView({block: 'center'})")
        try:
            link.click(timeout=2_000)
            return
        except playwright.TimeoutError:
            continue
    link.click(timeout=2_000)


def _links_to_try(lang):
    """A few errata links, each to a heading below its notebook's first screen.

    The deepest linked heading of lessons 07 and 04, then one in the middle of
    lesson 04, which is already open by then: JupyterLab reveals its tab.
    """
    import links

    folder = ROOT / "notebooks" / lang
    errata = links._markdown_cells(folder / "16_errata.ipynb")
    found = [m.groups() for _, source in errata for m in links.LINK.finditer(source)]

    def depth(link):
        """How far down its notebook a link's heading is, from 0 to 1."""
        cells = links.heading_cells(folder / link[1])
        fragment = link[2].removeprefix(links.CELL_ID)
        return next((n for n, (cell_id, anchors) in enumerate(cells.items())
                     if fragment == cell_id or fragment in anchors), 0) / len(cells)

    by_lesson = {n: sorted({lk for lk in found if lk[1].startswith(n)},
                           key=lambda lk: (depth(lk), lk))
                 for n in ("04_", "07_")}
    assert all(by_lesson.values()), "the errata link lessons 04 and 07"
    lesson4 = by_lesson["04_"]
    return [by_lesson["07_"][-1], lesson4[-1], lesson4[len(lesson4) // 2]]


def _anchors(lang, target, fragment):
    """The heading ids a link to `target#fragment` should bring on screen."""
    import links

    cells = links.heading_cells(ROOT / "notebooks" / lang / target)
    return cells.get(fragment.removeprefix(links.CELL_ID), [fragment])


def test_errata_links_land_on_their_heading(lab_as_shipped):
    """In each language, the errata opened and loaded, its links clicked one after
    another, the first with no link clicked before it: each brings its lesson's
    tab to the front, scrolled to the heading."""
    base, token = lab_as_shipped
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    missed = []
    with playwright.sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            for lang in ("ja", "en"):
                # A clean workspace for each language (`reset`): reloaded, the
                # page would first restore the lessons the other pass opened,
                # and twice, both times under load, the first link clicked while
                # they loaded opened its lesson at the top (JupyterLab did not
                # scroll to the fragment).
                page.goto(f"{base}/lab/tree/{lang}/16_errata.ipynb?reset&token={token}")
                # The first link is clicked once the errata has loaded (its
                # kernel idle), as a learner clicks it, and no link before it.
                page.wait_for_function(KERNEL_IDLE, timeout=120_000)
                for n, (text, target, fragment) in enumerate(_links_to_try(lang)):
                    path, anchors = f"{lang}/{target}", _anchors(lang, target, fragment)
                    page.wait_for_function(MARK_LINK, arg=[path, fragment],
                                           timeout=60_000)
                    errata = page.evaluate("window.jupyterapp.shell.currentWidget.id")
                    _click(page.locator(f'[data-labkit-probe="{path}#{fragment}"]'))
                    try:
                        page.wait_for_function(
                            f"a => ({HEADING_PLACE})(a) === 'on screen'",
                            arg=[path, anchors], timeout=20_000)
                        time.sleep(1)  # it stays there while the cells above render
                        place = page.evaluate(HEADING_PLACE, [path, anchors])
                    except playwright.TimeoutError:
                        place = page.evaluate(HEADING_PLACE, [path, anchors])
                    if place != "on screen":
                        shot = ARTIFACTS / f"link-{lang}-{target}.png"
                        page.screenshot(path=str(shot))
                        missed.append(f"{lang}, click {n + 1}: "
                                      f"[{text}]({target}#{fragment}): {place}")
                    # The check can fail: at the notebook's top the heading is
                    # off screen (or, in a windowed notebook, not rendered).
                    page.evaluate(TO_TOP)
                    page.wait_for_timeout(300)
                    at_top = page.evaluate(HEADING_PLACE, [path, anchors])
                    assert at_top != "on screen", f"{path}#{fragment} is on top"
                    page.evaluate(f"window.jupyterapp.shell.activateById({errata!r})")
        finally:
            browser.close()
    assert not missed, "links that do not land on their heading:\n" + "\n".join(missed)


# Whether the notebook on screen is modified, once its kernel has told JupyterLab
# what it is (JupyterLab then writes the kernel's kernelspec and language_info
# into the notebook's metadata).
MODIFIED_ONCE_KERNEL_KNOWN = """async () => {
    const w = window.jupyterapp.shell.currentWidget;
    await w.sessionContext.session.kernel.info;
    await new Promise(done => setTimeout(done, 1000));
    return w.context.model.dirty;
}"""
TOASTS = """() => [...document.querySelectorAll('.Toastify__toast')]
    .map(t => t.innerText)"""


def test_a_lesson_opens_unmodified_and_without_a_news_question(lab_first_start,
                                                                tmp_path):
    """Opened, a lesson is not modified (closing it asks nothing) and saving it
    changes no byte: the built notebooks hold what JupyterLab and the kernel would
    write (nbformat 4.5, cell ids, the kernelspec, the kernel's language_info). No
    notification asks about Jupyter's news over the lesson. A notebook with only
    the language's name (as lessons were built before) shows the check can fail."""
    import json
    import platform

    import build_notebooks

    base, token = lab_first_start
    lesson = tmp_path / "notebooks" / "ja" / "00_setup.ipynb"
    nb = json.loads(lesson.read_text(encoding="utf-8"))
    assert nb["metadata"]["language_info"]["version"] == build_notebooks.PYTHON_VERSION
    if platform.python_version() != build_notebooks.PYTHON_VERSION:
        # The one thing a lesson cannot know for every learner: a kernel on
        # another Python records its own version (build_notebooks says so).
        nb["metadata"]["language_info"]["version"] = platform.python_version()
        lesson.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n",
                          encoding="utf-8")
    nb["metadata"]["language_info"] = {"name": "python"}
    (lesson.parent / "control.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    before = lesson.read_bytes()
    with playwright.sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{base}/lab/tree/ja/00_setup.ipynb?reset&token={token}")
            page.wait_for_function(KERNEL_IDLE, timeout=120_000)
            modified = page.evaluate(MODIFIED_ONCE_KERNEL_KNOWN)
            toasts = page.evaluate(TOASTS)
            news = page.evaluate("""async () => (await window.jupyterapp.serviceManager
                .settings.fetch('@jupyterlab/apputils-extension:notification'))
                .schema.properties.fetchNews.default""")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "lesson-opened.png"))
            page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
            page.wait_for_function("""() => !window.jupyterapp.shell.currentWidget
                .context.model.dirty""")
            page.wait_for_timeout(1000)
            page.evaluate("window.jupyterapp.commands.execute('docmanager:open', "
                          "{path: 'ja/control.ipynb'})")
            page.wait_for_function(
                "() => window.jupyterapp.shell.currentWidget.context.path"
                " === 'ja/control.ipynb'", timeout=30_000)
            page.wait_for_function(KERNEL_IDLE, timeout=120_000)
            control = page.evaluate(MODIFIED_ONCE_KERNEL_KNOWN)
        finally:
            browser.close()
    assert not modified, "opening the lesson modified it"
    assert lesson.read_bytes() == before, "saving the unmodified lesson changed it"
    assert news == "false" and toasts == [], toasts
    assert control, "a notebook without the kernel's language_info stays unmodified"
