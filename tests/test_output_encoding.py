"""What a Windows learner meets, each faked on Linux: output that is not UTF-8, a
kernel that does not forward a child's output, no bash, backslashes in paths, a
host name that resolves to the LAN's address."""

import contextlib
import io
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import SimpleNamespace

import nbformat
import psutil
import pytest
from lesson_cells import finder

import labkit
from labkit import __main__ as cli
from labkit import doctor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "website"))

import labkit_site  # noqa: E402
import nbgrader_course  # noqa: E402

# --- the doctor's report where stdout is cp1252 or cp932 ------------------------

@pytest.mark.procs
@pytest.mark.parametrize(("encoding", "lang", "title"), [
    ("cp1252", "en", "== What this machine can run =="),
    ("cp932", "ja", "== この環境で動くもの =="),
    # Japanese has no cp1252: escaped, so a teacher can still read what it said
    ("cp1252", "ja", "== \\u3053\\u306e\\u74b0\\u5883"),
])
def test_doctor_redirected_to_a_file_in_a_windows_encoding_is_readable(
        tmp_path, encoding, lang, title):
    """`python -m labkit doctor > report.txt` on Windows writes cp1252 or cp932,
    which have no ✓: the report says OK and NO there, and the command succeeds."""
    report = tmp_path / "report.txt"
    with report.open("wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "labkit", "--lang", lang, "doctor"], stdout=out,
            stderr=subprocess.PIPE, cwd=ROOT, timeout=120,
            env={**os.environ, "PYTHONIOENCODING": encoding})
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    text = report.read_bytes().decode(encoding)
    assert text.startswith(title), text[:200]
    assert "gloo OK" in text and "  OK " in text, text


def test_the_report_keeps_its_marks_where_the_output_has_them(monkeypatch):
    """UTF-8 output keeps ✓ and ✗; cp1252 output gets OK and NO."""
    shown = {}
    for encoding in ("utf-8", "cp1252"):
        out = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(doctor, "format_report",
                            lambda report, marks=doctor.MARKS: " ".join(marks))
        monkeypatch.setattr(doctor, "collect", lambda: None)
        assert cli.main(["doctor"]) == 0
        out.flush()
        shown[encoding] = out.buffer.getvalue().decode(encoding).strip()
    assert shown == {"utf-8": "✓ ✗", "cp1252": "OK NO"}


def test_an_encoding_failure_is_not_reported_as_bad_input(monkeypatch):
    """A UnicodeEncodeError is a ValueError, but never the learner's input: it is
    not turned into the one-line "error:" of a bad argument."""
    def collect():
        raise UnicodeEncodeError("charmap", "✓", 0, 1, "character maps to <undefined>")

    monkeypatch.setattr(doctor, "collect", collect)
    with pytest.raises(UnicodeEncodeError):
        cli.main(["doctor"])


# --- lessons 00 and 04: the child's output, where ipykernel does not forward it --

def _run_in_kernel(setup: str, cell: str) -> str:
    """Run `cell` after `setup` in a kernel that forwards no file-descriptor
    output, as ipykernel does on Windows; the cell's stream outputs, as the
    notebook keeps them."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(setup),
                                         nbformat.v4.new_code_cell(cell)])
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   extra_arguments=["--IPKernelApp.capture_fd_output=False"],
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    return "".join(o.get("text", "") for o in nb.cells[1].outputs
                   if o.output_type == "stream")


@pytest.mark.procs
def test_lesson_00_shows_the_doctor_s_report_in_the_notebook():
    cell = finder("00_setup")('"doctor"')
    shown = _run_in_kernel("import labkit, torch\nlabkit.set_lang('en')", cell)
    assert "== What this machine can run ==" in shown, shown


@pytest.mark.procs
def test_lesson_04_shows_the_misuse_run_in_the_notebook():
    cell = finder("04_no_sync")('"misuse"')
    shown = _run_in_kernel("from labkit import checks", cell)
    assert "bare_call_allreduce_calls: " in shown, shown


# --- lesson 00's first all-reduce listens on loopback only -----------------------

def _lan_address() -> str | None:
    return next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET and not a.address.startswith("127.")),
                None)


@pytest.mark.procs
def test_lesson_00_s_all_reduce_listens_on_loopback_only(tmp_path):
    """gloo listens on the address the host name resolves to: faked here to be
    this machine's LAN address (as on most Windows PCs, where a listen there brings
    up the firewall's prompt); lesson 00's cell keeps it on 127.0.0.1."""
    lan = _lan_address()
    if lan is None or shutil.which("unshare") is None:
        pytest.skip("needs a non-loopback IPv4 address and unshare")
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{lan} {socket.gethostname()}\n")
    # Lesson 00's own %%px cell, which asserts on each rank, on ranks that
    # cluster.start makes as the lesson does.
    script = tmp_path / "all_reduce.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from lesson_cells import finder
from labkit import cluster

ranks = cluster.start(2)
try:
    ranks.execute(finder("00_setup")("psutil.CONN_LISTEN"))
    heard = ranks.pull("listening")
    print("listening on", heard)
    assert all(h and h <= {{"127.0.0.1", "::1"}} for h in heard), heard
finally:
    ranks.stop()
""")
    # a mount namespace of its own, where /etc/hosts says what the test wants
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$1" "$2"',
         str(hosts), sys.executable, str(script)],
        capture_output=True, encoding="utf-8", cwd=ROOT, timeout=120)
    if done.returncode != 0 and "listening on" not in done.stdout:
        if "unshare" in done.stderr or "mount" in done.stderr:
            pytest.skip(f"no user namespaces here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stdout + done.stderr


# --- lesson 09 without bash ---------------------------------------------------------

def _lesson_09_scripts_cell(monkeypatch, scripts=None) -> str:
    from labkit.cluster import torchrun

    if scripts is not None:
        monkeypatch.setattr(torchrun, "JOB_SCRIPTS", scripts)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(finder("09_ecosystem")('"-n"'), {"torchrun": torchrun})
    return out.getvalue()


def test_lesson_09_says_so_where_there_is_no_bash(monkeypatch):
    def no_bash(*args, **kwargs):  # what Windows gives for ["bash", ...]
        raise FileNotFoundError(2, "The system cannot find the file specified")

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    monkeypatch.setattr(subprocess, "run", no_bash)
    shown = _lesson_09_scripts_cell(monkeypatch)
    for name in ("slurm_example.sh", "pbs_example.sh", "pjm_example.sh"):
        assert f"(bash -n {name}: skipped, no bash here)" in shown, shown


@pytest.mark.procs
def test_lesson_09_s_bash_check_still_finds_a_broken_script(monkeypatch, tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    broken = tmp_path / "broken.sh"
    broken.write_text('#SBATCH -N 2\nif true; then\n  echo "$PWD/labkit/cluster/'
                      'torchrun_node.sh"\n')  # no fi
    with pytest.raises(AssertionError, match="syntax error"):
        _lesson_09_scripts_cell(monkeypatch, {"slurm": broken})


# --- the nbgrader course's config with a Windows path -------------------------------

@pytest.mark.parametrize(("course", "database"), [
    (PureWindowsPath(r"C:\Users\tanaka\labkit\build\nbgrader"),
     "C:/Users/tanaka/labkit/build/nbgrader/gradebook.db"),  # \U: an escape
    (PureWindowsPath(r"C:\work\labkit\build\nbgrader"),
     "C:/work/labkit/build/nbgrader/gradebook.db"),  # \b and \n: control characters
    (PurePosixPath("/home/tanaka/labkit/build/nbgrader"),
     "/home/tanaka/labkit/build/nbgrader/gradebook.db"),
])
def test_the_nbgrader_config_keeps_the_course_s_path(course, database):
    from sqlalchemy.engine import make_url
    from traitlets.config import Config

    c = Config()
    code = compile(nbgrader_course.config_text(course), "nbgrader_config.py", "exec")
    exec(code, {"get_config": lambda: c})
    assert c.CourseDirectory.root == str(course)
    url = make_url(c.CourseDirectory.db_url)
    assert url.drivername == "sqlite" and url.database == database


def test_the_nbgrader_config_s_database_opens(tmp_path):
    from sqlalchemy import create_engine, text
    from traitlets.config import Config

    c = Config()
    exec(nbgrader_course.config_text(tmp_path), {"get_config": lambda: c})
    with create_engine(c.CourseDirectory.db_url).connect() as db:
        assert db.execute(text("select 1")).scalar() == 1
    assert (tmp_path / "gradebook.db").exists()


# --- the command that opens the course, for each system -----------------------------

@pytest.mark.parametrize("lang", ["ja", "en"])
def test_the_instructions_give_the_command_for_each_system(lang, tmp_path):
    """labkit.require's error and the note under each lesson's title on the site
    name the command for Linux and macOS and the one for Windows, which has no make."""
    commands = ("python3 tools/course.py lab", r"py tools\course.py lab")
    before = labkit.get_lang()
    labkit.set_lang(lang)
    try:
        with pytest.raises(RuntimeError) as refused:
            labkit.require("99.0")
    finally:
        labkit.set_lang(before)
    lesson = tmp_path / "lessons" / "00_setup.ipynb"
    lesson.parent.mkdir()
    nbformat.write(nbformat.v4.new_notebook(), lesson)
    note = labkit_site._run_note(SimpleNamespace(srcdir=str(tmp_path)), lang,
                                 "lessons/00_setup").astext()
    for said in (str(refused.value), note):
        assert all(command in said for command in commands), said
