"""The lessons run once per `make test`: nbval's run is kept (tools/nbval_record.py)
and reused while nothing it depends on changed (tools/executed.py)."""

import os
import subprocess
import sys
from pathlib import Path

import executed
import nbformat
import nbval_record
import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _notebook(path: Path, *cells) -> Path:
    """A notebook of code cells, each a source or (source, tags)."""
    nb = nbformat.v4.new_notebook()
    for cell in cells:
        source, tags = cell if isinstance(cell, tuple) else (cell, [])
        nb.cells.append(nbformat.v4.new_code_cell(source))
        nb.cells[-1].metadata["tags"] = list(tags)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _nbval(folder: Path, *notebooks: Path, wait_s: float = 15):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tools"))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "nbval_record", "-p",
         "no:cacheprovider", *executed.NBVAL, f"--executed-dir={folder}",
         f"--executed-leftover-wait={wait_s}", *map(str, notebooks)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_each_thing_a_lesson_s_outputs_depend_on_is_an_ingredient(tmp_path,
                                                                   monkeypatch):
    nb = _notebook(tmp_path / "en" / "x.ipynb", "print(1)")
    before = executed.ingredients(nb)
    assert executed.ingredients(nb) == before  # the same inputs, the same ingredients
    _notebook(nb, "print(2)")
    changes = {"notebook": executed.ingredients(nb)}
    for ingredient, name in (("labkit", "labkit_fingerprint"),
                             ("packages", "installed_packages"),
                             ("python", "python_version")):
        with monkeypatch.context() as patch:
            patch.setattr(executed, name, lambda *a, name=name: f"another {name}")
            changes[ingredient] = executed.ingredients(nb)
    for ingredient, now in changes.items():
        differ = {k for k in before if before[k] != now[k]}
        assert differ == ({ingredient} if ingredient == "notebook"
                          else {"notebook", ingredient}), ingredient


@pytest.mark.procs
def test_a_copy_is_reused_until_something_changes_then_the_lesson_runs_again(
        tmp_path, monkeypatch):
    nb = _notebook(tmp_path / "notebooks" / "en" / "x.ipynb", "print('hello')",
                   ("raise ValueError('meant')", ["raises-exception"]),
                   "import uuid; print(uuid.uuid4())")  # differs at each run
    folder = tmp_path / "executed"
    assert executed.stale([nb], folder) == {nb: "never executed"}

    ran, status = executed.refresh([nb], folder)
    assert (ran, status) == ([nb], 0)
    copy = nbformat.read(executed.copy_of(nb, folder), as_version=4)
    facts = copy.metadata[executed.META]
    assert facts["passed"] and facts["kernels_started"] == 1
    assert facts["ingredients"] == executed.ingredients(nb)
    assert copy.cells[0].outputs[0].text == "hello\n"  # the run's outputs, kept
    assert copy.cells[1].outputs[0].ename == "ValueError"

    assert executed.refresh([nb], folder) == ([], 0)  # nothing changed: reused
    monkeypatch.setattr(executed, "installed_packages", lambda: "torch==9.9")
    assert executed.stale([nb], folder) == {nb: "changed since it ran: packages"}
    ran, status = executed.refresh([nb], folder)
    assert (ran, status) == ([nb], 0)  # run again
    rerun = nbformat.read(executed.copy_of(nb, folder), as_version=4)
    assert rerun.cells[2].outputs[0].text != copy.cells[2].outputs[0].text


@pytest.mark.procs
def test_nbval_record_fails_a_meant_failure_gone_and_a_process_left(tmp_path):
    """What nbval lets by: a cell tagged raises-exception that raises nothing, and
    a process that outlives its notebook's kernel. Each fails, and the copy says
    its run failed (the site will not show it)."""
    quiet = _notebook(tmp_path / "en" / "quiet.ipynb",
                      ("x = 1  # the failure meant no longer happens",
                       ["raises-exception"]))
    leaves = _notebook(tmp_path / "en" / "leaves.ipynb", (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " start_new_session=True)\nprint(p.pid)"))
    folder = tmp_path / "executed"
    done = _nbval(folder, quiet, leaves, wait_s=1)
    left = None
    try:
        copy = nbformat.read(executed.copy_of(leaves, folder), as_version=4)
        left = int(copy.cells[0].outputs[0].text)
        assert done.returncode == 1, done.stdout[-3000:]
        assert "quiet.ipynb, code cell 0: tagged raises-exception, but it raised " \
            "nothing" in done.stdout
        assert "leaves.ipynb: processes left after its kernel stopped" in done.stdout
        assert f"pid {left}: " in done.stdout
        for nb in (quiet, leaves):
            assert executed.why_stale(nb, folder) == "its last run failed"
        # the run's own log: each notebook, with the kernels started for it
        assert "2 notebooks, 2 kernels started" in done.stdout
    finally:
        if left is not None and psutil.pid_exists(left):
            psutil.Process(left).kill()


def _msg(kind, parent="a", **content):
    return {"msg_type": kind, "parent_header": {"msg_id": parent},
            "header": {"msg_type": kind}, "content": content}


def test_outputs_are_kept_as_a_notebook_client_keeps_them():
    stream = {"name": "stdout"}
    figure = {"data": {"image/png": "AAA", "text/plain": "<Figure>"}, "metadata": {}}
    messages = [
        _msg("stream", text="a", **stream), _msg("stream", text="b", **stream),
        _msg("stream", parent="other", text="not this cell's", **stream),
        _msg("display_data", **figure),
        _msg("stream", text="c", **stream),  # after the figure, not before it
        _msg("display_data", data={"text/plain": "0%"}, metadata={},
             transient={"display_id": "bar"}),
        _msg("update_display_data", data={"text/plain": "100%"}, metadata={},
             transient={"display_id": "bar"}),
        _msg("clear_output", wait=True), _msg("stream", text="d", **stream),
    ]
    assert [o.get("text") or o["data"]["text/plain"] for o in
            nbval_record.outputs(messages[:7], "a")] == ["ab", "<Figure>", "c", "100%"]
    assert [o.text for o in nbval_record.outputs(messages, "a")] == ["d"]
