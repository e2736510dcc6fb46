"""The course's commands, the same on Linux, macOS and Windows.

    python tools/course.py lab      # set up .venv if needed, then open the course
    python tools/course.py test     # set up .venv if needed, then every check CI runs
    python tools/course.py lab --no-venv  # in a conda environment (environment.yml)
    python tools/course.py --help   # every step (setup, check, unit, nbval, site, ...)

`make TARGET` runs `python3 tools/course.py TARGET`: each step is written once,
here. Only the standard library is used, so any Python 3.10+ runs this before
.venv exists; every step after the set-up runs with .venv's Python. The set-up
installs torch first and alone (TORCH below, or --torch), then the course with
pip's constraints file constraints.txt, the lock: every other package at the
version it pins. `lab` installs what a learner needs (pyproject's lab extra);
`setup`, `test` and the other steps the maintainers' tools as well (dev).
`python tools/course.py lock` refreshes the lock.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"
# The torch the course was checked with (labkit.CHECKED_TORCH; a test keeps them
# equal). From PyPI this is the CPU build on macOS and Windows and a CUDA build of
# several GB on Linux: on Linux without an NVIDIA driver the set-up takes the CPU
# index instead (default_torch), unless --torch says otherwise.
TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl, measured with du.
CPU_WHEEL_MB = 192
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")
# torch alone from that index: what it requires (sympy, ...) comes with the course
# from pip's usual index, at the lock's versions.
CPU_TORCH = f"{TORCH} --no-deps --index-url {CPU_INDEX}"
# Left out of the lock: torch, which TORCH pins, and what only torch's CUDA builds
# bring. Each torch build pins those itself, exactly; in the lock they would clash
# with any other torch a learner asks for (TORCH="torch==2.14.1 ...").
TORCH_BUILD_PACKAGES = ("torch", "triton", "nvidia-*", "cuda-*")
# The oldest Python the lock resolves for: pyproject's requires-python (a test
# keeps them equal). Newer ones get their own pins where a package needs it.
PYTHON_FLOOR = "3.10"
# The set-up's extras, each holding the one before it (pyproject.toml).
EXTRAS = ("lab", "dev")
LINT = ["labkit", "tests", "tools", "bench", "course", "website"]
# make test's steps, in order; each name is a step of this script. Each runs
# pytest with -rs: a test skipped for a tool this system lacks (Chromium,
# unshare) says so in its step's summary, and fails instead where CI asks for
# the tool (LABKIT_REQUIRE_*: tests/conftest.py's unavailable, .ci/run).
TEST_STEPS = ["lint", "check-notebooks", "unit", "ecosystem-check", "nbval",
              "site-check", "nbgrader-check"]


def python_in(venv: Path) -> Path:
    """A virtual environment's Python: Scripts\\python.exe on Windows."""
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


class Course:
    """The steps, with the options they share (the venv, torch, dry run).
    `venv=None`: this Python's own environment (a conda one), set up already."""

    def __init__(self, venv: Path | None, torch: str | None = TORCH,
                 dry_run: bool = False):
        self.torch, self.torch_note = (torch, None) if torch else default_torch()
        self.own_env = venv is None
        self.venv = Path(sys.prefix) if venv is None else venv
        self.py = Path(sys.executable) if venv is None else python_in(venv)
        self.dry_run = dry_run
        self.ran: list[list[str]] = []  # each command, as run (or printed)
        self.set_up: str | None = None  # once a run: test's steps each ask for it

    def run(self, cmd: list, env: dict[str, str] | None = None,
            terminal: bool = False) -> None:
        """Run `cmd` in the repository's root; a failure ends the step with its
        exit status. `terminal`: the command owns Ctrl-C (JupyterLab asks
        whether to shut down), so this process ignores it while the command runs."""
        cmd = [str(part) for part in cmd]
        self.ran.append(cmd)
        shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        print(" ".join(filter(None, [shown, shlex.join(cmd)])), flush=True)
        if self.dry_run:
            return
        env = {**os.environ, **(env or {})}
        if terminal:
            # Started before SIGINT is ignored here: a child inherits an ignored
            # SIGINT, and Python then leaves it ignored (no KeyboardInterrupt).
            child = subprocess.Popen(cmd, cwd=ROOT, env=env)
            before = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                code = child.wait()
            finally:
                signal.signal(signal.SIGINT, before)
        else:
            code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if code:  # killed by signal N (POSIX): 128 + N, as a shell reports it
            raise SystemExit(128 - code if code < 0 else code)

    def pip_install(self, python: Path, *what: str, quiet: bool = True) -> None:
        self.run([python, "-m", "pip", "install", *["--quiet"] * quiet, *what])

    # --- set-up: .venv from the lock ---

    def setup(self, force: bool = False, extra: str = "dev") -> None:
        """Set up .venv (what every step does first): torch, then the course with
        pyproject's `extra` (lab for lab; dev, which holds lab, for the rest)."""
        if self.own_env or covers(self.set_up, extra):
            return
        stamp = self.venv / ".labkit-installed"
        have = installed_extra(stamp)
        if not force and covers(have, extra):
            return
        self.set_up = extra
        made_by = venv_version(self.venv)
        if made_by and made_by != RUNNING and not have:
            # e.g. a set-up under macOS's Python 3.9 failed, and 3.11 runs it now
            print(f"course.py: {self.venv} was made by Python {made_by}, this is "
                  f"Python {RUNNING}: making it again", flush=True)
            if not self.dry_run:
                shutil.rmtree(self.venv)
        if self.dry_run or not self.py.exists():
            self.run([sys.executable, "-m", "venv", self.venv])
        # torch first and alone, so that nothing below pulls another build; the
        # lock then holds the packages torch needs (sympy, ...) at its versions.
        # pip shows its progress: these two downloads take minutes.
        if force or not have:
            if self.torch_note:
                print(self.torch_note, flush=True)
            self.pip_install(self.py, *shlex.split(self.torch), quiet=False)
        self.pip_install(self.py, "-c", LOCK, "-e", f".[{extra}]", quiet=False)
        if not self.dry_run:
            stamp.write_text(f"{extra}\n")

    def grading(self) -> None:
        """nbgrader, for the nbgrader steps only (pyproject's grading extra)."""
        self.setup()
        stamp = self.venv / ".labkit-grading"
        if not fresh(stamp, self.venv / ".labkit-installed"):
            self.pip_install(self.py, "-c", LOCK, "-e", ".[grading]")
            self.touch(stamp)

    def ecosystem_venv(self) -> Path:
        """build/ecosystem-venv: the ecosystem extra over .venv's packages (a .pth
        file), so .venv stays as a learner's and its lesson runs stay fresh."""
        self.setup()
        venv = ROOT / "build" / "ecosystem-venv"
        py, stamp = python_in(venv), venv / ".labkit-installed"
        if not fresh(stamp, ROOT / "pyproject.toml", LOCK,
                     self.venv / ".labkit-installed"):
            if self.dry_run or not py.exists():
                self.run([self.py, "-m", "venv", venv])
            if not self.dry_run:
                (purelib(py) / "labkit-venv.pth").write_text(f"{purelib(self.py)}\n")
            self.pip_install(py, "-c", LOCK, "-e", ".[ecosystem]")
            self.touch(stamp)
        return py

    def touch(self, stamp: Path) -> None:
        if not self.dry_run:
            stamp.touch()

    def lock(self) -> None:
        """Resolve pyproject's dependencies and every extra for Linux, macOS and
        Windows at once (uv's universal resolution: a platform's packages carry
        its marker) with the checked torch, and write constraints.txt. Needs
        .venv (any earlier set-up), not one made from the current lock, so that
        a lock pyproject.toml no longer agrees with can be replaced."""
        self.pip_install(self.py, "-c", LOCK, "uv")
        pin = ROOT / "build" / "lock-torch.txt"
        if not self.dry_run:
            pin.parent.mkdir(exist_ok=True)
            pin.write_text(f"{self.torch.split()[0]}\n")
        out = ROOT / "build" / "lock-compiled.txt"
        self.run([self.py, "-m", "uv", "pip", "compile", "--quiet", "pyproject.toml",
                  "--all-extras", "--universal", "--python-version", PYTHON_FLOOR,
                  "-c", pin, "--upgrade",
                  "--custom-compile-command", "python tools/course.py lock",
                  "-o", out])
        if not self.dry_run:
            LOCK.write_text(drop_packages(out.read_text(), TORCH_BUILD_PACKAGES))

    # --- the course ---

    def lab(self, root: str = "notebooks", args: list[str] = ()) -> None:
        """Open the course in JupyterLab (on 127.0.0.1 only), with the course's
        defaults for its settings (jupyterlab-settings/overrides.json5)."""
        self.setup(extra="lab")
        # Jupyter refuses to run as root unless told; containers and CI often are.
        as_root = ["--allow-root"] if getattr(os, "geteuid", lambda: 1)() == 0 else []
        self.run([self.py, "-m", "jupyterlab", "--ServerApp.ip=127.0.0.1",
                  f"--ServerApp.root_dir={root}",
                  f"--LabApp.app_settings_dir={ROOT / 'jupyterlab-settings'}",
                  *as_root, *args], terminal=True)

    def notebooks(self) -> None:
        self.setup()
        self.run([self.py, "tools/build_notebooks.py"])

    def check_notebooks(self) -> None:
        self.setup()
        self.run([self.py, "tools/build_notebooks.py", "--check"])

    def lint(self) -> None:
        self.setup()
        self.run([self.py, "-m", "ruff", "check", *LINT])

    def unit(self, args: list[str] = ()) -> None:
        self.setup()
        self.run([self.py, "-m", "pytest", "-rs", *(args or ["tests"])])

    def check(self) -> None:
        """The quick check: lint, notebooks in sync, the tests that start no process."""
        self.lint()
        self.check_notebooks()
        self.run([self.py, "-m", "pytest", "-rs", "-q", "-m", "not procs", "tests"])

    def nbval(self, paths: list[str] = ()) -> None:
        """Lessons run by nbval (every one of both languages, or `paths`), each run
        kept in build/executed/ by tools/nbval_record.py."""
        self.setup()
        sys.path.insert(0, str(ROOT / "tools"))
        from executed import NBVAL  # how make test runs a lesson: one place

        self.run([self.py, "-m", "pytest", "-rs", "-p", "nbval_record", *NBVAL,
                  *(paths or ["notebooks/ja", "notebooks/en"])],
                 env={"PYTHONPATH": os.pathsep.join(
                     filter(None, ["tools", os.environ.get("PYTHONPATH")]))})

    def course(self) -> None:
        """Every notebook of both languages executed headless, as JupyterLab runs it."""
        self.setup()
        lessons = [path for lang in ("ja", "en") for path in
                   sorted(glob.glob(f"notebooks/{lang}/*.ipynb", root_dir=ROOT))]
        self.run([self.py, "tools/execute.py", *lessons])

    def executed(self) -> None:
        self.setup()
        self.run([self.py, "tools/executed.py"])

    def student(self) -> None:
        self.setup()
        self.run([self.py, "tools/student_copies.py"])

    def site(self) -> None:
        """The course as a website in build/site: both languages, each lesson as
        nbval last ran it; a Sphinx warning fails the build."""
        self.student()
        self.executed()
        for lang in ("ja", "en"):
            html = ROOT / "build" / "sphinx" / lang / "html"
            self.run([self.py, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                      "-d", f"build/sphinx/{lang}/doctrees", f"website/{lang}",
                      f"build/sphinx/{lang}/html"])
            if not self.dry_run:
                shutil.rmtree(ROOT / "build" / "site" / lang, ignore_errors=True)
                shutil.copytree(html, ROOT / "build" / "site" / lang)
        if not self.dry_run:
            shutil.copy(ROOT / "website" / "index.html", ROOT / "build" / "site")

    def site_check(self) -> None:
        self.site()
        self.run([self.py, "-m", "pytest", "-rs", "tests/test_site.py"],
                 env={"LABKIT_SITE": "build/site"})

    def nbgrader(self, out: str = "build/nbgrader") -> None:
        self.grading()
        self.run([self.py, "tools/nbgrader_course.py", "--out", out])

    def nbgrader_check(self, which: str = "1") -> None:
        self.grading()
        self.run([self.py, "-m", "pytest", "-rs", "tests/test_nbgrader.py"],
                 env={"LABKIT_NBGRADER": which})

    def ecosystem_check(self) -> None:
        """Lesson 09's Lightning and Accelerate cells, required to assert."""
        py = self.ecosystem_venv()
        self.run([py, "-m", "pytest", "-rs",
                  "tests/test_claims_ledger.py::test_sections_asserted_only_with_the_"
                  "ecosystem_extra_assert_there",
                  "tests/test_scaleout.py::test_frameworks_call_no_sync_where_they_"
                  "accumulate"], env={"LABKIT_REQUIRE_ECOSYSTEM": "1"})

    def test(self) -> None:
        """Every step CI runs, in order, each one's time printed as it ends and all
        of them at the end (also in build/test-times.txt); stops at a failure."""
        self.setup()
        took = []
        for step in TEST_STEPS:
            start, status = time.monotonic(), 0
            try:
                getattr(self, step.replace("-", "_"))()
            except SystemExit as failed:
                status = failed.code or 1
            took.append(f"test: {step} {'FAILED ' if status else ''}in "
                        f"{time.monotonic() - start:.0f} s")
            print(took[-1], flush=True)
            if not self.dry_run:  # a dry run leaves a real run's times alone
                (ROOT / "build").mkdir(exist_ok=True)
                (ROOT / "build" / "test-times.txt").write_text("\n".join(took) + "\n")
            if status:
                print(*took, sep="\n")
                raise SystemExit(status)
        print("test: every step passed", *took, sep="\n")


RUNNING = f"{sys.version_info[0]}.{sys.version_info[1]}"


def python_problem(version: tuple = tuple(sys.version_info),
                   executable: str = sys.executable) -> str | None:
    """Why this Python cannot set up the course (one line), or None."""
    floor = tuple(int(part) for part in PYTHON_FLOOR.split("."))
    if tuple(version[:2]) >= floor:
        return None
    found = ".".join(str(part) for part in version[:3])
    return (f"course.py: this is Python {found} ({executable}); the course needs "
            f"Python {PYTHON_FLOOR} or newer: install Python 3.11 (python.org, or "
            "your system's packages) and run this script with it")


def venv_version(venv: Path) -> str | None:
    """major.minor of the Python that made `venv` (its pyvenv.cfg), or None."""
    cfg = venv / "pyvenv.cfg"
    if not cfg.is_file():
        return None
    for line in cfg.read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("version", "version_info"):  # venv's, virtualenv's
            return ".".join(value.strip().split(".")[:2])
    return None


def default_torch(platform: str = sys.platform, driver: Path = NVIDIA_DRIVER,
                  which=shutil.which) -> tuple[str, str | None]:
    """The torch to install when --torch is not given, and a line saying why
    where it is not PyPI's: on Linux without an NVIDIA driver, the CPU build
    (PyPI's for Linux is a CUDA build of several GB that needs one)."""
    if not platform.startswith("linux") or driver.exists() or which("nvidia-smi"):
        return TORCH, None
    return (CPU_TORCH,
            f"course.py: no NVIDIA driver here, so torch's CPU build (a "
            f"{CPU_WHEEL_MB} MB download); --torch chooses another")


def installed_extra(stamp: Path) -> str | None:
    """The extra a set-up installed (its stamp; an empty stamp is dev's), or None
    where there is none or pyproject.toml or the lock changed since."""
    if not fresh(stamp, ROOT / "pyproject.toml", LOCK):
        return None
    return stamp.read_text().strip() or "dev"


def covers(have: str | None, extra: str) -> bool:
    """Whether an install of the extra `have` holds `extra` (EXTRAS' order)."""
    return have in EXTRAS and EXTRAS.index(have) >= EXTRAS.index(extra)


def fresh(stamp: Path, *sources: Path) -> bool:
    """Whether `stamp` exists and is newer than every one of `sources`."""
    return stamp.exists() and all(stamp.stat().st_mtime >= s.stat().st_mtime
                                  for s in sources if s.exists())


def purelib(python: Path) -> Path:
    """Where `python` installs pure-Python packages (site-packages)."""
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    # UTF-8 both ways: a user's path (C:\Users\田中) piped in cp1252 would fail
    return Path(subprocess.run([str(python), "-X", "utf8", "-c", where], check=True,
                               capture_output=True, encoding="utf-8").stdout.strip())


def owned_by_torch(name: str, patterns: tuple[str, ...] = TORCH_BUILD_PACKAGES) -> bool:
    """Whether the package `name` (normalized: lower case, dashes) is torch or
    comes with its build only, and so is left out of the lock."""
    from fnmatch import fnmatch

    return any(fnmatch(name, pattern) for pattern in patterns)


def drop_packages(compiled: str, patterns: tuple[str, ...]) -> str:
    """uv's compiled requirements less the packages whose name matches one of
    `patterns` (fnmatch), each with the comment lines under it."""
    kept, dropping = [], False
    for line in compiled.splitlines():
        if line and not line.startswith((" ", "#")):
            name = line.split("==")[0].split(";")[0].strip().lower()
            dropping = owned_by_torch(name, patterns)
        elif not line.startswith(" "):
            dropping = False  # a top-level comment or a blank line ends an entry
        if not dropping:
            kept.append(line)
    return "\n".join(kept) + "\n"


STEPS = {
    "setup": "set up .venv only, with the tools test needs (what test does first); "
             "--force installs again",
    "lab": "open the course in JupyterLab (setting up .venv with what a learner "
           "needs); --root FOLDER (e.g. dist/student), JupyterLab's own options "
           "after --",
    "test": "every check CI runs: " + ", ".join(TEST_STEPS),
    "check": "the quick check while you edit: lint, notebooks in sync, the tests "
             "that start no process",
    "lint": "ruff", "check-notebooks": "notebooks/ in sync with course/",
    "notebooks": "write notebooks/ja and notebooks/en from course/",
    "unit": "the unit tests (pytest's own arguments after --)",
    "nbval": "every lesson (or the notebooks named) run by nbval",
    "course": "every notebook executed headless, as JupyterLab runs it",
    "executed": "run again the lessons whose kept run is missing, failed or stale",
    "student": "student copies without solutions in dist/student",
    "site": "the course as a website in build/site",
    "site-check": "the site built, then checked",
    "nbgrader": "the course as nbgrader assignments (--out FOLDER)",
    "nbgrader-check": "nbgrader's round trip on a sample",
    "nbgrader-check-all": "nbgrader's round trip on every assignment",
    "ecosystem-check": "lesson 09's Lightning and Accelerate cells "
                       "(in build/ecosystem-venv)",
    "lock": "refresh constraints.txt from pyproject.toml (uv, universal resolution)",
    "clean-venv": "remove .venv",
}


def parser() -> argparse.ArgumentParser:
    """The command line: a step, its arguments, the options the steps share."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {name:20} {what}" for name, what in STEPS.items()))
    parser.add_argument("step", choices=STEPS, metavar="STEP")
    parser.add_argument("args", nargs="*", help="notebooks for nbval; after --, "
                        "pytest's (unit) or JupyterLab's (lab) own arguments")
    parser.add_argument("--venv", default=".venv", help="the virtual environment")
    parser.add_argument("--no-venv", action="store_true",
                        help="run with this Python's own environment, installing "
                        "nothing (a conda environment made from environment.yml)")
    parser.add_argument("--torch", help=f"the torch to install first (default "
                        f"{TORCH}; on Linux without an NVIDIA driver, '{CPU_TORCH}')")
    parser.add_argument("--root", default="notebooks", help="the folder lab opens")
    parser.add_argument("--out", default="build/nbgrader", help="nbgrader's course")
    parser.add_argument("--force", action="store_true", help="setup: install again")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands, run none")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The options of `argv`; what follows `--` joins the step's arguments as it
    is (pytest's or JupyterLab's options), and `--` alone adds nothing."""
    own, passed = argv, []
    if "--" in argv:
        cut = argv.index("--")
        own, passed = argv[:cut], argv[cut + 1:]
    options = parser().parse_args(own)
    options.args += passed
    return options


def main(argv: list[str] | None = None) -> None:
    problem = python_problem(tuple(sys.version_info))  # no := : 3.7 reads this too
    if problem:
        raise SystemExit(problem)
    options = parse(sys.argv[1:] if argv is None else argv)
    venv = Path(options.venv)
    course = Course(None if options.no_venv else
                    venv if venv.is_absolute() else ROOT / venv, options.torch,
                    options.dry_run)
    step, args = options.step, options.args
    if step == "setup":
        course.setup(force=options.force)
    elif step == "lab":
        course.lab(options.root, args)
    elif step in ("unit", "nbval"):
        getattr(course, step)(args)
    elif step == "nbgrader":
        course.nbgrader(options.out)
    elif step == "nbgrader-check-all":
        course.nbgrader_check("all")
    elif step == "clean-venv":
        if course.own_env:  # never this Python's own environment
            raise SystemExit("course.py: clean-venv removes --venv; with --no-venv "
                             "there is none")
        shutil.rmtree(course.venv, ignore_errors=True)
    else:
        getattr(course, step.replace("-", "_"))()


if __name__ == "__main__":
    main()
